"""Datasets of :mod:`workers.test_balance` (``balance_workers=True``), at module level so that
process workers can unpickle them under any start method."""

from __future__ import annotations

import time

import torch

import ferry


class Uneven(ferry.Dataset[torch.Tensor]):
    """Sample ``i`` is ``[i, id of the worker that made it]``; worker ``slow_worker`` takes
    ``slow`` seconds a sample, the others ``fast``: a worker on a slower CPU."""

    def __init__(self, n: int, slow_worker: int = 0, slow: float = 0.02, fast: float = 0.001):
        self.n, self.slow_worker, self.slow, self.fast = n, slow_worker, slow, fast

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        info = ferry.get_worker_info()
        worker = -1 if info is None else info.id
        time.sleep(self.slow if worker == self.slow_worker else self.fast)
        return torch.tensor([index, worker])
