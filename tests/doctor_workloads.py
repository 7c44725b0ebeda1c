"""Loaders for the doctor's tests (``tests/test_doctor.py``), named as ``MODULE:FUNCTION``.

Slowness is made with ``time.sleep``, which releases the GIL and takes no CPU: the figures hold
on a busy two-core machine, and thread workers overlap it as they would overlap I/O.
"""

from __future__ import annotations

import time

import torch
import torch.utils.data

import ferry

SLEEP_S = 0.01  # per sample
BATCH_SIZE = 4
LENGTH = 400  # 100 batches: long enough an epoch that worker start-up is a small part


class SleepyDataset(ferry.Dataset[torch.Tensor]):
    """Reads a sample in ``SLEEP_S`` seconds; no ``__getitems__``."""

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(SLEEP_S)
        return torch.full((16,), float(index))


def slow_loader() -> ferry.DataLoader[torch.Tensor]:
    """The loader does all the work in the main process: more workers would help."""
    return ferry.DataLoader(SleepyDataset(), batch_size=BATCH_SIZE)


def slow_torch_loader() -> torch.utils.data.DataLoader[torch.Tensor]:
    return torch.utils.data.DataLoader(SleepyDataset(), batch_size=BATCH_SIZE)


def fast_loader() -> ferry.DataLoader[tuple[torch.Tensor, ...]]:
    """In-memory rows gathered in one call a batch: nothing to gain from options."""
    rows = ferry.TensorDataset(torch.randn(4096, 8), torch.arange(4096))
    return ferry.DataLoader(rows, batch_size=64)


def auto_loader() -> ferry.DataLoader[torch.Tensor]:
    """The loader chooses its number of workers."""
    return ferry.DataLoader(SleepyDataset(), batch_size=BATCH_SIZE, num_workers="auto")


def not_a_loader() -> list[int]:
    return [1, 2, 3]


def broken_loader() -> ferry.DataLoader[torch.Tensor]:
    raise RuntimeError("the dataset's files are missing")


NOT_CALLABLE = 42
