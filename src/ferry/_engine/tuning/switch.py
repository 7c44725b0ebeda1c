"""``num_workers="auto"`` with process workers: whether they give way to thread workers within
the epoch, judged from what their batches report (:class:`ThreadSwitch`), and the move, made at
the next batch boundary (:class:`ThreadMove`, which the worker iterator holds).

Two reasons, either enough:

* **Their reads wait.** The first batch of each worker, and more up to eight reads, is judged
  (:class:`WaitJudge`): the median read's wall seconds against the CPU seconds its thread
  used; or, for a batch whose reads ran at once (a
  process worker's own per-sample reads), what its median read says
  (:meth:`~ferry._engine.work.reads.SampleReads._verdict`; they run at once only after the
  worker's first read, and a probe after it, were read alone and waited, so a first read that
  opens a file does not pass for reads that wait). At
  :data:`~ferry._engine.work.reads.PARALLEL_FROM` times or more, thread workers reading a
  batch's samples at once do better (docs/design/io.md).
* **Their memory grows past what the system has**: copy-on-write of the dataset's Python
  objects, projected to the end of the epoch (:func:`ferry._core.memory.growth_verdict`;
  docs/design/memory.md).

The move is for good unless the threads, chosen because the reads waited, turn out bound by the
GIL at the end of an epoch: then the loader's next epochs have process workers again, and no
judge runs (``Tuner.gil_bound``, in loader._retune).

Only for a map-style dataset with no state of its own (a process worker's state could not move
into the shared object), not a stream (its workers' kind decides its shards), not an async
dataset (its process workers already keep a batch's reads in flight at once).

While the first worker's first read is judged, the other workers are held back
(:class:`HeldWorkers`): on two CPUs, forking and starting them slowed the first worker's start
of its batch's reads by milliseconds, and when those reads wait the loader becomes threads after
that batch anyway, so the other processes would be started for nothing. Once an epoch judged
the reads to compute, the loader's later epochs hold no worker back (``plan.hold_workers``):
their new workers open their files again, and each epoch would pay the hold again.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ferry._core.memory import (
    COST_SHARE,
    anon_bytes,
    available_memory,
    growth_verdict,
    process_faults,
    resident_anon_bytes,
    unchanged_since,
)
from ferry._engine.crew.crew import Crew
from ferry._engine.crew.kinds import ThreadWorkers
from ferry._engine.crew.worker import WorkerConfig
from ferry._engine.plan import EpochPlan
from ferry._engine.position.counted import snapshots_itself
from ferry._engine.position.track import EpochTrack
from ferry._engine.schedule import Scheduler
from ferry._engine.transport.messages import Done, key_length
from ferry._engine.work.aio import is_async_dataset
from ferry._engine.work.fetch import JUDGED_READS
from ferry._engine.work.reads import PARALLEL_FROM, SampleReads
from ferry._validate import available_cpus
from ferry.stats import StatsRecorder

__all__ = [
    "DECISIVE_READS",
    "HOLD_FOR",
    "HeldWorkers",
    "ThreadMove",
    "ThreadSwitch",
    "WaitJudge",
    "measure_at_end",
]

# The longest the other workers are held back for the first worker's first look (seconds):
# it comes a few ms after the first worker starts; a worker slow to start (a long
# worker_init_fn, a spawned interpreter) must not keep the others waiting for it.
HOLD_FOR = 0.02
# A batch whose reads ran at once, this many or more, is enough for WaitJudge to decide.
DECISIVE_READS = 8


class WaitJudge:
    """Whether process workers wait on their reads (``num_workers="auto"``): from the first
    ``batches`` batches they make, holding at least :data:`~ferry._engine.work.fetch.
    JUDGED_READS` reads, each batch's wall seconds (fetch and collate) against the CPU
    seconds its thread used, at the median read; or from one batch whose reads ran at once,
    at least :data:`DECISIVE_READS` of them (its worker's watcher saw them wait already, and
    each read was timed on its own: enough to go by, and the other workers need not start).
    Decides once; :meth:`add` returns why they should become thread workers, or "" (not yet,
    or they stay).

    The median read, not the sums: a read that waits once in a process (its file opened, its
    index read, a stall of a loaded machine) must not pass for reads that wait. With batches
    of one to three samples, the sums of the first two batches were one or two such reads:
    a dataset whose first two reads in each process wait went to threads."""

    def __init__(self, batches: int) -> None:
        self.batches = max(batches, 1)
        self.wall = self.cpu = 0.0
        self.seen = self.reads = 0
        self.ratios: list[tuple[float, int]] = []  # each batch's wall over CPU, and its reads
        self.decided = False

    def per_read(self) -> tuple[float, float] | None:
        """One read's mean wall and CPU seconds over the batches judged (None: none yet)."""
        if not self.reads:
            return None
        return self.wall / self.reads, self.cpu / self.reads

    def add(self, wall: float, cpu: float, reads: int = 1, at_once: bool = False) -> str:
        """A batch of ``reads`` samples took ``wall`` seconds and ``cpu`` CPU seconds (with
        ``at_once``: its reads ran at once, and these are their sums)."""
        if self.decided:
            return ""
        self.wall += wall
        self.cpu += cpu
        self.reads += reads
        self.seen += 1
        self.ratios.append((wall / max(cpu, 1e-7), reads))
        decisive = at_once and reads >= DECISIVE_READS
        if not decisive and (self.seen < self.batches or self.reads < JUDGED_READS):
            return ""
        self.decided = True
        ratio = self.ratios[-1][0] if decisive else _median_read(self.ratios)
        if ratio < PARALLEL_FROM:
            return ""
        return (
            f"worker_type='thread' from batch {self.seen} of the first epoch on: the process "
            f"workers' reads took {ratio:.0f}x the CPU time they used (they wait), and "
            "thread workers read the samples of a batch at once"
        )


def _median_read(ratios: list[tuple[float, int]]) -> float:
    """The ratio of the median read, each batch's ``(ratio, reads)`` counting for its reads
    (the lower median of an even count: staying in processes is the safe side)."""
    total = sum(reads for _, reads in ratios)
    seen = 0
    for ratio, reads in sorted(ratios):
        seen += reads
        if 2 * seen >= total:
            return ratio
    return 0.0  # (no batch)


class ThreadSwitch:
    """Whether, and why, an auto loader's process workers should become threads now."""

    def __init__(self, plan: EpochPlan, copies: bool, replays: bool) -> None:
        """``copies``: each worker holds its own copy of the dataset (process workers);
        ``replays``: resumed workers fetch keys again (see WorkerCursor.since)."""
        # The process workers read at once on pools of their own where the reads wait, and
        # whether they may become threads.
        self.reads_alone = (
            plan.reads_at_once
            and copies
            and not plan.iterable_style
            and not replays
            and not snapshots_itself(plan.dataset)
            and not is_async_dataset(plan.dataset)
        )
        self.active = self.reads_alone and plan.threads_if_waiting
        self.judge = WaitJudge(batches=plan.num_workers)
        # The memory the system could give, and the most the workers could copy (each all of
        # the main process's resident anonymous memory), as the epoch begins.
        self._budget = available_memory() if self.active else None
        main = resident_anon_bytes() if self.active else -1
        self._ceiling = main * plan.num_workers if main >= 0 else -1
        self.why = ""  # why the workers should become threads now ("": they stay)
        self.for_memory = False  # ... and whether it is their memory (else: their reads wait)

    def after(self, done: Done, key: Any, stats: StatsRecorder, epoch: Callable[[], int]) -> None:
        """A process worker's batch arrived (its figures are in ``stats`` already); ``epoch``
        gives the epoch's length in batches (TypeError: none)."""
        if not self.active or self.why:
            return
        if done.memory >= 0:
            self.why = self._memory(stats, epoch)
            self.for_memory = bool(self.why)
        if self.why or self.judge.decided:
            return
        if done.reads is not None:  # what its reads took, one by one (see last_parallel)
            if done.reads[2]:  # (none: the batch's one read was its worker's first, not judged)
                self.why = self.judge.add(*done.reads, at_once=True)
        elif done.cpu >= 0:
            self.why = self.judge.add(done.timing.made_s, done.cpu, key_length(key))

    def take(self) -> str:
        """The reason, once: the move is being made (and is made once)."""
        why, self.why, self.active = self.why, "", False
        return why

    def _memory(self, stats: StatsRecorder, epoch: Callable[[], int]) -> str:
        grown, made, total = stats.memory_growth()
        try:
            left = epoch() - total
        except TypeError:  # a sampler with no length: as many again as made so far
            left = made
        return growth_verdict(grown, made, left, self._budget, self._ceiling)


class HeldWorkers:
    """The workers after the first of an auto loader's process workers, not started yet: they
    start as soon as the first worker's first read is seen not to wait (it computes: they are
    needed now; also where its watcher saw it wait and the read as a whole, or the probe read
    after it, computed: a file opened, then computing), at :data:`HOLD_FOR` with no word of
    it, or once the first batch was handed out (its reads waited; the loader may become
    threads at a later batch, see :class:`ThreadSwitch`). Tasks wait for them: batch ``i``
    still goes to worker ``i % num_workers``, as in torch."""

    def __init__(self) -> None:
        self.configs: list[WorkerConfig] = []
        self.until = 0.0  # time.monotonic() past which they start with no word of the first
        self.waits: bool | None = None  # what the first worker's first look said (None: no word)
        self.delivered = False  # the first batch was handed out

    def hold(self, configs: list[WorkerConfig]) -> None:
        self.configs, self.waits, self.delivered = configs, None, False
        self.until = time.monotonic() + HOLD_FOR

    def wait_for(self, left: float) -> float:
        """How long the loop may wait for a message (at most ``left``) before they are due."""
        if not self.configs or self.waits is not None or self.delivered:
            return left
        return max(min(left, self.until - time.monotonic()), 0.0)

    def due(self) -> bool:
        """Whether the held workers should start now."""
        if not self.configs:
            return False
        if self.delivered or self.waits is False:
            return True
        return self.waits is None and time.monotonic() >= self.until

    def take(self) -> list[WorkerConfig]:
        configs, self.configs = self.configs, []
        return configs


class ThreadMove:
    """``num_workers="auto"``'s process workers within an epoch: whether they give way to
    threads (``switch``, looked at before each batch), the workers held back while the first
    one's first read is judged (``held``), and the move itself (:meth:`move`)."""

    def __init__(self, plan: EpochPlan, copies: bool, replays: bool) -> None:
        self.switch = ThreadSwitch(plan, copies, replays)
        self.held = HeldWorkers()

    @property
    def due(self) -> bool:
        """The process workers should become threads now."""
        return bool(self.switch.why)

    def move(
        self,
        owner: object,
        crew: Crew[Any],
        track: EpochTrack,
        schedule: Scheduler,
        stats: StatsRecorder,
    ) -> Crew[Any]:
        """The process workers wait on their reads, so as many thread workers take over here,
        at a batch boundary, and read each batch's samples at once
        (:mod:`ferry._engine.work.reads`): the new crew, its tasks sent. Every batch not
        handed out yet is fetched again by the thread worker with the process worker's id,
        from the same key: the epoch's batches and their order do not change (random
        augmentations then draw from the main process's generators, as thread workers do).
        Only for a map-style dataset with no state of its own (``ThreadSwitch.active``), so no
        worker's position has to move over. ``owner``: the iterator the new crew's finalizer
        is registered on; the track's plan becomes the threads'."""
        why = self.switch.take()
        self.held.take()  # (workers not started yet never will be: threads take their place)
        # Batches the process workers made already are handed out as they are (they lie in
        # slabs the main process keeps mapped while a tensor is over them); the rest, which
        # are dropped with the process workers, are fetched again. (With pinning, a made batch
        # waits on the stopping crew's pin thread: fetched again too.)
        keep_made = crew.pinner is None
        crew.stop()  # the process workers stop
        plan = replace(track.plan, worker_type="thread")
        track.moved_to(plan, why, for_memory=self.switch.for_memory)
        threads: Crew[Any] = Crew(owner, ThreadWorkers())
        # The thread workers' reads run at once from the first: the judge measured them.
        threads.group.reads = SampleReads(measured=self.switch.judge.per_read())
        stats.reads = threads.group.reads
        threads.pin(plan)
        threads.configs = [
            replace(
                config,
                parent_pid=os.getpid(),
                resume=None,  # (no state of its own; a thread's generators are the process's)
                track_rng=False,
                named_slabs=False,
                reads=threads.group.reads,
                read_limit=0,
            )
            for config in crew.configs
        ]
        threads.start(threads.configs, plan)
        for task_id in schedule.reassign_all(keep_made):
            task = schedule.tasks[task_id]
            threads.send(task.worker_id, task_id, task.key)
        return threads


class _ReadCost:
    """Seconds the last end-of-epoch read of one worker's memory took, in this process (0:
    none made yet). Kept for the process, not per iterator: each epoch of workers that do not
    persist has an iterator of its own, and a cost kept per iterator was 0 at every epoch's
    end, so every worker was read every time, past the share."""

    seconds = 0.0


def measure_at_end(stats: StatsRecorder, pids: list[tuple[int, int | None]]) -> None:
    """The epoch ended: read the memory of the process workers ``(worker id, pid)`` measured
    this epoch, from here (they are idle now, and their own measures, at most four times a
    second, may miss the end of a short epoch), within the share of the epoch's time the
    workers' own measures keep to (1%).

    A read of ``smaps_rollup`` walks the worker's page tables: 5-7 ms for a worker that
    imported torch, on the main process's clock and the epoch's path. Without the share, a
    50 ms epoch of 2 persistent workers spent 11-16 ms of the main process's CPU on it, and 15
    workers took about 100 ms at every epoch's end (83-126 ms from the last sample to the end
    of a 7.5 s epoch on a 16-vCPU host, against torch's 32-41). The reads run side by side
    (:func:`read_side_by_side`): the workers' CPUs are idle at an epoch's end. A worker that
    faulted in next to no pages since its latest figure was read (:func:`unchanged_since`; its
    ``/proc/<pid>/stat`` takes microseconds to read) keeps that figure: it cannot have grown."""
    epoch = stats.clock() - stats.started
    if _ReadCost.seconds * COST_SHARE > epoch:
        return  # (not one read fits: the fault counts are not looked at either)
    due: list[tuple[int, int, int]] = []
    for worker_id, pid in pids:
        if pid is not None and stats.measured_memory(worker_id):
            faults = process_faults(pid)
            if not unchanged_since(stats.memory_faults[worker_id], faults):
                due.append((worker_id, pid, faults))
    if not due or _ReadCost.seconds * len(due) * COST_SHARE > epoch:
        return
    started = time.perf_counter()
    found = read_side_by_side([f"/proc/{pid}/smaps_rollup" for _, pid, _ in due])
    for (worker_id, _, faults), anon in zip(due, found, strict=True):
        stats.worker_memory(worker_id, anon, faults)
    _ReadCost.seconds = (time.perf_counter() - started) / len(due)


# At most this many threads read the workers' memory at an epoch's end (the main one included).
_READERS = 8


def read_side_by_side(paths: list[str]) -> list[int]:
    """:func:`anon_bytes` of each ``smaps_rollup`` path, read by up to :data:`_READERS`
    threads at once, this one among them: the kernel walks each process's page tables while
    the reading thread has let go of the GIL, so N reads take about N / threads times one on
    a machine with CPUs to spare. -1 where a read gives nothing (the process is gone)."""
    found = [-1] * len(paths)
    readers = max(1, min(len(paths), _READERS, available_cpus()[0] or 1))

    def read(first: int) -> None:
        for index in range(first, len(paths), readers):
            found[index] = anon_bytes(paths[index])

    helpers = [
        threading.Thread(target=read, args=(first,), name="ferry-memory-read", daemon=True)
        for first in range(1, readers)
    ]
    for helper in helpers:
        helper.start()
    read(0)
    for helper in helpers:
        helper.join()
    return found
