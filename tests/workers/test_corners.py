"""Corners of the worker engine, with torch as the oracle where the behaviour is torch's.

* ``iter(loader)._workers``: handles with ``pid``, ``exitcode``, ``name``, ``is_alive()`` and
  ``join()``, answering as torch's process objects do, also after the epoch ended.
* A stopping group reads a worker's pipe as the channel does but maps no slab it announces.
* A map-style ``__getitem__`` raising StopIteration ends the epoch (the for-loop just stops)
  after the batches torch yields before it; the workers are stopped, not dead.
* A worker process that dies with several batches of its stream in flight is reported once,
  with the count.
* An exception in ``worker_init_fn`` (or in an IterableDataset's ``__iter__`` in a worker)
  reaches the user at the ``next()`` where torch raises it, as the same type; the iterator is
  then done.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch.utils.data as tud

import ferry
from _support import datasets as ds
from _support.processes import Kind, descendants, ferry_threads, open_fds, reaped
from _support.torch_versions import needs_torch
from ferry._engine.crew.group import WorkerHandle
from ferry.errors import WorkerDied
from workers import corner_datasets as cd

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TORCH_FORK = {"multiprocessing_context": "fork"}


def notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


def names_worker(exc: BaseException, worker_id: int, pid: int) -> bool:
    """The exception's notes name worker ``worker_id`` and its pid."""
    return re.search(rf"worker (process )?{worker_id} \(pid {pid}\)", notes(exc)) is not None


def until_error(iterator: Any, limit: int = 20) -> tuple[list[Any], BaseException | None]:
    """``next()`` until the first exception (or the end): the batches as lists, then the type
    of what ended it (StopIteration for the end); and the exception itself."""
    got: list[Any] = []
    for _ in range(limit):
        try:
            got.append(next(iterator).tolist())
        except StopIteration:
            got.append(StopIteration)
            return got, None
        except Exception as exc:  # the point is to record it
            got.append(type(exc))
            return got, exc
    return got, None


def close_torch(iterator: Any) -> None:
    """Stop a torch iterator's workers now. One left to the garbage collector (an exception's
    traceback keeps it in a cycle) is inherited by the fork workers started next, and its
    ``__del__`` run there stalls them for seconds; once stopped, its ``__del__`` has nothing
    left to do. (A collection here freed nothing: the callers still hold the iterator.)"""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


# -- iter(loader)._workers ---------------------------------------------------------------------


def handle_states(workers: list[Any]) -> list[tuple[bool, int | None]]:
    return [(w.is_alive(), w.exitcode) for w in workers]


def observe_handles(iterator: Any) -> dict[str, Any]:
    """Run the epoch of ``iterator``, asking its ``_workers`` before, after and after joining."""
    workers = list(iterator._workers)
    during = handle_states(workers)
    pids = [w.pid for w in workers]
    batches = [b.tolist() for b in iterator]
    after = handle_states(iterator._workers)
    for worker in iterator._workers:
        worker.join()  # returns: the worker was stopped with the epoch
        worker.join(0.5)
    return {
        "batches": batches,
        "during": during,
        "after": after,
        "joined": handle_states(iterator._workers),
        "pids": pids,
        "same_pids": [w.pid for w in iterator._workers] == pids,
    }


def check_process_handles(iterator: Any) -> None:
    """What ferry's handles are while the epoch runs: distinct live child processes."""
    workers = iterator._workers
    assert all(isinstance(w, WorkerHandle) for w in workers)
    pids = [w.pid for w in workers]
    assert len(set(pids)) == len(pids)
    assert os.getpid() not in pids
    assert set(pids) <= descendants()
    names = [w.name for w in workers]
    assert all(isinstance(name, str) and name for name in names)
    assert len(set(names)) == len(names), names


@pytest.mark.timeout(60)
def test_process_worker_handles_answer_like_torch() -> None:
    """During the epoch: live child processes, no exit code; after it: not alive, exit code 0,
    ``join`` returns at once; the same answers as torch's ``_workers`` (process objects)."""
    torch_iterator = iter(tud.DataLoader(ds.Indices(8), num_workers=2, **TORCH_FORK))
    expected = observe_handles(torch_iterator)
    close_torch(torch_iterator)
    iterator = iter(ferry.DataLoader(ds.Indices(8), num_workers=2, multiprocessing_context="fork"))
    check_process_handles(iterator)
    got = observe_handles(iterator)
    assert all(reaped(pid) for pid in got["pids"])
    for key in ("batches", "during", "after", "joined", "same_pids"):
        assert got[key] == expected[key], key
    assert got["during"] == [(True, None)] * 2
    assert got["after"] == got["joined"] == [(False, 0)] * 2


@pytest.mark.timeout(30)
def test_thread_worker_handles() -> None:
    """Thread workers: the main process's pid; ``is_alive()`` follows the thread."""
    iterator = iter(ferry.DataLoader(ds.Indices(6), num_workers=2, worker_type="thread"))
    workers = list(iterator._workers)
    assert all(isinstance(w, WorkerHandle) for w in workers)
    assert [w.pid for w in workers] == [os.getpid()] * 2
    assert [w.is_alive() for w in workers] == [True, True]
    live = {t.name for t in ferry_threads() if t.is_alive()}
    assert {w.name for w in workers} <= live, (live, [w.name for w in workers])
    assert [b.tolist() for b in iterator] == [[i] for i in range(6)]
    for worker in workers:
        worker.join(5)
    assert [w.is_alive() for w in workers] == [False, False]
    assert not {t.name for t in ferry_threads() if t.is_alive()} & {w.name for w in workers}
    assert [w.pid for w in workers] == [os.getpid()] * 2


@pytest.mark.timeout(10)
@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="no memfd_create on this platform")
def test_a_stopping_group_reads_a_pipe_without_mapping_its_slabs() -> None:
    """The shutdown reads a worker's pipe one step at a time, as the channel does, but keeps no
    slab: a slab's descriptor is closed as it comes, nothing is mapped."""
    import multiprocessing
    import pickle

    from ferry._engine.crew.group import ProcessHandle
    from ferry._engine.transport.messages import NewSlab, Stop
    from ferry._engine.transport.slabfile import send_fd

    ours, theirs = multiprocessing.Pipe(duplex=True)
    worker = ProcessHandle(0, multiprocessing.Process(), ours)  # (not started: its pipe is read)
    fd = os.memfd_create("ferry-test")
    try:
        os.ftruncate(fd, 4096)
        theirs.send_bytes(pickle.dumps(NewSlab(7, 4096)))
        send_fd(theirs, fd)
        theirs.send_bytes(pickle.dumps(Stop()))
        before = open_fds()
        assert worker.receive(keep_slabs=False) == NewSlab(7, 4096)
        assert worker.slabs.awaiting == NewSlab(7, 4096)
        assert worker.receive(keep_slabs=False) is None  # the descriptor: received, closed
        assert (worker.slabs.awaiting, open_fds()) == (None, before)
        assert isinstance(worker.receive(keep_slabs=False), Stop)
        assert worker.slabs.held_bytes() == 0
    finally:
        os.close(fd)
        ours.close()
        theirs.close()
        worker.slabs.close()


# -- StopIteration from a map-style __getitem__ ---------------------------------------------------


@functools.cache
def torch_stop_epoch(n: int, at: int, batch_size: int, num_workers: int) -> list[Any]:
    """What torch yields for :class:`StopAt` (computed once per setup)."""
    how = TORCH_FORK if num_workers else {}
    iterator = iter(
        tud.DataLoader(cd.StopAt(n, at), batch_size=batch_size, num_workers=num_workers, **how)
    )
    got = [b.tolist() for b in iterator]
    close_torch(iterator)
    return got


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fork", "thread"], indirect=True)
@pytest.mark.parametrize(
    ("at", "batch_size", "num_workers"),
    [(3, 1, 1), (3, 2, 1), (0, 3, 1), (7, 2, 2), (9, 4, 2)],
)
@pytest.mark.slow
def test_stop_iteration_in_getitem_ends_the_epoch(
    kind: Kind, at: int, batch_size: int, num_workers: int
) -> None:
    expected = torch_stop_epoch(10, at, batch_size, 0)
    # torch ends the epoch there with and without workers.
    assert torch_stop_epoch(10, at, batch_size, num_workers) == expected
    assert len(expected) == at // batch_size
    loader = ferry.DataLoader(
        cd.StopAt(10, at), batch_size=batch_size, num_workers=num_workers, **kind.kwargs
    )
    iterator = iter(loader)
    got = [b.tolist() for b in iterator]  # a for-loop: it just stops
    assert got == expected
    if not kind.threads:
        # The workers were stopped with the epoch: none died of the StopIteration.
        for worker in iterator._workers:
            worker.join(5)
        assert [w.exitcode for w in iterator._workers] == [0] * num_workers
    # The loader is not broken: the next epoch stops at the same place.
    assert [b.tolist() for b in loader] == expected


@pytest.mark.timeout(60)
def test_spawn_workers_handles_and_stop_iteration() -> None:
    """Spawn workers (one start-up for several checks, it takes seconds): the handles while the
    epoch runs and after it, and a StopIteration from ``__getitem__`` ending the epoch where
    torch ends it, the workers stopped rather than dead."""
    expected = torch_stop_epoch(10, 5, 2, 0)
    assert expected == [[0, 1], [2, 3]]
    iterator = iter(
        ferry.DataLoader(
            cd.StopAt(10, 5), batch_size=2, num_workers=2, multiprocessing_context="spawn"
        )
    )
    check_process_handles(iterator)
    got = observe_handles(iterator)
    assert got["batches"] == expected
    assert got["during"] == [(True, None)] * 2
    assert [alive for alive, _ in got["after"]] == [False, False]
    assert got["joined"] == got["after"]
    assert got["same_pids"]
    assert all(reaped(pid) for pid in got["pids"])
    # A spawned worker finalizes its interpreter (about 0.5 s with torch loaded) after it says
    # it is leaving; the loader waits for that instead of sending SIGTERM.
    assert [code for _, code in got["after"]] == [0, 0]


# -- the loader's options, mirrored on its iterator -----------------------------------------------

MIRRORED = (
    "_dataset",
    "_auto_collation",
    "_drop_last",
    "_pin_memory",
    "_pin_memory_device",
    "_persistent_workers",
    "_dataset_kind",
    "_num_workers",
    "_timeout",
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "options",
    [{}, {"batch_size": None}, {"num_workers": 1, "timeout": 5, "persistent_workers": True}],
    ids=["inline", "unbatched", "workers"],
)
@pytest.mark.parametrize(
    "dataset", [list(range(4)), ds.Sharded(8, ds.any_worker_info)], ids=["map", "stream"]
)
@pytest.mark.slow
def test_iterator_mirrors_the_loader_options_as_torch_does(
    options: dict[str, Any], dataset: Any
) -> None:
    """torch's iterators hold their loader's options under these names, which code reads."""
    torch_options = {**options, **(TORCH_FORK if options.get("num_workers") else {})}
    expected = iter(tud.DataLoader(dataset, **torch_options))
    got = iter(ferry.DataLoader(dataset, **options))
    try:
        for name in MIRRORED:
            assert getattr(got, name) == getattr(expected, name), name
            assert type(getattr(got, name)) is type(getattr(expected, name)), name
        assert got._dataset is dataset
        assert (got._index_sampler is None) == (expected._index_sampler is None)
        if options.get("num_workers"):
            assert got._prefetch_factor == expected._prefetch_factor
            assert got._worker_init_fn is expected._worker_init_fn
    finally:
        close_torch(expected)
        got._shutdown_workers()


# -- iter(loader)._num_yielded ---------------------------------------------------------------------


def yielded_counts(module: Any, **options: Any) -> list[int]:
    """``_num_yielded`` at each step of two epochs of a 10-sample loader, batches of 3."""
    loader = module.DataLoader(list(range(10)), batch_size=3, **options)
    counts = []
    for _ in range(2):
        iterator = iter(loader)
        counts.append(iterator._num_yielded)
        for _ in iterator:
            counts.append(iterator._num_yielded)
    return counts


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="inline"),
        pytest.param({"num_workers": 2, "persistent_workers": True}, id="persistent"),
        pytest.param(
            {"num_workers": 2, "in_order": False},
            id="out-of-order",
            marks=[needs_torch("2.6", "DataLoader(in_order=)")],
        ),
    ],
)
def test_num_yielded_counts_like_torch(options: dict[str, Any]) -> None:
    expected = yielded_counts(tud, **options, **(TORCH_FORK if options else {}))
    assert expected == [0, 1, 2, 3, 4] * 2
    assert yielded_counts(ferry, **options) == expected


@pytest.mark.timeout(60)
def test_num_yielded_of_a_resumed_epoch_counts_the_batches_before() -> None:
    loader = ferry.DataLoader(list(range(10)), batch_size=3, num_workers=2)
    iterator = iter(loader)
    next(iterator), next(iterator)
    state = loader.state_dict()
    resumed = ferry.DataLoader(list(range(10)), batch_size=3, num_workers=2)
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    assert iterator._num_yielded == 2
    assert [(batch.tolist(), iterator._num_yielded) for batch in iterator] == [
        ([6, 7, 8], 3),
        ([9], 4),
    ]


# -- WorkerDied with several batches of a stream in flight ---------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("after", "prefetch"), [(0, 1), (0, 3), (4, 2)])
def test_dead_stream_worker_names_its_batches_once(after: int, prefetch: int) -> None:
    loader = ferry.DataLoader(
        cd.ExitingStream(after),
        batch_size=2,
        num_workers=1,
        prefetch_factor=prefetch,
        multiprocessing_context="fork",
    )
    iterator = iter(loader)
    pid = iterator._workers[0].pid
    assert [next(iterator).tolist() for _ in range(after // 2)] == [
        [k, k + 1] for k in range(0, after, 2)
    ]
    with pytest.raises(WorkerDied) as caught:
        next(iterator)
    message = str(caught.value)
    phrase = "the next batch of its dataset stream"
    assert message.count(phrase) == 1, message
    assert f"worker 0 (pid {pid})" in message, message
    assert "exited with code 3" in message, message
    if prefetch == 1:
        assert "in flight" not in message, message
        assert message.endswith(phrase), message
    else:
        assert f"{phrase} ({prefetch} batches in flight)" in message, message


@pytest.mark.timeout(30)
def test_dead_worker_with_several_map_batches_counts_them() -> None:
    loader = ferry.DataLoader(
        cd.ExitingAt(12, 0),
        batch_size=2,
        num_workers=1,
        prefetch_factor=3,
        multiprocessing_context="fork",
    )
    with pytest.raises(WorkerDied) as caught:
        next(iter(loader))
    message = str(caught.value)
    assert message.endswith(
        "exited with code 3 while fetching 3 batches: indices [0, 1]; indices [2, 3]; "
        "indices [4, 5]"
    ), message


# -- exceptions while a worker starts --------------------------------------------------------------


def map_with_failing_init(bad: int, how: dict[str, Any]) -> Callable[[Any], Any]:
    def make(module: Any) -> Any:
        return module.DataLoader(
            ds.Indices(12), batch_size=2, num_workers=2, worker_init_fn=cd.FailingInit(bad), **how
        )

    return make


def stream_failing_to_open(bad: int, how: dict[str, Any]) -> Callable[[Any], Any]:
    def make(module: Any) -> Any:
        return module.DataLoader(cd.OneStreamFails(12, bad), batch_size=2, num_workers=2, **how)

    return make


SETUPS = {
    "worker_init_fn": (map_with_failing_init, cd.InitFailed, "while starting (in worker_init_fn)"),
    "__iter__": (stream_failing_to_open, cd.OpenFailed, "while starting (opening its dataset"),
}


@functools.cache
def torch_until_error(setup: str, bad: int) -> tuple[Any, ...]:
    make = SETUPS[setup][0](bad, TORCH_FORK)
    iterator = iter(make(tud))
    got, _ = until_error(iterator)
    close_torch(iterator)
    return tuple(got)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fork", "thread"], indirect=True)
@pytest.mark.parametrize("bad", [0, 1])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_start_failure_surfaces_where_torch_raises(kind: Kind, bad: int, setup: str) -> None:
    """With two workers and worker ``bad`` failing as it starts: the batches before the error
    and the error's type are torch's (worker 1 failing: batch 0 first, then the error at the
    second ``next()``); afterwards the iterator is over (StopIteration, not a hang)."""
    make, error_type, stage = SETUPS[setup]
    expected = torch_until_error(setup, bad)
    assert expected[-1] is error_type  # the oracle raises it
    assert len(expected) == bad + 1
    iterator = iter(make(bad, kind.kwargs)(ferry))
    pid = os.getpid() if kind.threads else iterator._workers[bad].pid
    got, exc = until_error(iterator)
    assert tuple(got) == expected
    assert exc is not None
    assert stage in notes(exc), notes(exc)
    assert names_worker(exc, bad, pid), notes(exc)
    if setup == "__iter__":
        assert "worker_init_fn" not in notes(exc).split("worker traceback:")[0], notes(exc)
    # torch differs from here on (its worker goes on without its set-up): ferry stops.
    with pytest.raises(StopIteration):
        next(iterator)
    with pytest.raises(StopIteration):
        next(iterator)
    if not kind.threads:
        for worker in iterator._workers:
            worker.join(5)
        assert [w.exitcode for w in iterator._workers] == [0, 0]


@pytest.mark.timeout(60)
def test_init_failure_of_second_worker_with_spawn() -> None:
    make, error_type, stage = SETUPS["worker_init_fn"]
    expected = torch_until_error("worker_init_fn", 1)
    iterator = iter(make(1, {"multiprocessing_context": "spawn"})(ferry))
    pid = iterator._workers[1].pid
    got, exc = until_error(iterator)
    assert tuple(got) == expected == ([0, 1], error_type)
    assert exc is not None
    assert stage in notes(exc), notes(exc)
    assert names_worker(exc, 1, pid), notes(exc)
    assert "refused worker 1" in str(exc)
    with pytest.raises(StopIteration):
        next(iterator)
