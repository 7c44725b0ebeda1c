"""Datasets that ask torch's get_worker_info() shard correctly in ferry's process workers, and
ferry.get_worker_info() answers inside torch's own workers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils.data as tud

import ferry


class AsksTorch(tud.IterableDataset):  # type: ignore[type-arg]
    """A stream written for torch: shards itself with torch's get_worker_info()."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = tud.get_worker_info()
        if info is None:
            return iter(range(self.n))
        return iter(range(info.id, self.n, info.num_workers))


class AsksFerry(tud.IterableDataset):  # type: ignore[type-arg]
    """A stream for torch's own loader (it only knows its own base class) asking ferry."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = ferry.get_worker_info()
        if info is None:
            return iter(range(self.n))
        return iter(range(info.id, self.n, info.num_workers))


def _items(loader: Any) -> list[int]:
    return sorted(int(x) for batch in loader for x in batch)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_dataset_asking_torch_is_sharded_in_ferry_process_workers(context: str) -> None:
    loader = ferry.DataLoader(
        AsksTorch(20), batch_size=3, num_workers=2, multiprocessing_context=context
    )
    assert _items(loader) == list(range(20))  # each item once: not one copy per worker
    expected = list(tud.DataLoader(AsksTorch(20), batch_size=3, num_workers=2))
    got = list(ferry.DataLoader(AsksTorch(20), batch_size=3, num_workers=2))
    assert [b.tolist() for b in got] == [b.tolist() for b in expected]


@pytest.mark.timeout(60)
def test_ferry_get_worker_info_answers_inside_torch_workers() -> None:
    loader = tud.DataLoader(AsksFerry(20), batch_size=3, num_workers=2)
    assert _items(loader) == list(range(20))


def test_main_process_sees_no_worker() -> None:
    assert ferry.get_worker_info() is None
    assert tud.get_worker_info() is None
    list(ferry.DataLoader(AsksTorch(4), num_workers=0))
    assert tud.get_worker_info() is None
    assert torch.initial_seed() is not None
