"""What brings a loader's first batch sooner (docs/design/io.md, "The first batch"):

* worker 0 is sent its first task before the other process workers are started, where drawing
  the first key leaves little memory in the main process (a worker forked after it would keep
  that memory alone);
* a worker process's read threads start without waiting for each to run (``detached``);
* a batch whose reads still run has its shared-memory slab made meanwhile (``expect``);
* ``num_workers="auto"`` judges a batch read at once by its reads' own times, not by the wall
  time of the batch, which is about one read's; such a batch is enough to decide;
* ``num_workers="auto"`` holds the other process workers back while worker 0's first read is
  judged (``HeldWorkers``): started at once if it computes, after the first batch if it waits
  (by then the loader has become threads, and they are never started).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

try:
    import numpy as np
except ImportError:  # the run without numpy (make test-nonumpy): a tensor for the array
    np = None  # type: ignore[assignment]
import pytest
import torch
import torch.utils.data as tud

import ferry
from _support.datasets import AllAtOnce, Indices
from _support.resume import assert_resumes_exactly
from ferry._core.alloc import expect_batch, using_allocator
from ferry._engine.crew import channels, group, kinds
from ferry._engine.transport import shm
from ferry._engine.transport.messages import Done
from ferry._engine.tuning import switch
from ferry._engine.tuning.switch import HeldWorkers, ThreadSwitch
from ferry._engine.work.fetch import Timing
from ferry._engine.work.reads import SampleReads
from ferry._sampler_keys import first_draw_bytes
from ferry.samplers import BatchSampler, RandomSampler, SequentialSampler
from ferry.stats import StatsRecorder
from workers.test_sample_reads import OpensAtFirstRead

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

    send = channels.ProcessChannel.send_task

    def sending(self: Any, worker: Any, task: int, key: Any) -> None:
        events.append(("send", worker.worker_id))
        send(self, worker, task, key)

    monkeypatch.setattr(group, "_start_process", starting)
    monkeypatch.setattr(channels.ProcessChannel, "send_task", sending)
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
    reads._measured(0.01, 0.0001)  # (measured to wait: read at once)
    before = {t.name for t in threading.enumerate()}
    try:
        assert reads.read(AllAtOnce(8), list(range(8))) == list(range(8))  # (8 at once)
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
        "extra": (
            torch.zeros(10, dtype=torch.float64) if np is None else np.zeros(10, dtype=np.float64),
            0.5,
            "name",
        ),
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


def test_one_batch_read_at_once_is_enough_to_judge() -> None:
    plan = ferry.DataLoader(Indices(64), batch_size=8, num_workers="auto")._plan()
    assert plan.num_workers >= 2
    switch = ThreadSwitch(plan, copies=True, replays=False)
    done = Done(0, None, timing=_timing(0.012), cpu=0.003, reads=(0.08, 0.0004, 8))
    switch.after(done, list(range(8)), plan_stats(), lambda: 8)
    assert "from batch 1 of the first epoch" in switch.why
    # Fewer reads than DECISIVE_READS, or one batch read one after another: not enough.
    for done in (
        Done(0, None, timing=_timing(0.03), cpu=0.0003, reads=(0.03, 0.0003, 3)),
        Done(0, None, timing=_timing(0.08), cpu=0.0008),
    ):
        other = ThreadSwitch(plan, copies=True, replays=False)
        other.after(done, list(range(8)), plan_stats(), lambda: 8)
        assert other.why == ""
        assert not other.judge.decided


# -- the other workers, held back while worker 0's first read is judged --------------------------


def test_held_workers_start_when_the_first_read_computes_or_no_word_came() -> None:
    configs: list[Any] = ["worker 1", "worker 2"]  # (stand-ins: only passed along)
    held = HeldWorkers()
    assert not held.due()
    assert held.wait_for(0.5) == 0.5
    held.hold(configs)
    assert not held.due()
    assert held.wait_for(0.5) <= switch.HOLD_FOR
    held.waits = False  # worker 0's first read computes: they are needed now
    assert held.due()
    assert held.take() == configs
    assert not held.due()

    held.hold(configs)
    held.until = time.monotonic() - 1  # no word within HOLD_FOR
    assert held.due()
    assert held.wait_for(0.5) == 0.0

    held.hold(configs)
    held.waits = True  # it waits: after the first batch (unless the loader became threads)
    held.until = time.monotonic() - 1
    assert not held.due()
    assert held.wait_for(0.5) == 0.5
    held.delivered = True
    assert held.due()


class _WaitingPids(tud.Dataset[Any]):
    """Sample ``i`` is ``(i, pid of the process that read it)`` (``i`` alone without
    ``pids``), after ``latency`` seconds of sleep (a read that waits) or of computing."""

    def __init__(self, n: int, latency: float, computes: bool = False, pids: bool = True) -> None:
        self.n, self.latency, self.computes, self.pids = n, latency, computes, pids

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[int, int]:
        if self.computes:
            end = time.thread_time() + self.latency
            while time.thread_time() < end:
                pass
        else:
            time.sleep(self.latency)
        return (index, os.getpid()) if self.pids else index


@pytest.mark.timeout(60)
def test_reads_that_wait_become_threads_before_the_other_workers_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events = _record_order(monkeypatch)
    # (no start for want of word from worker 0, however slow the machine)
    monkeypatch.setattr(switch, "HOLD_FOR", 30.0)
    loader = ferry.DataLoader(
        _WaitingPids(96, 0.005), batch_size=16, num_workers="auto", multiprocessing_context="fork"
    )
    theirs = tud.DataLoader(range(96), batch_size=16)
    for epoch in range(2):
        batches = list(loader)
        assert [b[0].tolist() for b in batches] == [b.tolist() for b in theirs]
        assert loader.stats().engine == "thread"
        assert "from batch 1 of the first epoch" in (loader.stats().tuning or "")
        # Batch 0 of the first epoch from worker 0's process, every other one from a thread
        # of this process.
        assert bool(batches[0][1].eq(os.getpid()).all()) == (epoch > 0)
        assert all(b[1].eq(os.getpid()).all() for b in batches[1:])
    assert [what for what, _ in events].count("start") == 1  # worker 0's process alone


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["computes", "opens its file"])
def test_reads_that_compute_start_the_other_workers_while_worker_0_reads(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Worker 0's first batch computes (4 reads of 20 ms), or its first read opens the
    dataset's file (it waits: the others are held back) and the reads after it compute: the
    others start while worker 0 still reads its first batch, not once it was handed out
    (which cost the first epoch of such a dataset a batch of every other worker's time)."""
    events = _record_order(monkeypatch)
    monkeypatch.setattr(switch, "HOLD_FOR", 30.0)  # (started by worker 0's word alone)
    if case == "computes":
        dataset: Any = _WaitingPids(24, 0.02, computes=True, pids=False)
        size, n = 4, 24
    else:
        dataset, size, n = OpensAtFirstRead(48, work=0.01), 8, 48
    loader = ferry.DataLoader(
        dataset, batch_size=size, num_workers="auto", multiprocessing_context="fork"
    )
    workers = loader._plan().num_workers
    iterator = iter(loader)
    first = next(iterator)
    assert [w for what, w in events if what == "start"] == list(range(workers))
    assert first.tolist() == list(range(size))
    assert [x for b in iterator for x in b.tolist()] == list(range(size, n))
    assert loader.stats().engine == "process"


@pytest.mark.timeout(60)
def test_an_epoch_after_one_that_judged_its_reads_to_compute_holds_no_worker_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once an epoch of an auto loader judged its process workers' reads to compute, the
    next epochs (new workers, whose first reads wait: here they open the dataset's file) start
    every worker at once: the verdict is not made again at the price of the other workers'
    start (before, they were held back until worker 0's first batch was handed out)."""
    events = _record_order(monkeypatch)
    monkeypatch.setattr(switch, "HOLD_FOR", 30.0)
    dataset = OpensAtFirstRead(64, work=0.002, opens=0)  # (epoch 0 computes: judged so)
    loader = ferry.DataLoader(
        dataset, batch_size=16, num_workers="auto", multiprocessing_context="fork"
    )
    workers = loader._plan().num_workers
    assert loader._plan().hold_workers
    assert [x for b in loader for x in b.tolist()] == list(range(64))
    assert loader.stats().engine == "process"
    dataset.opens = 2  # (the next epoch's workers are forked with it: two reads wait)
    events.clear()
    iterator = iter(loader)
    assert not loader._plan().hold_workers
    first = next(iterator)
    events.append(("handed out", 0))
    # every worker started before worker 0's first batch (two reads that wait) was handed out
    assert [w for what, w in events if what == "start"] == list(range(workers))
    assert events[-1] == ("handed out", 0)
    assert first.tolist() == list(range(16))
    assert loader._plan().num_workers == workers
    assert [x for b in iterator for x in b.tolist()] == list(range(16, 64))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_held_workers_keep_torchs_batches_order_and_resume(batch_size: int) -> None:
    def make(seed: int) -> ferry.DataLoader[Any]:
        return ferry.DataLoader(
            _WaitingPids(40, 0.003, pids=False),
            batch_size=batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(seed),
            num_workers="auto",
            multiprocessing_context="fork",
        )

    theirs = tud.DataLoader(
        range(40), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(5)
    )
    loader = make(5)
    for _ in range(2):
        assert [b.tolist() for b in loader] == [b.tolist() for b in theirs]
    assert_resumes_exactly(make, at=1)
