"""``timeout``: when no batch comes in time, a RuntimeError names the worker, its pid and what it
was fetching; the workers are stopped, even a frozen one."""

from __future__ import annotations

import os
import signal
import time

import pytest

import ferry
from _support import datasets as ds
from _support.processes import FAST, Kind, poll, reaped, worker_pids

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_timeout_expiry(kind: Kind) -> None:
    loader = ferry.DataLoader(
        ds.Blocking(6, block_from=1), num_workers=2, timeout=0.5, **kind.kwargs
    )
    iterator = iter(loader)
    assert next(iterator).tolist() == [0]
    pid = os.getpid() if kind.threads else worker_pids(iterator)[1]
    started = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        next(iterator)
    waited = time.monotonic() - started
    assert 0.5 <= waited < 2.0, waited
    message = str(caught.value)
    assert "timed out after 0.5" in message, message
    assert f"worker 1 (pid {pid})" in message, message
    assert "indices [1]" in message, message
    if not kind.threads:
        pids = worker_pids(iterator)
        assert poll(lambda: all(reaped(p) for p in pids), 2.0)


@pytest.mark.timeout(60)
def test_timeout_with_a_frozen_worker() -> None:
    """A stopped (SIGSTOP) worker cannot answer nor exit by itself: the timeout fires and the
    shutdown still removes it."""
    loader = ferry.DataLoader(
        ds.Indices(20), num_workers=2, timeout=0.5, multiprocessing_context="fork"
    )
    iterator = iter(loader)
    assert next(iterator).tolist() == [0]
    pids = worker_pids(iterator)
    # Let the batches already made arrive, then freeze worker 1 before it makes more.
    os.kill(pids[1], signal.SIGSTOP)
    try:
        with pytest.raises(RuntimeError, match=f"worker 1 \\(pid {pids[1]}\\)"):
            list(iterator)
        assert poll(lambda: all(reaped(p) for p in pids), 2.0)
    finally:
        if not reaped(pids[1]):
            os.kill(pids[1], signal.SIGCONT)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_timeout_applies_per_batch_not_per_epoch(kind: Kind) -> None:
    """Each batch takes 0.1 s and the timeout is 0.5 s: the epoch takes longer than the
    timeout in all, but no batch waits that long."""
    loader = ferry.DataLoader(ds.Slow(8, 0.1), num_workers=1, timeout=0.5, **kind.kwargs)
    assert [b.tolist() for b in loader] == [[i] for i in range(8)]
