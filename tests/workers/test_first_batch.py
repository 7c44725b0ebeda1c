"""What brings a loader's first batch sooner (issue 21, docs/design/io.md, "The first batch"):

* worker 0 is sent its first task before the other process workers are started, where drawing
  the first key leaves little memory in the main process (a worker forked after it would keep
  that memory alone);
* a worker process's read threads start without waiting for each to run (``detached``);
* a batch whose reads still run has its shared-memory slab made meanwhile (``expect``);
* ``num_workers="auto"`` judges a batch read at once by its reads' own times, not by the wall
  time of the batch, which is about one read's.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import ferry
from _support.datasets import Indices
from ferry._core.alloc import expect_batch, using_allocator
from ferry._engine import channels, group, kinds, shm
from ferry._engine.messages import Done, Timing
from ferry._engine.reads import SampleReads
from ferry._engine.switch import ThreadSwitch
from ferry._sampler_keys import first_draw_bytes
from ferry.samplers import BatchSampler, RandomSampler, SequentialSampler
from ferry.stats import StatsRecorder

MIB = 1 << 20


# -- what drawing the first key leaves ---------------------------------------------------------


def test_first_draw_bytes_bounds_what_a_sampler_holds_after_one_key() -> None:
    small, large = range(100), range(10_000_000)
    assert first_draw_bytes(SequentialSampler(small)) == 100 * 44
    # A sequence is drawn in chunks of 65,536 keys, whatever its length.
    assert first_draw_bytes(SequentialSampler(large)) == 65_536 * 44
    assert first_draw_bytes(RandomSampler(large, replacement=True)) == 32 * 44
    # Without replacement the whole order is drawn at once.
    assert first_draw_bytes(RandomSampler(large)) == 10_000_000 * 44
    assert first_draw_bytes(RandomSampler(small, num_samples=250)) == 250 * 44

    class Mine(ferry.Sampler[int]):
        def __iter__(self) -> Any:
            return iter(range(3))

    assert first_draw_bytes(Mine()) is None  # a user's sampler may hold anything
    assert first_draw_bytes(BatchSampler(SequentialSampler(small), 4, False)) is None


# -- worker 0's first task, before the others start ----------------------------------------------


def _record_order(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    events: list[tuple[str, int]] = []
    start = group._start_process

    def starting(config: Any, context: Any) -> Any:
        events.append(("start", config.worker_id))
        return start(config, context)

    send = channels.Channel.send_task

    def sending(self: Any, worker: Any, task: int, key: Any) -> None:
        events.append(("send", worker.worker_id))
        send(self, worker, task, key)

    monkeypatch.setattr(group, "_start_process", starting)
    monkeypatch.setattr(channels.Channel, "send_task", sending)
    return events


def _sent_before_all_started(events: list[tuple[str, int]]) -> int:
    """How many tasks were sent before the last worker started."""
    last = max(i for i, (what, _) in enumerate(events) if what == "start")
    return sum(1 for what, _ in events[:last] if what == "send")


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_worker_0_gets_its_first_task_before_the_others_start(
    monkeypatch: pytest.MonkeyPatch, context: str
) -> None:
    events = _record_order(monkeypatch)
    loader: ferry.DataLoader[Any] = ferry.DataLoader(
        Indices(40), batch_size=4, num_workers=3, multiprocessing_context=context
    )
    assert [x for b in loader for x in b.tolist()] == list(range(40))
    assert events[:3] == [("start", 0), ("send", 0), ("start", 1)]
    assert _sent_before_all_started(events) == 1
    assert [w for what, w in events if what == "send"][:6] == [0, 1, 2, 0, 1, 2]


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.timeout(60)
def test_a_large_first_draw_waits_for_every_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    # Shuffled: the whole order is drawn with the first key; forked after it, workers 1 and 2
    # would keep its pages once the main process let them go.
    monkeypatch.setattr(kinds, "EARLY_DRAW_LIMIT", 1000)
    events = _record_order(monkeypatch)
    loader: ferry.DataLoader[Any] = ferry.DataLoader(
        Indices(40),
        batch_size=4,
        num_workers=3,
        shuffle=True,
        generator=torch.Generator().manual_seed(3),
        multiprocessing_context="fork",
    )
    theirs = tud.DataLoader(
        Indices(40), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3)
    )
    expected = [x for b in theirs for x in b.tolist()]
    assert [x for b in loader for x in b.tolist()] == expected
    assert _sent_before_all_started(events) == 0


@pytest.mark.timeout(60)
def test_a_users_sampler_waits_for_every_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    class Backwards(ferry.Sampler[int]):
        def __iter__(self) -> Any:
            return iter(range(39, -1, -1))

        def __len__(self) -> int:
            return 40

    events = _record_order(monkeypatch)
    loader: ferry.DataLoader[Any] = ferry.DataLoader(
        Indices(40),
        batch_size=4,
        num_workers=2,
        sampler=Backwards(),
        multiprocessing_context="fork",
    )
    assert [x for b in loader for x in b.tolist()] == list(range(39, -1, -1))
    assert _sent_before_all_started(events) == 0


# -- a worker process's read threads -------------------------------------------------------------


@pytest.mark.timeout(30)
def test_detached_read_threads_read_at_once_and_stop() -> None:
    reads = SampleReads(limit=8, detached=True)
    together = threading.Barrier(8, timeout=10)  # passes only if all 8 reads run at once

    class AllAtOnce:
        def __getitem__(self, index: int) -> int:
            together.wait()
            return index

    reads._measured(0.01, 0.0001)  # (measured to wait: read at once)
    before = {t.name for t in threading.enumerate()}
    try:
        assert reads.read(AllAtOnce(), list(range(8))) == list(range(8))
        assert reads.last_parallel() is not None
        assert reads._pool is not None
        assert reads._pool.size == 8
        assert {t.name for t in threading.enumerate()} == before  # (not threading's)
        pool = reads._pool
    finally:
        reads.close()
    deadline = time.monotonic() + 5
    while pool._tasks.qsize() and time.monotonic() < deadline:  # each takes its stop
        time.sleep(0.01)
    assert pool._tasks.qsize() == 0


def test_last_parallel_says_what_reads_ran_elsewhere() -> None:
    reads = SampleReads(limit=4)
    try:
        reads._measured(0.001, 0.001)  # computes: one after another
        assert reads.read(Indices(8), list(range(8))) == list(range(8))
        assert reads.last_parallel() is None
        reads._measured(0.1, 0.0001)  # waits: at once
        assert reads.read(Indices(8), list(range(8))) == list(range(8))
        parallel = reads.last_parallel()
        assert parallel is not None
        assert parallel[2] == 8
        # Per thread: another thread's reads say nothing of this one's.
        seen: list[Any] = []
        other = threading.Thread(target=lambda: seen.append(reads.last_parallel()))
        other.start()
        other.join(5)
        assert seen == [None]
    finally:
        reads.close()


@pytest.mark.timeout(30)
def test_reads_closed_from_one_of_their_own_threads() -> None:
    """A finalizer may close the reads on one of the pool's threads: it must not join itself."""
    reads = SampleReads(limit=4)
    reads._measured(0.1, 0.0001)

    class Closing:
        def __getitem__(self, index: int) -> int:
            if index == 1:
                reads.close(timeout=1.0)
            return index

    assert reads.read(Closing(), [0, 1]) == [0, 1]


# -- the slab, made while the reads run ----------------------------------------------------------


def test_expect_batch_sums_the_tensors_collate_will_make() -> None:
    got: list[list[int]] = []

    class Recorder:
        min_bytes = 0

        def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype)

        def expect(self, leaves: list[int]) -> None:
            got.append(leaves)

    sample = {
        "image": torch.zeros(3, 8, 8),
        "label": 3,
        "extra": (np.zeros(10, dtype=np.float64), 0.5, "name"),
    }
    with using_allocator(Recorder()):
        expect_batch(sample, 4)
    assert got == [[4 * 3 * 64 * 4, 4 * 8, 4 * 80, 4 * 8]]
    expect_batch(sample, 4)  # no allocator here: nothing to prepare
    assert len(got) == 1


@pytest.mark.timeout(10)
def test_the_expected_slab_is_the_one_collate_fills() -> None:
    allocator = shm.SlabAllocator(os.getpid())
    try:
        allocator.begin(())
        allocator.expect([2 * MIB, 64])
        assert len(allocator.slabs) == 1
        (made,) = allocator.slabs.values()
        allocator.expect([2 * MIB])  # an idle slab fits: nothing new
        assert list(allocator.slabs.values()) == [made]
        allocator.empty((2 * MIB,), torch.uint8)
        allocator.empty((8,), torch.int64)
        assert allocator.finish() == [made]  # both tensors in it: no slab made by collate
        allocator.begin(())
        allocator.empty((16,), torch.uint8)
        allocator.expect([4 * MIB])  # collate has begun: too late to prepare
        allocator.finish()
        assert len(allocator.slabs) == 2
    finally:
        allocator.close()


@pytest.mark.timeout(60)
def test_slab_made_ahead_carries_the_same_batches() -> None:
    class Waiting(Indices):
        def __getitem__(self, index: int) -> Any:
            time.sleep(0.005)
            return {"x": torch.full((1000,), float(index)), "i": index}

    loader: ferry.DataLoader[Any] = ferry.DataLoader(Waiting(64), batch_size=8, num_workers="auto")
    batches = list(loader)
    assert torch.equal(torch.cat([b["i"] for b in batches]), torch.arange(64))
    assert all(torch.equal(b["x"][:, 0], b["i"].float()) for b in batches)


# -- what num_workers="auto" judges ---------------------------------------------------------------


def test_a_batch_read_at_once_is_judged_by_its_reads() -> None:
    plan = ferry.DataLoader(Indices(64), batch_size=8, num_workers="auto")._plan()
    switch = ThreadSwitch(plan, copies=True, replays=False)
    assert switch.active
    for _ in range(plan.num_workers):
        # The batch took 12 ms for 3 ms of its thread's CPU (4x: not enough alone), and its 8
        # reads waited 10 ms each for 0.05 ms of CPU.
        done = Done(0, None, timing=_timing(0.012), cpu=0.003, reads=(0.08, 0.0004, 8))
        switch.after(done, list(range(8)), plan_stats(), lambda: 8)
    assert "worker_type='thread'" in switch.why


def _timing(made_s: float) -> Timing:
    return Timing(made_s, 0.0, 0.0, 0)


def plan_stats() -> StatsRecorder:
    return StatsRecorder(2)
