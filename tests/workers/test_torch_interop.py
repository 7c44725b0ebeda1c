"""Datasets that ask torch's get_worker_info() shard correctly in ferry's process and thread
workers, and ferry.get_worker_info() answers inside torch's own workers."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import ferry
from ferry._core import info as info_module


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


@pytest.mark.timeout(60)
def test_a_dataset_asking_torch_is_sharded_in_ferry_thread_workers() -> None:
    """torch's get_worker_info() answers per thread inside ferry's worker threads."""
    threads = ferry.DataLoader(AsksTorch(20), batch_size=3, num_workers=2, worker_type="thread")
    processes = ferry.DataLoader(AsksTorch(20), batch_size=3, num_workers=2)
    for _ in range(3):  # the bug it guards against was nondeterministic
        assert [b.tolist() for b in threads] == [b.tolist() for b in processes]
    assert _items(threads) == list(range(20))
    # Outside ferry's threads the answer is still torch's own.
    assert tud.get_worker_info() is None
    assert _items(tud.DataLoader(AsksTorch(20), batch_size=3, num_workers=2)) == list(range(20))
    assert _items(tud.DataLoader(AsksFerry(20), batch_size=3, num_workers=2)) == list(range(20))


class ByName(tud.IterableDataset):  # type: ignore[type-arg]
    """A stream whose module bound torch's function to a name of its own at import."""

    def __init__(self, n: int, module: types.ModuleType) -> None:
        self.n = n
        self.module = module

    def __iter__(self) -> Any:
        info = self.module.get_worker_info()
        if info is None:
            return iter(range(self.n))
        return iter(range(info.id, self.n, info.num_workers))


@pytest.mark.timeout(60)
def test_a_module_holding_torchs_function_by_name_is_sharded_under_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A module that bound torch's function to a name of its own before the threads started
    (``from torch.utils.data import get_worker_info``) sees each thread's info too: ferry
    rebinds the name when thread workers start, and outside them it answers as torch's."""
    module = types.ModuleType("holds_torch_function")
    module.get_worker_info = info_module._torch_original()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    stream = ByName(20, module)
    threads = ferry.DataLoader(stream, batch_size=3, num_workers=2, worker_type="thread")
    processes = ferry.DataLoader(stream, batch_size=3, num_workers=2)
    assert [b.tolist() for b in threads] == [b.tolist() for b in processes]
    assert module.get_worker_info is info_module.torch_get_worker_info  # type: ignore[attr-defined]
    assert module.get_worker_info() is None  # type: ignore[attr-defined]
    assert _items(ferry.DataLoader(stream, batch_size=3)) == list(range(20))
    assert _items(tud.DataLoader(stream, batch_size=3, num_workers=2)) == list(range(20))
