"""Exceptions raised by user code in a worker reach the training loop as the same exception type,
with notes naming the worker id, its pid, what it was fetching, and the worker's own traceback.
Objects that cannot be sent to spawn/forkserver workers are named, and no process is left."""

from __future__ import annotations

import gc
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch.utils.data as tud

import ferry
from _support import datasets as ds
from _support.compare import assert_same_outcome, outcome
from _support.processes import FAST, Kind, descendants, worker_pids
from _support.torch_versions import needs_torch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


def pid_of(kind: Kind, iterator: Any, worker_id: int) -> int:
    return os.getpid() if kind.threads else worker_pids(iterator)[worker_id]


def assert_explained(
    exc: BaseException, *, worker: int, pid: int, what: str, traceback: tuple[str, ...]
) -> None:
    text = notes(exc)
    assert f"worker process {worker} (pid {pid})" in text, text
    assert what in text, text
    assert "worker traceback:" in text, text
    for line in traceback:
        assert line in text, text


def steps(loader: Any, limit: int = 50) -> list[Any]:
    """Each ``next()`` of an epoch: the batch as a list, or the type of what it raised."""
    got: list[Any] = []
    iterator = iter(loader)
    while len(got) < limit:
        try:
            got.append(next(iterator).tolist())
        except StopIteration:
            break
        except Exception as exc:  # the point is to record it
            got.append(type(exc))
    return got


# -- map-style ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fork", "spawn", "thread"], indirect=True)
def test_getitem_error(kind: Kind) -> None:
    loader = ferry.DataLoader(ds.FailAt(8, bad=5), num_workers=2, **kind.kwargs)
    iterator = iter(loader)
    assert [next(iterator).tolist() for _ in range(5)] == [[0], [1], [2], [3], [4]]
    with pytest.raises(ds.Boom, match="boom at index 5") as caught:
        next(iterator)
    assert_explained(
        caught.value,
        worker=1,
        pid=pid_of(kind, iterator, 1),
        what="while fetching indices [5]",
        traceback=(
            "in __getitem__",
            "in explode_in_getitem",
            'raise Boom(f"boom at index {index}")',
            "_support.datasets.Boom: boom at index 5",
        ),
    )
    # As in torch, the epoch goes on after the failed batch.
    assert [b.tolist() for b in iterator] == [[6], [7]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
@pytest.mark.parametrize("bad", [0, 4, 9])
@pytest.mark.parametrize("num_workers", [1, 3])
def test_getitem_error_steps_like_torch(kind: Kind, bad: int, num_workers: int) -> None:
    """Every step of an epoch with a failing batch, against torch: the batches before and
    after it, and the exception type in its place."""
    results = []
    for module, how in ((tud, {"multiprocessing_context": "fork"}), (ferry, kind.kwargs)):
        loader = module.DataLoader(
            ds.FailAt(10, bad=bad), batch_size=3, num_workers=num_workers, **how
        )
        results.append(steps(loader))
    assert results[0] == results[1]
    assert ds.Boom in results[1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_error_names_every_index_of_the_batch(kind: Kind) -> None:
    loader = ferry.DataLoader(
        ds.FailAt(12, bad=7), batch_size=4, shuffle=False, num_workers=2, **kind.kwargs
    )
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(ds.Boom) as caught:
        next(iterator)
    assert_explained(
        caught.value,
        worker=1,
        pid=pid_of(kind, iterator, 1),
        what="indices [4, 5, 6, 7]",
        traceback=("in explode_in_getitem",),
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_key_error_stays_key_error(kind: Kind) -> None:
    loader = ferry.DataLoader(
        ds.FailAt(4, bad=0, kind="key"), batch_size=None, num_workers=1, **kind.kwargs
    )
    with pytest.raises(KeyError) as caught:
        next(iter(loader))
    assert caught.value.args == ("missing 0",)
    assert "index 0" in notes(caught.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_exception_that_cannot_be_rebuilt(kind: Kind) -> None:
    """An exception class whose instances cannot be rebuilt from their args becomes a
    RuntimeError naming it (torch does the same), still with the notes."""
    loader = ferry.DataLoader(ds.FailAt(4, bad=1, kind="two-args"), num_workers=1, **kind.kwargs)
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(RuntimeError, match="NeedsTwoArgs") as caught:
        next(iterator)
    assert "first and second" in str(caught.value)
    assert_explained(
        caught.value,
        worker=0,
        pid=pid_of(kind, iterator, 0),
        what="indices [1]",
        traceback=("NeedsTwoArgs",),
    )
    assert [b.tolist() for b in iterator] == [[2], [3]]
    torch_loader = tud.DataLoader(
        ds.FailAt(4, bad=1, kind="two-args"), num_workers=1, multiprocessing_context="fork"
    )
    assert steps(torch_loader) == [[0], RuntimeError, [2], [3]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fork", "spawn"], indirect=True)
def test_exception_that_cannot_be_pickled_keeps_its_class(kind: Kind) -> None:
    """Its class travels and is called with the message, as torch rebuilds it: ``except
    ValueError`` still catches it (it was a RuntimeError standing in)."""
    loader = ferry.DataLoader(ds.FailAt(4, bad=1, kind="locked"), num_workers=1, **kind.kwargs)
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(ds.HoldsALock, match="bad sample 1") as caught:
        next(iterator)
    assert "Caught HoldsALock in DataLoader worker process 0" in notes(caught.value)
    assert [b.tolist() for b in iterator] == [[2], [3]]


# -- iterable-style, collate_fn, worker_init_fn ---------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_iter_error(kind: Kind) -> None:
    loader = ferry.DataLoader(
        ds.FailingStream(after=None), batch_size=2, num_workers=2, **kind.kwargs
    )
    iterator = iter(loader)
    with pytest.raises(ds.Boom, match="boom in __iter__") as caught:
        next(iterator)
    # Both workers' streams fail as they open; as in torch, the error is raised at the first
    # batch of a failed worker: worker 0's.
    assert_explained(
        caught.value,
        worker=0,
        pid=pid_of(kind, iterator, 0),
        what="Caught Boom in DataLoader worker process",
        traceback=("in __iter__", 'raise Boom("boom in __iter__")'),
    )
    # There is no worker_init_fn: the error must not be put on it.
    assert "worker_init_fn" not in caught.value.__notes__[0], caught.value.__notes__[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_error_in_the_middle_of_a_stream(kind: Kind) -> None:
    loader = ferry.DataLoader(ds.FailingStream(after=3), batch_size=2, num_workers=1, **kind.kwargs)
    iterator = iter(loader)
    assert next(iterator).tolist() == [0, 1]
    with pytest.raises(ds.Boom, match="boom after 3 samples") as caught:
        next(iterator)
    assert_explained(
        caught.value,
        worker=0,
        pid=pid_of(kind, iterator, 0),
        what="the next batch of its dataset stream",
        traceback=("in _stream",),
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_collate_fn_error(kind: Kind) -> None:
    loader = ferry.DataLoader(
        ds.Indices(6), batch_size=3, num_workers=2, collate_fn=ds.failing_collate, **kind.kwargs
    )
    iterator = iter(loader)
    with pytest.raises(ds.Boom, match="boom in collate_fn for 3 samples") as caught:
        next(iterator)
    assert_explained(
        caught.value,
        worker=0,
        pid=pid_of(kind, iterator, 0),
        what="indices [0, 1, 2]",
        traceback=("in failing_collate",),
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_worker_init_fn_error(kind: Kind) -> None:
    loader = ferry.DataLoader(
        ds.Indices(6), num_workers=2, worker_init_fn=ds.failing_init, **kind.kwargs
    )
    iterator = iter(loader)
    pids = [os.getpid()] * 2 if kind.threads else worker_pids(iterator)
    with pytest.raises(ds.Boom, match="boom in worker_init_fn of worker") as caught:
        next(iterator)
    text = notes(caught.value)
    assert "worker_init_fn" in text
    assert any(f"worker process {w} (pid {pids[w]})" in text for w in (0, 1)), text
    assert "in failing_init" in text
    # The loader cannot go on without that worker: the iterator is over, not a hang.
    with pytest.raises(StopIteration):
        next(iterator)


class _WhoSeeds(tud.Dataset[Any]):
    """An index and the seed of the worker that read it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[int, int]:
        info = tud.get_worker_info()
        return index, -1 if info is None else info.seed


def _fail_in_worker_1(worker_id: int) -> None:
    if worker_id == 1:
        raise ValueError("boom in worker 1")


@needs_torch(
    "2.13", "persistent workers that stop when the loader drops them after a failed worker_init_fn"
)
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("samples", "on_error", "epochs"),
    [(8, "continue", 3), (12, "break", 2)],
    ids=["whole-epoch-dispatched", "loop-breaks"],
)
def test_persistent_workers_replaced_after_an_error_keep_torchs_seeds_and_order(
    samples: int, on_error: str, epochs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's persistent workers outlive a failed ``worker_init_fn`` (the failed one serves
    later epochs uninitialized); ferry's iterator is over after the error, and the next epoch
    starts new workers. They keep the old workers' base seed, as torch's keep theirs: no new
    draw from the loader's generator, so the next epoch shuffles and seeds as torch's.

    Where they part (measured side by side, not tested): torch's ``RandomSampler`` with a
    generator draws once more when it runs out, and a torch epoch that goes on after the error
    runs it out where ferry's, over after the error, does not; ferry's new workers run
    ``worker_init_fn`` again, so each later epoch ends at its error, torch's at its end.
    Hence three epochs only where the first epoch's keys were all handed to the workers before
    the error (8 samples), and two otherwise."""
    import torch

    def first_batch_of_each_epoch(lib: Any) -> list[Any]:
        loader = lib.DataLoader(
            _WhoSeeds(samples),
            batch_size=2,
            num_workers=2,
            persistent_workers=True,
            worker_init_fn=_fail_in_worker_1,
            shuffle=True,
            generator=torch.Generator().manual_seed(0),
        )
        firsts = []
        for _ in range(epochs):
            iterator, batches = iter(loader), []
            while True:
                try:
                    batches.append(next(iterator))
                except StopIteration:
                    break
                except Exception:  # (the failed worker's batches, in both)
                    if on_error == "break":
                        break
            firsts.append([t.tolist() for t in batches[0]])
        loader._iterator = None  # stops the persistent workers now, torch's as ferry's
        return firsts

    # torch's workers do not answer its shutdown here (their persistent iterator is collected
    # with the error's traceback), and it waits MP_STATUS_CHECK_INTERVAL for each before it
    # terminates them: 10 s of the suite's time for two workers, at the no_leftovers check.
    monkeypatch.setattr(tud._utils, "MP_STATUS_CHECK_INTERVAL", 0.2)
    assert first_batch_of_each_epoch(ferry) == first_batch_of_each_epoch(tud)
    gc.collect()  # (torch's iterator goes now, while its wait is short)


# -- what cannot be sent to a spawn/forkserver worker --------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize(
    ("option", "make"),
    [
        ("dataset", lambda: {"dataset": ds.HoldsLambda(4)}),
        ("collate_fn", lambda: {"dataset": ds.Indices(4), "collate_fn": lambda b: b}),
        ("worker_init_fn", lambda: {"dataset": ds.Indices(4), "worker_init_fn": lambda i: None}),
    ],
    ids=["dataset", "collate_fn", "worker_init_fn"],
)
def test_unpicklable_object_is_named(
    method: str, option: str, make: Callable[[], dict[str, Any]]
) -> None:
    before = descendants()
    results = []
    for module in (tud, ferry):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loader = module.DataLoader(num_workers=2, multiprocessing_context=method, **make())
            results.append(outcome(lambda loader=loader: list(loader)))
    assert_same_outcome(results[0], results[1])
    message = results[1].message
    assert option in message, message
    assert "<lambda>" in message, message
    assert method in message, message
    assert not descendants() - before


@pytest.mark.timeout(60)
def test_dataset_that_cannot_be_loaded_in_the_worker() -> None:
    """Pickling works but unpickling fails in the spawned worker: an error naming the worker
    comes within seconds; no hang."""
    loader = ferry.DataLoader(ds.Unloadable(4), num_workers=1, multiprocessing_context="spawn")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="worker 0") as caught:
        list(loader)
    assert time.monotonic() - started < 15
    assert "pid" in str(caught.value)


@pytest.mark.timeout(60)
def test_batch_that_cannot_be_sent_back() -> None:
    """A batch holding a lambda cannot travel from a worker process (torch hangs here: its
    queue drops what it cannot pickle): an error naming the worker, the indices, and that
    sending the batch failed (Python 3.13's pickle error, "Can't get local object", does
    not say so itself)."""
    loader = ferry.DataLoader(
        ds.SendsLambda(4),
        batch_size=2,
        num_workers=1,
        collate_fn=ds.identity,
        multiprocessing_context="fork",
    )
    iterator = iter(loader)
    with pytest.raises(Exception, match="lambda") as caught:
        next(iterator)
    assert_explained(
        caught.value,
        worker=0,
        pid=worker_pids(iterator)[0],
        what="while sending its batch of indices [0, 1] to the main process",
        traceback=("encode_batch", "local object"),
    )


def test_notes_are_printed_where_python_does_not_print_notes() -> None:
    """On Python 3.10 (no native notes) the worker's notes ride along as the printed cause."""
    import traceback

    from ferry.errors import WorkerTraceback, _add_note_by_hand

    exc = KeyError("no sample 13")
    _add_note_by_hand(
        exc, "Caught KeyError in DataLoader worker process 1 (pid 42) while fetching indices [13]"
    )
    _add_note_by_hand(exc, "worker traceback:\nTraceback ...\nKeyError: 'no sample 13'")
    assert exc.__notes__[0].startswith("Caught KeyError in DataLoader worker process 1")  # type: ignore[attr-defined]
    assert isinstance(exc.__cause__, WorkerTraceback)
    printed = "".join(traceback.format_exception(type(exc), exc, None))
    assert "worker process 1 (pid 42)" in printed
    assert "worker traceback:" in printed
