"""Datasets whose ``state_dict`` is not torchdata's (``_engine/position/counted.py``).

A ``state_dict`` that needs arguments is never called with none: the loader iterates the
dataset as torch's does, warns once, and resumes it as a dataset without state (map-style: the
keys go on; iterable-style: each worker's stream skips what it had handed out). The two
libraries whose protocol ferry follows (MosaicML Streaming, litdata) are recognized by the
names of the method's parameters; tests/ecosystem/test_streaming.py runs the real ones.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch.utils.data as tud

import ferry
from ferry._engine.position import keeper
from ferry._engine.position.counted import judge_dataset, snapshots_itself

pytestmark = [pytest.mark.usefixtures("guard_global_state"), pytest.mark.timeout(60)]

ROWS = 40


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a new process: no class's raising state_dict seen yet (it is said once each)."""
    monkeypatch.setattr(keeper, "_RAISED", set())


class Squares(ferry.Dataset[int]):
    """Map-style, with a state_dict that takes a step (a training framework's, say)."""

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int) -> int:
        return index * index

    def state_dict(self, step: int) -> dict[str, int]:
        return {"step": step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        raise AssertionError("ferry has no state of this dataset to give it")


class Counting(ferry.IterableDataset[int]):
    """Iterable-style, sharded over workers, with a state_dict that takes two arguments."""

    def __iter__(self) -> Iterator[int]:
        info = tud.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, ROWS, step))

    def state_dict(self, position: int, flush: bool) -> dict[str, int]:
        return {"position": position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        raise AssertionError("ferry has no state of this dataset to give it")


class Unfinished(ferry.Dataset[int]):
    """Map-style, whose state_dict raises (a base class's stub, say)."""

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int) -> int:
        return index + 1

    def state_dict(self) -> dict[str, int]:
        raise NotImplementedError("no state yet")

    def load_state_dict(self, state: dict[str, int]) -> None:
        raise AssertionError("ferry has no state of this dataset to give it")


class UnfinishedStream(Counting):
    """Iterable-style, whose state_dict raises."""

    def state_dict(self) -> dict[str, int]:  # type: ignore[override]
        raise NotImplementedError("no state yet")


WORKERS = [
    pytest.param({}, id="0"),
    pytest.param({"num_workers": 2}, id="2-process"),
    pytest.param({"num_workers": 2, "worker_type": "thread"}, id="2-thread"),
]


def _batches(loader: Any) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def _ours(warned: list[warnings.WarningMessage], name: str) -> list[str]:
    said = ("cannot be called", "raised NotImplementedError")
    return [
        str(w.message)
        for w in warned
        if str(w.message).startswith(f"{name}.state_dict()")
        and any(s in str(w.message) for s in said)
    ]


@pytest.mark.parametrize("options", WORKERS)
@pytest.mark.parametrize("dataset_type", [Squares, Counting, Unfinished, UnfinishedStream])
def test_iterates_as_torch_with_one_warning(dataset_type: type, options: dict[str, Any]) -> None:
    dataset = dataset_type()
    expected = [
        _batches(
            tud.DataLoader(
                dataset_type(),
                batch_size=4,
                **{k: v for k, v in options.items() if k != "worker_type"},
            )
        )
        for _ in range(2)
    ]
    loader = ferry.DataLoader(dataset, batch_size=4, **options)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        assert [_batches(loader), _batches(loader)] == expected
        it = iter(loader)
        next(it)
        state = loader.state_dict()  # mid-epoch: works, and holds no state of the dataset
        del it
    said = _ours(warned, dataset_type.__name__)
    if dataset_type in (Unfinished, UnfinishedStream) and options.get("num_workers"):
        # said where it is asked: each worker (a process's warning goes to its stderr)
        assert len(said) == (1 if options.get("worker_type") == "thread" else 0), said
        return
    assert len(said) == 1, said  # once for the loader, not per epoch or batch
    assert "load_state_dict" in said[0]
    assert "dataset_position" not in json.loads(json.dumps(state))


@pytest.mark.parametrize("options", WORKERS[:2])
@pytest.mark.parametrize("dataset_type", [Squares, Counting, Unfinished, UnfinishedStream])
def test_resumes_as_a_dataset_without_state(dataset_type: type, options: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = _batches(ferry.DataLoader(dataset_type(), batch_size=4, **options))
        loader = ferry.DataLoader(dataset_type(), batch_size=4, **options)
        it = iter(loader)
        seen = [next(it).tolist() for _ in range(3)]
        state = json.loads(json.dumps(loader.state_dict()))
        del it
        resumed = ferry.DataLoader(dataset_type(), batch_size=4, **options)
        resumed.load_state_dict(state)
        assert seen + _batches(resumed) == reference


class LooksLikeMosaic:
    def state_dict(self, num_samples: int, from_beginning: bool) -> dict[str, Any]:
        return {}

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        pass


class LooksLikeLitdata:
    def state_dict(self, num_samples_yielded: int, num_workers: int, batch_size: int) -> Any:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class OptionalArguments:
    def state_dict(self, destination: Any = None, *, prefix: str = "") -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_recognized_by_the_names_of_its_parameters() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither library's dataset is warned about
        mosaic = judge_dataset(LooksLikeMosaic()).counted
        litdata = judge_dataset(LooksLikeLitdata()).counted
    assert mosaic is not None
    assert mosaic.library == "MosaicML Streaming"
    assert litdata is not None
    assert litdata.library == "litdata"
    # arguments that all have defaults: torchdata's protocol, as before
    assert snapshots_itself(OptionalArguments())
    assert judge_dataset(OptionalArguments()).counted is None
    assert not snapshots_itself(LooksLikeMosaic())


def test_map_style_resumes_with_another_worker_count() -> None:
    """No state of the dataset is kept, so none ties the state to the number of workers."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = _batches(ferry.DataLoader(Squares(), batch_size=4))
        loader = ferry.DataLoader(Squares(), batch_size=4, num_workers=2)
        it = iter(loader)
        seen = [next(it).tolist() for _ in range(3)]
        state = loader.state_dict()
        del it
        resumed = ferry.DataLoader(Squares(), batch_size=4)
        resumed.load_state_dict(state)
        assert seen + _batches(resumed) == reference


class StreamsItself(ferry.IterableDataset[int]):
    """litdata's shape: ``__iter__`` returns the dataset, whose position is kept on itself;
    the state is built from a count of samples."""

    def __init__(self) -> None:
        self.next_row = 0
        self.step = 1

    def __iter__(self) -> StreamsItself:
        info = tud.get_worker_info()
        self.next_row, self.step = (0, 1) if info is None else (info.id, info.num_workers)
        return self

    def __next__(self) -> int:
        if self.next_row >= ROWS:
            raise StopIteration
        row, self.next_row = self.next_row, self.next_row + self.step
        return row

    def state_dict(self, num_samples_yielded: int, num_workers: int, batch_size: int) -> Any:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def test_thread_workers_each_iterate_a_copy_of_a_counted_dataset() -> None:
    """A counted dataset keeps its iteration on itself: each thread gets a copy of its own
    (shared, two threads would move one position), and the original is left as it was."""
    dataset = StreamsItself()
    processes = _batches(ferry.DataLoader(dataset, batch_size=4, num_workers=2))
    loader = ferry.DataLoader(dataset, batch_size=4, num_workers=2, worker_type="thread")
    for _ in range(2):
        assert _batches(loader) == processes
    assert sorted(x for batch in processes for x in batch) == list(range(ROWS))
    assert (dataset.next_row, dataset.step) == (0, 1)
