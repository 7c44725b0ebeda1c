"""The doctor's rules: from what a run measured to which option to change, and why.

Each rule is a small function of the :class:`Findings` that returns one :class:`Advice` or
None; :data:`RULES` lists them in the order they are reported. The thresholds are the
constants below, each with the reason for its value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ferry._core.stateful import has_state_methods
from ferry._torch_types import TorchSubset
from ferry.datasets import is_iterable_style, tensor_gather
from ferry.doctor.measure import Measurement, ThreadProbe
from ferry.stats import LoaderStats

__all__ = [
    "RULES",
    "Advice",
    "Findings",
    "advise",
    "nothing_to_gain",
    "stage_shares",
    "worth_probing_threads",
]

# A batch made in under 1 ms comes at over 1000 batches/s, faster than most training steps;
# and handing a batch over from a worker costs a sizeable part of a millisecond, so more
# workers (or a faster __getitem__) would gain little.
SLOW_BATCH_S = 1e-3
# Without workers, the main process making batches this share of the wall time: workers would
# take that off the loop.
MAIN_BUSY = 0.5
# Workers this busy (mean busy fraction) have no slack: only more of them make more batches.
WORKERS_BUSY = 0.8
# Workers idle more than 1 - this, while the loop still waits for some batches: uneven batch
# times, which a deeper prefetch queue absorbs.
WORKERS_IDLE = 0.7
WAITED_SHARE = 0.25  # ... the loop waited for at least this share of the batches
# Two worker threads this much faster than one: __getitem__ releases the GIL (2x is ideal).
GIL_FREE = 1.5
# Batches that took this many times the CPU time they used were made of reads that wait.
READS_WAIT = 4.0
# Two worker threads less than this much faster than one: __getitem__ holds the GIL.
GIL_BOUND = 1.2
# Workers taking turns whose batches take this much longer on the slowest than on the fastest
# (each made at least UNEVEN_BATCHES): the epoch waits for the slowest. On a 16-vCPU H200 host
# plain processes doing the same work ran 1.3-1.4x apart, and balance_workers=True made 1.19x
# torch's samples/s on a 240-batch JPEG epoch (docs/design/scaling.md).
UNEVEN_WORKERS = 1.2
UNEVEN_BATCHES = 4
# Process workers' own costs (moving batches out, starting each epoch) this share of the
# loader's work or of an epoch: what thread workers would save.
PROCESS_COSTS = 0.10
# fetch this share of the loader's work (all stages but wait): the per-sample calls dominate.
FETCH_DOMINATES = 0.5
# Worker start-up this share of an epoch, paid again every epoch without persistent workers.
STARTUP_SHARE = 0.10
# Batches this large spend real time in the host-to-device copy, which pinning speeds up.
LARGE_BATCH_BYTES = 1 << 20


@dataclass(frozen=True)
class Findings:
    """What the rules look at: the run of the (ferry) loader and its context."""

    run: Measurement  # its stats are not None: a ferry loader's run
    options: Mapping[str, Any]  # the loader's options (ferry.doctor.options.loader_options)
    cpus: int  # CPUs this process may run on
    accelerator: str | None  # "cuda" when present
    step_s: float = 0.0  # the training step the loop stood for (--step-ms)
    threads: ThreadProbe | None = None  # one thread worker against two, when probed

    @property
    def stats(self) -> LoaderStats:
        assert self.run.stats is not None
        return self.run.stats

    @property
    def workers(self) -> int:
        return self.stats.num_workers

    @property
    def work_per_batch_s(self) -> float:
        """Making a batch (fetch and collate), wherever it is made."""
        stats = self.stats
        return (stats.fetch_s + stats.collate_s) / stats.batches if stats.batches else 0.0

    @property
    def loop_waits(self) -> float:
        """The share of the wall time the loop spent blocked in next()."""
        return self.stats.wait_share

    @property
    def loader_bound(self) -> bool:
        """The loader is the bottleneck: the loop spent a real share of its time waiting
        (``LoaderStats.bottleneck``, judged by time)."""
        return self.stats.bottleneck == "loader"

    @property
    def workers_busy(self) -> float:
        """The workers' mean busy fraction (0 without workers)."""
        workers = self.stats.workers
        return sum(w.busy_fraction for w in workers) / len(workers) if workers else 0.0


@dataclass(frozen=True)
class Advice:
    """Change ``option`` from ``current`` to ``suggested``, because of ``reason`` (measured).

    ``changes`` are the loader options that apply it (what ``--try`` measures). A change to the
    dataset's code has no ``current`` value and no ``changes``.
    """

    option: str
    current: str
    suggested: str
    reason: str
    changes: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        if not self.current:  # a change to the code: nothing to go from
            return f"{self.option}: {self.suggested}: {self.reason}"
        also = [f"{k}={v!r}" for k, v in self.changes.items() if k != self.option]
        with_ = f" (with {', '.join(also)})" if also else ""
        return f"{self.option}={self.current} → {self.suggested}{with_}: {self.reason}"


def stage_shares(stats: LoaderStats) -> dict[str, float]:
    """Each stage's share of the loader's work (every stage but ``wait``), largest first."""
    work = {
        "sampler": stats.sampler_s,
        "fetch": stats.fetch_s,
        "collate": stats.collate_s,
        "hand_off": stats.hand_off_s,
        "pin": stats.pin_s,
    }
    total = sum(work.values()) or 1.0
    return {k: v / total for k, v in sorted(work.items(), key=lambda kv: -kv[1])}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _worker_target(f: Findings) -> int | None:
    """How many workers the loader should have, when more than it has: all the CPUs, or with a
    training step, as many as make one batch per step. None: more would not help."""
    if not f.loader_bound or f.work_per_batch_s < SLOW_BATCH_S or f.workers >= f.cpus:
        return None
    stats = f.stats
    if f.workers == 0:
        if (stats.fetch_s + stats.collate_s) / stats.wall_s < MAIN_BUSY:
            return None
    elif f.workers_busy < WORKERS_BUSY:
        return None
    if not f.step_s:
        return f.cpus
    return min(f.cpus, max(f.workers + 1, _keeping_up(f)))


def _keeping_up(f: Findings) -> int:
    """The workers that make a batch per training step between them."""
    return math.ceil(f.work_per_batch_s / f.step_s)


def more_workers(f: Findings) -> Advice | None:
    """The loader is the bottleneck, batches are slow to make, whoever makes them has no slack
    (the main process, or busy workers) and CPUs are free: more workers. Not when the reads
    wait (:func:`waiting_reads` says what helps then)."""
    target = _worker_target(f)
    if target is None or waiting_reads(f) is not None:
        return None
    stats = f.stats
    if f.workers == 0:
        share = (stats.fetch_s + stats.collate_s) / stats.wall_s
        reason = (
            f"fetch and collate take {share:.0%} of the wall time in the main process "
            f"({_ms(f.work_per_batch_s)} a batch)"
        )
    else:
        reason = (
            f"the {f.workers} workers were busy {f.workers_busy:.0%} of the time and the loop "
            f"still waited {f.loop_waits:.0%} of it"
        )
    reason += f"; {f.cpus} CPUs are available" if f.cpus > 1 else "; 1 CPU is available"
    if is_iterable_style(f.options["dataset"]):
        reason += (
            "; a stream must split itself between the workers (get_worker_info()), or each "
            "worker yields all of it"
        )
    if f.step_s:
        needed = _keeping_up(f)
        reason += (
            f"; with {_ms(f.work_per_batch_s)} of work a batch and a {_ms(f.step_s)} step, "
            f"{needed} workers keep up"
        )
        if needed > target:
            reason += f" (the CPUs allow {target})"
    return Advice("num_workers", str(f.workers), str(target), reason, {"num_workers": target})


def _process_costs(f: Findings) -> str:
    """What process workers cost the loader that thread workers would not, where that is a real
    share: moving batches out of the processes, starting them each epoch ("" when neither)."""
    costs = []
    hand_off = stage_shares(f.stats)["hand_off"]
    if hand_off >= PROCESS_COSTS:
        costs.append(f"moving batches out is {hand_off:.0%} of the loader's work")
    epoch_s, startup_s = f.run.epoch_s, f.run.startup_s
    if epoch_s and startup_s >= PROCESS_COSTS * epoch_s:
        costs.append(f"starting them {startup_s / epoch_s:.0%} of an epoch")
    return " and ".join(costs)


def _moving_costs_more(f: Findings) -> bool:
    """Process workers spent longer moving batches out than making them."""
    stats = f.stats
    return bool(f.workers) and stats.hand_off_s > stats.fetch_s + stats.collate_s > 0


def _reads_wait(f: Findings) -> float:
    """How many times their CPU time the batches took to make, when that says the reads wait
    (at least ``READS_WAIT``); 0 otherwise or unmeasured."""
    ratio = f.stats.made_per_cpu
    return ratio if ratio >= READS_WAIT else 0.0


def waiting_reads(f: Findings) -> Advice | None:
    """The loader is the bottleneck and its batches took many times the CPU time they used:
    the reads wait (network, object store). Thread workers read the samples of a batch at once
    when they wait (ferry._engine.work.reads), so concurrency is no longer workers x 1; more
    processes would each still read one sample at a time."""
    if f.options.get("worker_type", "process") == "thread" or not f.loader_bound:
        return None
    ratio = _reads_wait(f)
    dataset = f.options["dataset"]
    if not ratio or is_iterable_style(dataset) or has_state_methods(dataset):
        return None
    workers = max(f.workers, 2)
    reason = (
        f"making a batch took {ratio:.0f}x the CPU time it used ({_ms(f.work_per_batch_s)} a "
        "batch): the reads wait, not compute. Thread workers read the samples of a batch at "
        "once when they wait, as many as the wait calls for; more processes would each still "
        "read one sample at a time (num_workers='auto' makes this move by itself)"
    )
    changes: dict[str, Any] = {"num_workers": workers, "worker_type": "thread"}
    current = "'process'" if f.workers else "'process' (num_workers=0)"
    return Advice("worker_type", current, "'thread'", reason, changes)


def copy_on_write(f: Findings) -> Advice | None:
    """Process workers whose own memory grew far past a working set during the run: they copy
    the main process's pages as they read the dataset's Python objects (each read writes a
    reference count; see ferry._core.memory). Threads share the objects instead, unless
    ``__getitem__`` holds the GIL (two threads barely faster than one): then the objects
    belong in one buffer that reads do not write (``ferry.SharedList``)."""
    stats = f.stats
    if stats.engine != "process" or not stats.copy_on_write:
        return None
    measured = [w for w in stats.workers if w.memory_bytes >= 0]
    reason = (
        f"the {len(measured)} worker processes grew by {stats.memory_growth_bytes / 2**20:,.0f} "
        "MiB in one epoch, copying the main process's pages as they read the dataset's Python "
        "objects (copy-on-write: each read writes a reference count), so the memory grows "
        "with every worker; "
    )
    probe = f.threads
    if probe is None or probe.speedup < GIL_FREE:
        # Threads only where they were seen to run in parallel (see thread_workers).
        if probe is None:
            reason += (
                "thread workers would share the objects, but only work that releases the GIL "
                "runs in parallel on threads, and the doctor could not try them"
            )
        else:
            reason += (
                f"thread workers would share the objects, but two made only "
                f"{probe.speedup:.2f}x the batches of one (__getitem__ holds the GIL)"
            )
        return Advice("dataset", "", "keep its list of objects in ferry.SharedList", reason)
    reason += (
        f"thread workers share them, and two made {probe.speedup:.2f}x the batches of one "
        "(or keep them in ferry.SharedList, one buffer that reads do not copy)"
    )
    return Advice("worker_type", "'process'", "'thread'", reason, {"worker_type": "thread"})


def thread_workers(f: Findings) -> Advice | None:
    """Process workers (or the advice to add some): threads, when two worker threads make
    batches nearly twice as fast as one (``__getitem__`` releases the GIL) and processes cost
    something threads would not (moving batches out, more than making them or a real share of
    the work; starting them each epoch).

    Never without that measure: CPU-bound Python work (decoding, augmenting) holds the GIL, so
    thread workers take turns; on a 16-CPU host, 15 thread workers decoding JPEGs with Pillow
    made 0.25x the batches of torch's 15 process workers (measured on a 16-CPU H200)."""
    if f.options.get("worker_type", "process") != "process" or waiting_reads(f) is not None:
        return None
    if copy_on_write(f) is not None:  # (said there)
        return None
    target = _worker_target(f) or f.workers
    if not target or not f.loader_bound:
        return None
    stats, probe = f.stats, f.threads
    if probe is None or probe.speedup < GIL_FREE:
        return None
    reason = (
        f"two worker threads made {probe.speedup:.2f}x the batches of one: __getitem__ "
        "releases the GIL (I/O, sleeps, native code), so threads work in parallel"
    )
    if not f.workers:
        reason += " without starting processes or copying batches between them"
    elif _moving_costs_more(f):
        reason += (
            f", and moving a batch out of a worker process "
            f"({_ms(stats.hand_off_s / stats.batches)}, "
            f"{stats.hand_off_bytes / stats.batches / 2**20:.1f} MiB) costs more than making "
            f"it ({_ms(f.work_per_batch_s)}); thread workers hand batches over without copying"
        )
    elif costs := _process_costs(f):
        reason += f", and with processes {costs}"
    else:
        return None  # the processes cost little: threads would gain little
    changes: dict[str, Any] = {} if f.workers else {"num_workers": target}
    changes["worker_type"] = "thread"
    return Advice("worker_type", "'process'", "'thread'", reason, changes)


def process_workers(f: Findings) -> Advice | None:
    """Thread workers whose ``__getitem__`` holds the GIL (two threads barely faster than
    one), with the loader the bottleneck: processes, which run in parallel."""
    probe = f.threads
    if f.options.get("worker_type") != "thread" or f.workers < 2 or not f.loader_bound:
        return None
    if probe is None or probe.speedup >= GIL_BOUND:
        return None
    reason = (
        f"two worker threads made only {probe.speedup:.2f}x the batches of one: __getitem__ "
        "holds the GIL, so the threads take turns; processes run in parallel"
    )
    return Advice("worker_type", "'thread'", "'process'", reason, {"worker_type": "process"})


def balanced_workers(f: Findings) -> Advice | None:
    """Workers taking turns (torch's round-robin) at different speeds, with the loader the
    bottleneck: the fast ones wait for their turn behind the slowest. Balanced, the next batch
    goes to the worker that would finish it first."""
    options = f.options
    if options.get("balance_workers") or is_iterable_style(options["dataset"]):
        return None
    if f.workers < 2 or not f.loader_bound:
        return None
    paces = [
        (w.busy_s / w.batches, w.worker_id)
        for w in f.stats.workers
        if w.batches >= UNEVEN_BATCHES and w.busy_s > 0
    ]
    if len(paces) < 2:
        return None
    (fast, fastest), (slow, slowest) = min(paces), max(paces)
    if slow < UNEVEN_WORKERS * fast:
        return None
    reason = (
        f"worker {slowest} took {_ms(slow)} a batch and worker {fastest} {_ms(fast)} "
        f"({slow / fast:.2f}x): taking turns, the fast workers wait for the slow ones (CPUs of "
        "unequal speed, as a VM's vCPUs); balanced, the next batch goes to the worker that "
        "would finish it first. Batches still come in order, but which worker makes a batch, "
        "and so what its worker-seeded random draws give, then depends on timing"
    )
    return Advice("balance_workers", "False", "True", reason, {"balance_workers": True})


def deeper_prefetch(f: Findings) -> Advice | None:
    """Workers idle part of the time while the loop still waits for many batches: batch times
    are uneven, and the queue of ``prefetch_factor`` batches per worker runs dry behind a slow
    one. Doubling it absorbs more."""
    stats = f.stats
    if not f.workers or not f.loader_bound or f.workers_busy >= WORKERS_IDLE:
        return None
    if stats.waited < WAITED_SHARE * stats.batches:
        return None
    if (stats.sampler_s + stats.pin_s) / stats.wall_s >= MAIN_BUSY:
        return None  # the main process is the limit, not the queue
    current = int(f.options.get("prefetch_factor") or 2)
    reason = (
        f"the workers were idle {1 - f.workers_busy:.0%} of the time, yet the loop waited for "
        f"{stats.waited} of {stats.batches} batches (for {_ms(f.run.wait_median_s)} at the "
        f"median, {_ms(f.run.wait_max_s)} at the longest): batch times are uneven and "
        f"{current * f.workers} batches in flight do not cover the slow ones"
    )
    return Advice(
        "prefetch_factor", str(current), str(2 * current), reason, {"prefetch_factor": 2 * current}
    )


def _innermost(dataset: Any) -> Any:
    """The dataset under any Subsets: theirs forward ``__getitems__`` to it, when it has one."""
    while isinstance(dataset, TorchSubset):
        dataset = dataset.dataset
    return dataset


def batch_getitems(f: Findings) -> Advice | None:
    """A map-style dataset fetched one ``__getitem__`` call per sample, with fetch most of the
    loader's work on slow batches: a ``__getitems__(indices)`` that makes the batch in one
    call can share the work across its samples."""
    dataset = _innermost(f.options["dataset"])
    batch_size = f.options.get("batch_size")
    if is_iterable_style(dataset) or callable(getattr(dataset, "__getitems__", None)):
        return None
    if tensor_gather(f.options["dataset"]) is not None:
        return None  # the loader gathers its batches in one call already
    if batch_size is None and f.options.get("batch_sampler") is None:
        return None  # batching off: one sample a batch
    share = stage_shares(f.stats)["fetch"]
    if not f.loader_bound or f.work_per_batch_s < SLOW_BATCH_S or share < FETCH_DOMINATES:
        return None
    name = type(dataset).__name__
    calls = "one __getitem__ call per sample"
    if batch_size:
        per_call = f.stats.fetch_s / (f.stats.batches * batch_size)
        calls = f"{batch_size} __getitem__ calls a batch, {_ms(per_call)} each"
    reason = (
        f"fetch is {share:.0%} of the loader's work, in {calls}, and {name} has no "
        "__getitems__: one call per batch can read, decode or transform the samples together "
        "(one file read or query, one vectorized operation)"
    )
    return Advice("__getitems__", "", f"implement {name}.__getitems__(indices)", reason)


def keep_workers(f: Findings) -> Advice | None:
    """Workers whose start-up is a large share of an epoch, and not kept between epochs."""
    if not f.workers or f.options.get("persistent_workers"):
        return None
    run, epoch_s = f.run, f.run.epoch_s
    if epoch_s is None or run.startup_s < STARTUP_SHARE * epoch_s:
        return None
    reason = (
        f"the workers took {run.startup_s:.2f} s to start (first batch after "
        f"{run.first_batch_s:.2f} s, then {_ms(1 / run.batches_per_s)} a batch): "
        f"{run.startup_s / epoch_s:.0%} of a {run.epoch_batches}-batch epoch (~{epoch_s:.1f} s), "
        "paid again every epoch"
    )
    return Advice("persistent_workers", "False", "True", reason, {"persistent_workers": True})


def pin_batches(f: Findings) -> Advice | None:
    """An accelerator, large batches and ``pin_memory`` off: pin them."""
    if f.accelerator is None or f.options.get("pin_memory"):
        return None
    if f.run.batch_bytes < LARGE_BATCH_BYTES:
        return None
    reason = (
        f"batches hold {f.run.batch_bytes / 2**20:.1f} MiB of tensors and a {f.accelerator} "
        "device is present: copies from pinned memory are faster and can overlap compute "
        "(.to(device, non_blocking=True))"
    )
    return Advice("pin_memory", "False", "True", reason, {"pin_memory": True})


RULES: tuple[Callable[[Findings], Advice | None], ...] = (
    waiting_reads,
    copy_on_write,
    more_workers,
    thread_workers,
    process_workers,
    balanced_workers,
    deeper_prefetch,
    batch_getitems,
    keep_workers,
    pin_batches,
)


def advise(f: Findings) -> list[Advice]:
    """The advice of every rule that applies, in the order of :data:`RULES`."""
    return [advice for rule in RULES if (advice := rule(f)) is not None]


def worth_probing_threads(f: Findings) -> bool:
    """Whether a worker-type rule could use :func:`~ferry.doctor.measure.probe_threads`: the
    loader is the bottleneck on slow batches (or on moving them out of processes), and has
    workers or would get some; or process workers copy the dataset (copy_on_write). No rule
    advises thread workers without the probe."""
    if f.stats.engine == "process" and f.stats.copy_on_write:
        return True
    if not f.loader_bound or (f.work_per_batch_s < SLOW_BATCH_S and not _moving_costs_more(f)):
        return False
    return bool(f.workers or _worker_target(f))


def nothing_to_gain(f: Findings) -> str:
    """Why no rule applies, in words."""
    if not f.loader_bound:
        return (
            f"the loop waited for the loader {f.loop_waits:.0%} of the wall time: the loader "
            "keeps up"
        )
    if f.work_per_batch_s < SLOW_BATCH_S:
        return (
            f"a batch is made in {_ms(f.work_per_batch_s)} ({f.stats.batches_per_s:,.0f} "
            "batches/s): faster than training steps take, and quicker than a worker could "
            "hand it over"
        )
    if f.workers >= f.cpus:
        return (
            f"the {f.workers} workers already use all {f.cpus} CPUs: only a faster __getitem__ "
            "(or more CPUs) would help"
        )
    return "no rule found a measured cause to act on"
