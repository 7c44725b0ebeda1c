"""Datasets and worker_init_fns of :mod:`workers.test_corners`.

Module level, so that spawn workers can unpickle them (by reference to
``workers.corner_datasets``). Iterable datasets derive from torch's ``IterableDataset`` and ask
whichever library's worker runs them for its worker info, so torch can run them as the oracle.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch.utils.data as tud

from _support.datasets import any_worker_info


class InitFailed(Exception):
    """Raised by :class:`FailingInit` (a type of our own, so the test knows where it came from)."""


class OpenFailed(Exception):
    """Raised by :class:`OneStreamFails` when a worker's stream is opened."""


class StopAt:
    """Map-style: the index itself, but ``__getitem__(at)`` raises StopIteration."""

    def __init__(self, n: int, at: int) -> None:
        self.n = n
        self.at = at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == self.at:
            raise StopIteration
        return index


class FailingInit:
    """A worker_init_fn that raises :class:`InitFailed` in worker ``worker`` only."""

    def __init__(self, worker: int) -> None:
        self.worker = worker

    def __call__(self, worker_id: int) -> None:
        if worker_id == self.worker:
            raise InitFailed(f"worker_init_fn refused worker {worker_id}")


class OneStreamFails(tud.IterableDataset):
    """Worker ``w`` streams ``w, w + num_workers, ...`` below ``n``, except that worker
    ``bad``'s ``__iter__`` raises :class:`OpenFailed`."""

    def __init__(self, n: int, bad: int) -> None:
        self.n = n
        self.bad = bad

    def __iter__(self) -> Iterator[int]:
        info = any_worker_info()
        if info.id == self.bad:
            raise OpenFailed(f"stream of worker {info.id} cannot be opened")
        return iter(range(info.id, self.n, info.num_workers))


class ExitingStream(tud.IterableDataset):
    """Yields ``after`` samples, then the worker process exits with code 3."""

    def __init__(self, after: int) -> None:
        self.after = after

    def __iter__(self) -> Iterator[int]:
        yield from range(self.after)
        os._exit(3)


class ExitingAt:
    """Map-style: the worker process exits with code 3 when asked for index ``at``."""

    def __init__(self, n: int, at: int) -> None:
        self.n, self.at = n, at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == self.at:
            os._exit(3)
        return index
