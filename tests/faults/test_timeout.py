"""``timeout``: when no batch comes in time, a RuntimeError names the worker, its pid and what it
was fetching. As in torch, the iterator goes on: the next ``next()`` waits for the same batch
again; the workers are stopped when the iterator goes, even a frozen one."""

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
    with pytest.raises(RuntimeError, match=r"timed out after 0\.5"):
        next(iterator)  # the same batch waited for again, as torch does
    if not kind.threads:
        pids = worker_pids(iterator)
        assert not any(reaped(p) for p in pids)  # they go on...
        del iterator, caught  # (its traceback holds the iterator's frames)
        assert poll(lambda: all(reaped(p) for p in pids), 2.0)  # ...until the iterator goes


class _LateOnce:
    """Sample 2 takes 1.6 s, the others none."""

    def __len__(self) -> int:
        return 5

    def __getitem__(self, index: int) -> int:
        if index == 2:
            time.sleep(1.6)
        return index


@pytest.mark.timeout(60)
def test_a_batch_late_past_the_timeout_comes_at_the_next_call_as_in_torch() -> None:
    """torch raises for the late batch, and hands it out at the next ``next()``."""
    import torch.utils.data as tud

    outcomes = []
    for module in (tud, ferry):
        loader = module.DataLoader(
            _LateOnce(), num_workers=1, timeout=1, multiprocessing_context="fork"
        )
        iterator, got = iter(loader), []
        while True:
            try:
                got.append(next(iterator).tolist())
            except StopIteration:
                break
            except RuntimeError as exc:
                got.append(str(exc)[:36])
        outcomes.append(got)
    late = "DataLoader timed out after 1 seconds"
    assert outcomes[1] == outcomes[0] == [[0], [1], late, [2], [3], [4]]


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
        del iterator
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
