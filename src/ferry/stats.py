"""Where a loader's time goes: per-stage statistics of an epoch, always on.

``loader.stats()`` returns a :class:`LoaderStats` for the epoch in progress, or the last one.
Its ``str()`` is a table; :meth:`LoaderStats.as_dict` is plain data for loggers::

    >>> for batch in loader:
    ...     train(batch)
    >>> print(loader.stats())
    >>> trainer.logger.log_metrics(loader.stats().as_dict()["stages_s"])

Stages, in seconds summed over the epoch:

* ``sampler``: drawing batch keys from the sampler (main process).
* ``fetch``: ``__getitem__`` / ``__getitems__`` (or reading a stream) where the batch is made.
* ``collate``: ``collate_fn`` where the batch is made.
* ``hand_off``: moving a batch from a worker process to the main process (pickling in the
  worker, unpickling onto shared memory in the main process); zero for threads and inline.
* ``wait``: the training loop blocked in ``next()``. With ``num_workers=0`` it contains fetch
  and collate; with workers it is the time the loader was behind.
* ``pin``: the loop's time spent on pinning: with ``num_workers=0`` the copy to pinned memory
  itself; with workers the wait for a batch the pin thread has not pinned yet (it pins each
  batch as it arrives, while the loop works).

Workers run in parallel, so the stage times of workers can add up to more than the wall time;
each worker's busy time (fetch, collate and its part of the hand-off) is at most the wall time.
``ready`` counts the batches that were already waiting when the loop asked; ``waited`` the
others. ``first_batch_s`` is the time from ``iter()`` to the first batch (worker start-up
included), ``first_wait_s`` the part of it the loop spent in ``next()``. ``bottleneck`` is
mostly judged by time: the loader is the bottleneck when, after the first batch, the loop
spends at least 10% of the time blocked in ``next()`` (``wait_share``), waiting for at least
10% of the batches. "Waited for more batches than found ready" misses workers that finish
together (every other batch is ready although the loop waits all the time); the time alone
would count the main process's own cost of a batch that is already there. Start-up is a cost
of its own, which ``persistent_workers`` saves.

Recording costs a few clock reads per batch (measured in BENCHMARKS.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from time import perf_counter
from typing import Any, Literal, Protocol

from ferry._core.memory import COPY_ON_WRITE

__all__ = ["LoaderStats", "WorkerStats"]

_STAGES = ("sampler", "fetch", "collate", "hand_off", "wait", "pin")
# The stages the main process times around a block of its own (StatsRecorder.timing).
TimedStage = Literal["sampler", "hand_off", "pin"]
# The loop blocked in next() at least this share of its time, waiting for at least this share
# of the batches: the loader holds it back.
LOADER_BOUND = 0.10


@dataclass(frozen=True)
class WorkerStats:
    """One worker's share of an epoch."""

    worker_id: int
    batches: int
    busy_s: float
    busy_fraction: float  # busy_s / the epoch's wall time
    # A process worker's share of anonymous memory at its latest measure, and how much that
    # grew since its first measure of the epoch (bytes; -1 and 0: not measured, as for threads,
    # and for a process worker that faulted in next to no pages after its first batch: it
    # cannot have grown). Growth past a working set is copy-on-write of the main process's
    # pages: see ferry._core.memory.
    memory_bytes: int = -1
    memory_growth_bytes: int = 0


@dataclass(frozen=True)
class LoaderStats:
    """Statistics of one epoch of a loader (see the module docstring)."""

    engine: str  # "inline", "thread" or "process"
    num_workers: int
    batches: int
    wall_s: float  # from iter() to the last batch handed out (or now, mid-epoch)
    sampler_s: float
    fetch_s: float
    collate_s: float
    hand_off_s: float
    wait_s: float
    pin_s: float
    ready: int
    waited: int
    hand_off_bytes: int
    workers: tuple[WorkerStats, ...]
    skipped: int = 0  # samples dropped by on_error="skip" this epoch
    first_batch_s: float = 0.0  # from iter() to the first batch handed out (start-up included)
    first_wait_s: float = 0.0  # of which the loop spent in next()
    # What num_workers="auto"/prefetch_factor="auto" chose and why ("" when neither is used).
    tuning: str = ""
    # Samples being read at once, at most (workers x per-sample reads of a batch: thread
    # workers read a batch's samples at once when they wait, see ferry._engine.work.reads), and how
    # many times its CPU time a read waits (0: not measured: process workers, inline).
    concurrency: int = 0
    read_wait_ratio: float = 0.0
    # Thread workers' shared reads: the CPU seconds they took this epoch, over how many
    # seconds of wall time (from when the reads began to the epoch's end; 0: not measured).
    read_cpu_s: float = 0.0
    read_span_s: float = 0.0
    # CPU seconds the fetching threads used for fetch and collate (map-style; per-sample
    # parallel reads count only the fetching thread's share): against fetch_s + collate_s,
    # how much of making a batch was waiting (``made_per_cpu``).
    cpu_s: float = 0.0
    cpu_made_s: float = 0.0  # the fetch and collate wall seconds of the batches cpu_s measured
    # Process workers: shared memory (slabs) mapped in the main process now (kept for reuse,
    # under batches in flight or held by the user; 0 once the workers stopped), and at most.
    shared_memory_bytes: int = 0
    shared_memory_peak_bytes: int = 0

    @property
    def made_per_cpu(self) -> float:
        """Wall seconds spent making batches (fetch and collate) per CPU second they used, over
        the batches measured (the first ones, then one in 16): about 1 for work that computes,
        far more for reads that wait (0: not measured)."""
        made = self.cpu_made_s
        return made / self.cpu_s if self.cpu_s > 0 and made > 0 else 0.0

    @property
    def memory_growth_bytes(self) -> int:
        """How much the process workers' own memory grew together since their first measure
        of the epoch (0: not measured; see ``WorkerStats.memory_growth_bytes``)."""
        return sum(w.memory_growth_bytes for w in self.workers)

    @property
    def copy_on_write(self) -> bool:
        """The workers grew by more than a working set (64 MiB each on average): they are
        copying the main process's pages, typically the dataset's Python objects whose
        reference counts every read writes."""
        measured = [w for w in self.workers if w.memory_bytes >= 0]
        return bool(measured) and self.memory_growth_bytes >= COPY_ON_WRITE * len(measured)

    @property
    def batches_per_s(self) -> float:
        return self.batches / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def wait_share(self) -> float:
        """The share of the time after the first batch that the training loop spent blocked
        in ``next()`` (the whole epoch's when it has one batch)."""
        wait, wall = self.wait_s, self.wall_s
        if self.batches > 1 and wall > self.first_batch_s:
            wait, wall = wait - self.first_wait_s, wall - self.first_batch_s
        return min(max(wait, 0.0) / wall, 1.0) if wall > 0 else 0.0

    @property
    def bottleneck(self) -> str:
        """ "loader" when the loop spent at least 10% of the time blocked in ``next()`` (after
        the first batch: ``wait_share``) and waited for at least 10% of the batches, else
        "training loop"; "unknown" before any batch."""
        if not self.batches:
            return "unknown"
        behind = self.wait_share >= LOADER_BOUND and self.waited >= LOADER_BOUND * self.batches
        return "loader" if behind else "training loop"

    def as_dict(self) -> dict[str, Any]:
        """Plain data (numbers, strings, lists, dicts) for loggers."""
        plain = asdict(self)
        plain["stages_s"] = {stage: plain.pop(f"{stage}_s") for stage in _STAGES}
        plain["batches_per_s"] = self.batches_per_s
        plain["wait_share"] = self.wait_share
        plain["bottleneck"] = self.bottleneck
        plain["made_per_cpu"] = self.made_per_cpu
        plain["memory_growth_bytes"] = self.memory_growth_bytes
        plain["copy_on_write"] = self.copy_on_write
        plain["workers"] = [dict(w) for w in plain["workers"]]
        return plain

    def __str__(self) -> str:
        per = 1000 / self.batches if self.batches else 0.0
        where = {
            "sampler": "main",
            "fetch": "main" if self.engine == "inline" else "workers",
            "collate": "main" if self.engine == "inline" else "workers",
            "hand_off": "both",
            "wait": "main",
            "pin": "main",
        }
        lines = [
            f"ferry DataLoader, {self.engine} engine, {self.num_workers} workers: "
            f"{self.batches} batches in {self.wall_s:.3f} s ({self.batches_per_s:.1f} batches/s)",
            f"  {'stage':<10}{'where':<9}{'total s':>10}{'ms/batch':>10}{'% of wall':>11}",
        ]
        for stage in _STAGES:
            total = getattr(self, f"{stage}_s")
            share = 100 * total / self.wall_s if self.wall_s > 0 else 0.0
            lines.append(
                f"  {stage:<10}{where[stage]:<9}{total:>10.3f}{total * per:>10.2f}{share:>10.0f}%"
            )
        for worker in self.workers:
            lines.append(
                f"  worker {worker.worker_id}: {worker.batches} batches, busy "
                f"{100 * worker.busy_fraction:.0f}% ({worker.busy_s:.3f} s)"
            )
        lines.append(
            f"  next() found the batch ready {self.ready} times and waited {self.waited} times; "
            f"after the first batch the loop waited {100 * self.wait_share:.0f}% of the time: "
            f"the bottleneck is the {self.bottleneck}"
        )
        if self.hand_off_bytes:
            lines.append(f"  hand-off moved {self.hand_off_bytes / 2**20:.1f} MiB")
        if self.shared_memory_peak_bytes:
            lines.append(
                f"  shared memory: {self.shared_memory_bytes / 2**20:.1f} MiB mapped now, at "
                f"most {self.shared_memory_peak_bytes / 2**20:.1f} MiB (slabs kept for reuse and "
                "under batches in flight or held)"
            )
        lines.extend(self._memory_lines())
        if self.skipped:
            lines.append(f"  on_error='skip' dropped {self.skipped} samples")
        if self.read_wait_ratio:
            lines.append(
                f"  reads: up to {self.concurrency} samples at once; a read waits "
                f"{self.read_wait_ratio:.0f}x its CPU time"
            )
        if self.tuning:
            lines.append(f"  autotuning: {self.tuning}")
        return "\n".join(lines)

    def _memory_lines(self) -> list[str]:
        measured = [w for w in self.workers if w.memory_bytes >= 0]
        if not measured:
            return []
        held = sum(w.memory_bytes for w in measured) / 2**20
        grown = self.memory_growth_bytes / 2**20
        lines = [
            f"  workers' own memory: {held:.0f} MiB, grown by {grown:.0f} MiB since their "
            "first measure"
        ]
        if self.copy_on_write:
            lines.append(
                "  copy-on-write: the worker processes copy the main process's pages as they "
                "read the dataset's Python objects (each read writes a reference count); "
                "worker_type='thread' shares them instead, and ferry.SharedList keeps a list "
                "of objects in one buffer that reads do not copy"
            )
        return lines


class ReadsView(Protocol):
    """What the statistics read of a loader's pool of per-sample reads (the engine's
    ``SampleReads`` or ``AsyncReads``)."""

    @property
    def peak_width(self) -> int:
        """The most reads of one batch run at once."""
        ...

    @property
    def limit(self) -> int:
        """The most reads the pool runs at once."""
        ...

    @property
    def ratio(self) -> float:
        """A read's wall seconds over its CPU seconds, as measured."""
        ...

    @property
    def cpu_seconds(self) -> float:
        """The CPU seconds every read took so far (0: not measured)."""
        ...


class SharedMemoryView(Protocol):
    """What the statistics read of the shared memory that process workers' batches hold in the
    main process (the engine's channel to them)."""

    def held_bytes(self) -> int: ...

    def held_peak_bytes(self) -> int: ...


class StatsRecorder:
    """The running figures of one epoch (internal: engines add to it, the loader reads it).

    The stages say what happened, the recorder measures it: ``with stats.timing("sampler"):``
    around a stage's block, a named method for each count (``batch_ready()``,
    ``batch_waited()``, ``made_here(...)``, ``samples_skipped(n)``, ``worker_made(...)``), and
    ``asked()`` / ``handed_out(asked)`` / ``epoch_ended(asked)`` around the loop's ``next()``.
    Each is called once per batch at most and reads the clock at most twice; ``clock`` (the
    seconds of :func:`time.perf_counter`) is a parameter for tests."""

    __slots__ = (
        "_reads",
        "batches",
        "busy",
        "clock",
        "collate",
        "cpu",
        "cpu_made",
        "ended",
        "fetch",
        "first_batch",
        "first_wait",
        "hand_off_bytes",
        "made",
        "memory_faults",
        "memory_first",
        "memory_latest",
        "reads_from",
        "ready",
        "shared",
        "skipped",
        "started",
        "timers",
        "wait",
        "waited",
    )

    def __init__(self, num_workers: int, clock: Callable[[], float] = perf_counter) -> None:
        self.clock = clock
        self.restart(num_workers)

    def restart(self, num_workers: int) -> None:
        """Begin a new epoch's figures (of ``num_workers`` workers, 1 in the main process),
        in place: the iterator and its loader read the same recorder."""
        clock = self.clock
        self.started = clock()
        self.ended: float | None = None
        # One timer per timed stage, kept (a block costs about 0.2 us, none is made per batch).
        self.timers = {stage: _Timing(clock) for stage in ("sampler", "hand_off", "pin")}
        self.batches = self.ready = self.waited = self.hand_off_bytes = self.skipped = 0
        self.fetch = self.collate = self.wait = 0.0
        self.first_batch = self.first_wait = 0.0
        self.busy = [0.0] * num_workers
        self.made = [0] * num_workers
        # Each process worker's memory at its first measure of the epoch and its latest.
        self.memory_first = [-1] * num_workers
        self.memory_latest = [-1] * num_workers
        # ... and the worker's page-fault count when its latest was read (-1: not known).
        self.memory_faults = [-1] * num_workers
        # Thread workers' shared per-sample reads (or an async dataset's), if any; process
        # workers' channel, which says what shared memory their batches hold here. The engine
        # sets them as the epoch begins (or as the workers become threads); the recorder only
        # reads them.
        self._reads: ReadsView | None = None
        self.reads_from = (0.0, 0.0)  # the reads' CPU seconds and the clock when they were set
        self.shared: SharedMemoryView | None = None
        # CPU seconds the threads that made the measured batches used making them, and the
        # wall seconds those batches took (fetch and collate): see fetch.CPU_SAMPLE.
        self.cpu = self.cpu_made = 0.0

    @property
    def reads(self) -> ReadsView | None:
        return self._reads

    @reads.setter
    def reads(self, reads: ReadsView | None) -> None:
        self._reads = reads
        self.reads_from = (reads.cpu_seconds if reads is not None else 0.0, self.clock())

    # -- what the stages tell it -------------------------------------------------------------

    def timing(self, stage: TimedStage) -> _Timing:
        """``with stats.timing(stage) as start:`` adds the block's seconds to ``stage`` (also
        when it raises); ``start`` is the clock when the block began. (A stage's blocks do not
        nest.)"""
        return self.timers[stage]

    @property
    def sampler(self) -> float:
        """Seconds the main process spent drawing keys from the sampler."""
        return self.timers["sampler"].total

    @property
    def hand_off(self) -> float:
        """Seconds spent handing batches from the workers to the loop."""
        return self.timers["hand_off"].total

    @hand_off.setter
    def hand_off(self, seconds: float) -> None:
        self.timers["hand_off"].total = seconds

    @property
    def pin(self) -> float:
        """Seconds spent pinning batches in the loop's ``next()``."""
        return self.timers["pin"].total

    def asked(self) -> float:
        """The loop called ``next()``: the clock now, for ``handed_out`` or ``epoch_ended``."""
        return self.clock()

    def handed_out(self, asked: float) -> None:
        """A batch was handed out to a loop that asked for it at ``asked``."""
        got = self.clock()
        self.wait += got - asked
        if not self.batches:
            self.first_batch, self.first_wait = got - self.started, got - asked
        self.batches += 1

    def epoch_ended(self, asked: float) -> None:
        """The loop asked at ``asked`` and learned that the epoch is over."""
        self.ended = self.clock()
        self.wait += self.ended - asked

    def batch_ready(self) -> None:
        """The batch the loop asked for had arrived already (made while the loop worked)."""
        self.ready += 1

    def batch_waited(self) -> None:
        """The loop had to wait for the batch it asked for."""
        self.waited += 1

    def made_here(self, fetch_s: float, collate_s: float, cpu_s: float) -> None:
        """The inline engine made a batch on demand in the loop's ``next()`` (so never ready
        before it was asked): its fetch and collate seconds, and the CPU seconds they used
        (-1: unmeasured)."""
        self.waited += 1
        self.fetch += fetch_s
        self.collate += collate_s
        self.cpu_used(fetch_s + collate_s, cpu_s)

    def samples_skipped(self, count: int) -> None:
        """``on_error="skip"`` dropped ``count`` samples of a batch."""
        self.skipped += count

    def cpu_used(self, made: float, cpu: float) -> None:
        """A batch that took ``made`` wall seconds used ``cpu`` CPU seconds (-1: unmeasured)."""
        if cpu >= 0:
            self.cpu += cpu
            self.cpu_made += made

    def worker_memory(self, worker_id: int, held: int, faults: int = -1) -> None:
        """A process worker measured its memory (``held`` bytes; -1: it did not), read when
        it had taken ``faults`` page faults (-1: not known)."""
        if held >= 0:
            if self.memory_first[worker_id] < 0:
                self.memory_first[worker_id] = held
            self.memory_latest[worker_id] = held
            self.memory_faults[worker_id] = faults

    def memory_growth(self) -> tuple[int, int, int]:
        """``(grown, made, total)``: how many bytes the workers measured this epoch grew by
        since their first measure, how many batches those workers made, and how many batches
        every worker made."""
        measured = [w for w, first in enumerate(self.memory_first) if first >= 0]
        grown = sum(self.memory_latest[w] - self.memory_first[w] for w in measured)
        return grown, sum(self.made[w] for w in measured), sum(self.made)

    def measured_memory(self, worker_id: int) -> bool:
        """Whether worker ``worker_id`` measured its memory this epoch."""
        return self.memory_first[worker_id] >= 0

    def worker_restarted(self, worker_id: int) -> None:
        """Worker ``worker_id`` is a new process: its memory is measured afresh."""
        self.memory_first[worker_id] = self.memory_latest[worker_id] = -1
        self.memory_faults[worker_id] = -1

    def worker_made(self, worker_id: int, timing: Any, cpu: float = -1.0) -> None:
        """A worker's figures for one batch it made (a ``ferry._engine.work.fetch.Timing``),
        and the CPU seconds it used making it (-1: unmeasured). Once a batch, in the loop: no
        property in it, and a call only for the batches whose CPU was measured."""
        fetch_s, collate_s, hand_off_s, nbytes = timing
        self.fetch += fetch_s
        self.collate += collate_s
        self.timers["hand_off"].total += hand_off_s
        self.hand_off_bytes += nbytes
        self.busy[worker_id] += fetch_s + collate_s + hand_off_s
        self.made[worker_id] += 1
        if cpu >= 0:  # (one batch in CPU_SAMPLE: the call is not on every batch's path)
            self.cpu_used(fetch_s + collate_s, cpu)

    # -- what the loader reads ---------------------------------------------------------------

    def result(self, engine: str, tuning: str = "") -> LoaderStats:
        end = self.ended if self.ended is not None else self.clock()
        wall = max(end - self.started, 1e-9)
        workers = tuple(
            WorkerStats(i, made, busy, min(busy / wall, 1.0), latest, max(latest - first, 0))
            for i, (made, busy, first, latest) in enumerate(
                zip(self.made, self.busy, self.memory_first, self.memory_latest, strict=True)
            )
        )
        workers_n = len(self.busy) if engine != "inline" else 0
        concurrency = max(workers_n, 1)
        if self.reads is not None:  # (its pool bounds the reads of every worker together)
            concurrency = min(
                concurrency * self.reads.peak_width, max(self.reads.limit, concurrency)
            )
        read_cpu = read_span = 0.0
        if self.reads is not None and self.reads.cpu_seconds:
            read_cpu = max(self.reads.cpu_seconds - self.reads_from[0], 0.0)
            read_span = max(end - max(self.reads_from[1], self.started), 0.0)
        return LoaderStats(
            concurrency=concurrency,
            read_wait_ratio=self.reads.ratio if self.reads is not None else 0.0,
            read_cpu_s=read_cpu,
            read_span_s=read_span,
            cpu_s=self.cpu,
            cpu_made_s=self.cpu_made,
            engine=engine,
            num_workers=len(self.busy) if engine != "inline" else 0,
            batches=self.batches,
            wall_s=wall,
            sampler_s=self.sampler,
            fetch_s=self.fetch,
            collate_s=self.collate,
            hand_off_s=self.hand_off,
            wait_s=self.wait,
            pin_s=self.pin,
            ready=self.ready,
            waited=self.waited,
            hand_off_bytes=self.hand_off_bytes,
            workers=workers if engine != "inline" else (),
            skipped=self.skipped,
            tuning=tuning,
            first_batch_s=self.first_batch,
            first_wait_s=self.first_wait,
            shared_memory_bytes=self.shared.held_bytes() if self.shared is not None else 0,
            shared_memory_peak_bytes=(
                self.shared.held_peak_bytes() if self.shared is not None else 0
            ),
        )


class _Timing:
    """The context manager of one stage of ``StatsRecorder.timing``: the seconds its blocks
    took, in ``total``. (The worker engine's loop, once a batch, reads ``clock`` and adds to
    ``total`` itself: no context manager's calls there.)"""

    __slots__ = ("_start", "clock", "total")

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._start = 0.0
        self.total = 0.0

    def __enter__(self) -> float:
        self._start = start = self.clock()
        return start

    def __exit__(self, kind: object, value: object, traceback: object) -> None:
        self.total += self.clock() - self._start
