"""Worker options: prefetch_factor, persistent_workers, timeout, in_order, multiprocessing_context,
worker_type."""

from __future__ import annotations

import multiprocessing
import warnings
from typing import Any

import pytest
import torch

try:
    import numpy as np
except ImportError:  # (the suite also runs without numpy)
    np = None  # type: ignore[assignment]
import torch.multiprocessing
import torch.utils.data as tud

import ferry
from _support import datasets as ds
from _support.compare import Raised, assert_same_outcome, outcome
from _support.processes import FAST, Kind, descendants, exited, poll, worker_pids

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def build_outcome(**kwargs: Any) -> list[Any]:
    """What building a loader with ``kwargs`` gives in torch and in ferry (no worker starts)."""
    results = []
    for module in (tud, ferry):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results.append(outcome(lambda m=module: m.DataLoader(range(10), **kwargs) and None))
    return results


# -- prefetch_factor ------------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_workers": 1, "prefetch_factor": -1},
        {"num_workers": 0, "prefetch_factor": 2},
        {"num_workers": 0, "prefetch_factor": 0},
        {"num_workers": 2, "prefetch_factor": "2"},
        {"num_workers": 2, "prefetch_factor": 3},
        {"num_workers": 2, "prefetch_factor": None},
    ],
    ids=str,
)
def test_prefetch_factor_validation_like_torch(kwargs: dict[str, Any]) -> None:
    expected, got = build_outcome(**kwargs)
    assert_same_outcome(expected, got)
    if isinstance(got, Raised):
        assert "prefetch_factor" in got.message or kwargs["prefetch_factor"] == "2"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_prefetch_factor_zero_with_workers_is_refused(kind: Kind) -> None:
    """torch refuses prefetch_factor=0 with workers (when the iterator is made: no batch could
    ever be fetched); ferry must not quietly use another value."""

    def epoch() -> list[Any]:
        return list(ferry.DataLoader(range(6), num_workers=1, prefetch_factor=0, **kind.kwargs))

    with pytest.raises((AssertionError, ValueError), match="prefetch_factor"):
        epoch()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
@pytest.mark.parametrize(("num_workers", "prefetch_factor"), [(1, 1), (2, 2), (3, 1), (2, 4)])
def test_in_flight_tasks_bounded(kind: Kind, num_workers: int, prefetch_factor: int) -> None:
    """After k batches are yielded, exactly the first k + prefetch_factor * num_workers batches
    have been asked for (as torch): prefetching reaches the bound and never passes it."""
    n = 30
    marks = torch.zeros(n, dtype=torch.uint8).share_memory_()
    loader = ferry.DataLoader(
        ds.Marks(marks),
        num_workers=num_workers,
        prefetch_factor=prefetch_factor,
        **kind.kwargs,
    )
    for yielded, batch in enumerate(loader, start=1):
        assert batch.tolist() == [yielded - 1]
        asked = min(n, yielded + prefetch_factor * num_workers)
        reached = poll(lambda asked=asked: int(marks.sum()) >= asked, 5)
        assert reached, f"after {yielded} batches only {int(marks.sum())} of {asked} fetched"
        assert marks[:asked].all()
        assert not marks[asked:].any(), f"after {yielded} batches: {marks.tolist()}"


# -- persistent_workers ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_workers_given_after_construction_load_the_default_two_ahead(kind: Kind) -> None:
    """A loader built without workers has ``prefetch_factor=None``; given workers later, it
    loads as if built with them (torch fails comparing None with 0 when iterated)."""
    loader = ferry.DataLoader(range(6), batch_size=2)
    loader.num_workers = 2
    for option, value in kind.kwargs.items():
        setattr(loader, option, value)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
    assert loader.prefetch_factor is None  # the option as the user left it


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fork"], indirect=True)
def test_persistent_workers_survive_epochs(kind: Kind) -> None:
    loader = ferry.DataLoader(
        ds.Indices(9), batch_size=2, num_workers=2, persistent_workers=True, **kind.kwargs
    )
    iterator = iter(loader)
    pids = worker_pids(iterator)
    assert [b.tolist() for b in iterator][-1] == [8]
    assert set(pids) <= descendants()
    assert not any(exited(pid) for pid in pids)
    for _ in range(2):
        again = iter(loader)
        assert again is iterator
        assert worker_pids(again) == pids
        assert [v for b in again for v in b.tolist()] == list(range(9))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_persistent_iterable_after_partial_epochs(kind: Kind) -> None:
    """Streams restart every epoch, however far the previous epoch went."""
    loader = ferry.DataLoader(
        ds.Sharded(11, ferry.get_worker_info),
        batch_size=2,
        num_workers=3,
        persistent_workers=True,
        **kind.kwargs,
    )
    full = [b["index"].tolist() for b in loader]
    for take in (0, 1, 4, len(full)):
        for position, _ in enumerate(loader):
            if position + 1 >= take:
                break
        assert [b["index"].tolist() for b in loader] == full


# -- timeout (expiry is tested in faults/) ---------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_timeout_not_hit_when_batches_come_in_time(kind: Kind) -> None:
    loader = ferry.DataLoader(
        ds.Slow(6, 0.02), batch_size=2, num_workers=2, timeout=5, **kind.kwargs
    )
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "timeout",
    [-1, -0.5, True, *([] if np is None else [np.int64(5), np.float32(1.5)])],
    ids=str,
)
def test_timeout_validation_like_torch(timeout: float) -> None:
    """Any real number that is not negative, as torch takes it: numpy's scalars and bools."""
    assert_same_outcome(*build_outcome(num_workers=1, timeout=timeout))


# -- in_order ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_out_of_order_yields_every_batch_once(kind: Kind, batch_size: int) -> None:
    """Batch 0 is held back in its worker until three other batches reached the training
    loop: with in_order=False they are not stuck behind it, and every batch comes exactly
    once."""
    flag = torch.zeros(1, dtype=torch.uint8).share_memory_()
    loader = ferry.DataLoader(
        ds.WaitForFlag(24, flag),
        batch_size=batch_size,
        num_workers=2,
        in_order=False,
        **kind.kwargs,
    )
    got = []
    for batch in loader:
        got.append(batch.tolist())
        if len(got) == 3:
            flag[0] = 1
    assert 0 not in [i for batch in got[:3] for i in batch]
    expected = [list(range(i, min(i + batch_size, 24))) for i in range(0, 24, batch_size)]
    assert sorted(got) == expected


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_out_of_order_iterable_uneven(kind: Kind) -> None:
    loader = ferry.DataLoader(
        ds.Uneven((7, 1, 3), ferry.get_worker_info),
        batch_size=2,
        num_workers=3,
        in_order=False,
        **kind.kwargs,
    )
    got = sorted(tuple(row) for batch in loader for row in batch.tolist())
    expected = sorted((1000 * w + k, k) for w, n in enumerate((7, 1, 3)) for k in range(n))
    assert got == expected


# -- multiprocessing_context and worker_type -----------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "context",
    [multiprocessing.get_context("fork"), torch.multiprocessing.get_context("fork")],
    ids=["multiprocessing", "torch.multiprocessing"],
)
def test_context_object(context: Any) -> None:
    loader = ferry.DataLoader(
        ds.Probe(4, ferry.get_worker_info),
        batch_size=None,
        num_workers=2,
        multiprocessing_context=context,
    )
    assert loader.multiprocessing_context is context
    got = list(loader)
    assert [s["index"] for s in got] == [0, 1, 2, 3]
    assert {s["process_type"] for s in got} == {"ForkProcess"}


@pytest.mark.timeout(30)
def test_context_name_becomes_context_object() -> None:
    loader = ferry.DataLoader(range(3), num_workers=1, multiprocessing_context="spawn")
    assert loader.multiprocessing_context is multiprocessing.get_context("spawn")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_workers": 1, "multiprocessing_context": "no-such-method"},
        {"num_workers": 1, "multiprocessing_context": 42},
        {"num_workers": 0, "multiprocessing_context": "fork"},
        {"num_workers": 1, "multiprocessing_context": None},
    ],
    ids=str,
)
def test_context_validation_like_torch(kwargs: dict[str, Any]) -> None:
    assert_same_outcome(*build_outcome(**kwargs))


@pytest.mark.timeout(30)
def test_worker_type_validation() -> None:
    with pytest.raises(ValueError, match="worker_type"):
        ferry.DataLoader(range(3), num_workers=1, worker_type="fiber")  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_default_start_method_is_the_platform_default() -> None:
    loader = ferry.DataLoader(ds.Probe(2, ferry.get_worker_info), batch_size=None, num_workers=1)
    assert loader.multiprocessing_context is None
    names = {"fork": "ForkProcess", "spawn": "SpawnProcess", "forkserver": "ForkServerProcess"}
    expected = names[multiprocessing.get_start_method()]
    assert {s["process_type"] for s in loader} == {expected}
