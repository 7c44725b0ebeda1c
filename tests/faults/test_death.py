"""A worker process that dies (killed from outside, a segfault, ``os._exit``) gives an error
naming the worker and the signal or exit code within two seconds; never a hang."""

from __future__ import annotations

import os
import pickle
import signal
import time

import pytest

import ferry
from _support import datasets as ds
from _support.processes import Kind, descendants, poll, reaped, worker_pids

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

NOTICE = 2.0
"""Seconds within which a dead worker must be reported."""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fork", "spawn"], indirect=True)
def test_worker_killed_from_outside(kind: Kind) -> None:
    loader = ferry.DataLoader(ds.Blocking(8, block_from=1), num_workers=2, **kind.kwargs)
    iterator = iter(loader)
    assert next(iterator).tolist() == [0]
    pids = worker_pids(iterator)
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        next(iterator)
    assert time.monotonic() - killed < NOTICE
    message = str(caught.value)
    assert f"worker 1 (pid {pids[1]})" in message, message
    assert "SIGKILL" in message, message
    assert "indices [1]" in message, message
    # It can travel (e.g. from a helper process to a launcher) as itself.
    copy = pickle.loads(pickle.dumps(caught.value))
    assert type(copy) is type(caught.value)
    assert str(copy) == message
    assert (copy.worker_id, copy.pid, copy.exitcode) == (1, pids[1], -signal.SIGKILL)
    # The iterator is over: at once, StopIteration (a loop that retries on errors ends, as
    # over torch's iterator when its worker died), and the other worker is stopped.
    with pytest.raises(StopIteration):
        next(iterator)
    assert poll(lambda: reaped(pids[0]), NOTICE)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("how", "method", "expected"),
    [
        ("exit", "fork", "exited with code 3"),
        ("exit", "spawn", "exited with code 3"),
        ("segv", "fork", "SIGSEGV"),
        ("kill", "fork", "SIGKILL"),
    ],
)
def test_worker_dies_while_fetching(how: str, method: str, expected: str) -> None:
    # prefetch_factor=1: index 3 goes to worker 1 only once batch 1 has been yielded.
    loader = ferry.DataLoader(
        ds.DieAt(10, at=3, how=how),
        num_workers=2,
        prefetch_factor=1,
        multiprocessing_context=method,
    )
    iterator = iter(loader)
    pids = worker_pids(iterator)
    got = [next(iterator).tolist(), next(iterator).tolist()]
    started = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        got.extend(b.tolist() for b in iterator)
    assert time.monotonic() - started < NOTICE
    assert got == [[0], [1], [2]][: len(got)]
    message = str(caught.value)
    assert f"worker 1 (pid {pids[1]})" in message, message
    assert expected in message, message
    assert "indices [3]" in message, message
    assert poll(lambda: reaped(pids[0]) and reaped(pids[1]), NOTICE)


@pytest.mark.timeout(60)
def test_persistent_workers_stopped_by_a_death_are_started_anew_next_epoch() -> None:
    """The error stops the kept workers; the next epoch starts new ones (it failed at once,
    for every later epoch, with "persistent workers were shut down")."""
    dataset = ds.DieAt(6, at=3, how="exit")
    loader = ferry.DataLoader(
        dataset, num_workers=2, persistent_workers=True, multiprocessing_context="fork"
    )
    with pytest.raises(ferry.errors.WorkerDied):
        list(loader)
    dataset.at = -1  # (the new workers are forked from the dataset as it is now)
    assert [b.tolist() for b in loader] == [[i] for i in range(6)]
    assert [b.tolist() for b in loader] == [[i] for i in range(6)]


@pytest.mark.timeout(60)
def test_worker_dies_while_idle() -> None:
    """A worker with nothing left to fetch that dies is reported (as torch does), while the
    loop waits on another worker: an error, not a wait forever."""
    loader = ferry.DataLoader(
        ds.Blocking(4, block_from=3),
        num_workers=2,
        prefetch_factor=1,
        multiprocessing_context="fork",
    )
    iterator = iter(loader)
    assert [next(iterator).tolist() for _ in range(3)] == [[0], [1], [2]]
    pids = worker_pids(iterator)
    # Worker 1 is blocked on index 3; worker 0 has nothing left to do.
    os.kill(pids[0], signal.SIGTERM)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        next(iterator)
    assert time.monotonic() - started < NOTICE
    message = str(caught.value)
    assert f"worker 0 (pid {pids[0]})" in message, message
    assert "SIGTERM" in message, message


@pytest.mark.timeout(60)
def test_killed_worker_of_one_loader_does_not_affect_another() -> None:
    first = ferry.DataLoader(
        ds.Blocking(6, block_from=1), num_workers=1, multiprocessing_context="fork"
    )
    second = ferry.DataLoader(
        ds.Indices(6), batch_size=2, num_workers=2, multiprocessing_context="fork"
    )
    doomed = iter(first)
    assert next(doomed).tolist() == [0]
    healthy = iter(second)
    assert next(healthy).tolist() == [0, 1]
    before = descendants()
    os.kill(worker_pids(doomed)[0], signal.SIGKILL)
    with pytest.raises(RuntimeError, match="SIGKILL"):
        next(doomed)
    assert [b.tolist() for b in healthy] == [[2, 3], [4, 5]]
    assert set(worker_pids(healthy)) <= before
    del doomed, healthy
