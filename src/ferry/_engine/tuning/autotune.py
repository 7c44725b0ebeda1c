"""``num_workers="auto"`` and ``prefetch_factor="auto"``: the loader picks them, then tunes them.

Only the options given as ``"auto"`` are chosen; the other keeps the user's value (a
``prefetch_factor`` left at None is torch's default, 2, and is not tuned).

**Start** (:meth:`Tuner.first`), from the CPUs this process may use: its CPU affinity, shared
with the other processes of the node when it is free to use all of them (``LOCAL_WORLD_SIZE``,
set by torchrun: eight ranks on 64 CPUs get 8 each), and taken as is when it is bound to a
subset (assumed to be its share). Process workers start at one per CPU, at most 8 (the main
process mostly waits in ``next()``); thread workers at most 4, as they share the GIL. At least
one worker: ``"auto"`` never loads in the training loop's thread. An unknown CPU count gives 2.
``prefetch_factor`` starts at 2.

**Adjust** (:meth:`Tuner.after_epoch`), at the boundary after each full epoch of at least
``MIN_BATCHES`` batches, from that epoch's :class:`~ferry.stats.LoaderStats`. Busy: the workers'
mean busy fraction. At most one change per epoch:

1. *The loader is behind* (``LoaderStats.bottleneck``: after the first batch, the loop spent
   at least 10% of its time blocked in ``next()``, waiting for at least 10% of the batches) and
   the workers are busy (>= ``BUSY``): more workers. Enough to keep up by the epoch's figures
   (worker seconds per batch / the loop's own seconds per batch), at least one more and at most
   twice as many, within the CPUs.
2. *The loader is behind although the workers are idle* (< ``BUSY``): batch times are uneven,
   so a deeper queue helps: ``prefetch_factor`` doubles, up to ``PREFETCH_CAP``, while the
   batches it holds (bytes per batch x workers x prefetch) stay under ``MEMORY_SHARE`` of the
   available memory.
3. *The loader is well ahead* (``next()`` waited for at most ``AHEAD`` of the batches) and the
   workers are idle (< ``IDLE``): one worker fewer, if the others would stay under ``BUSY``.
   This saves CPUs and memory, never throughput.
4. Otherwise the setting stays.

**Settle.** A change is a trial, judged on the next epoch: one meant to be faster (rules 1, 2)
is kept if batches/s rose by ``GAIN`` or more, one meant to be leaner (rule 3) if the loader
stayed ahead; a trial that fails is undone. The tuner stops for good at the first epoch where
nothing is to change, after undoing a trial, or when it would go back to a setting it left, so
a run's settings are stable after a few epochs and the tuner cannot oscillate.

**Threads bound by the GIL.** Thread workers that ``num_workers="auto"`` chose because the
first reads waited (tuning/switch.py) are process workers again from the next epoch, for good,
when that epoch shows their reads held the GIL they share while the loader was behind
(:meth:`Tuner.gil_bound`, :data:`GIL_BOUND`): the judge saw only the first reads.

**Batches are never changed.** Settings change only between epochs. For a map-style dataset,
batch ``i`` is made from the sampler's key ``i`` whatever the number of workers, so the batches
and their order (in order mode) are the same. A stream (iterable-style dataset) is read by each
worker from its own shard (``get_worker_info``), so its worker count decides the batches: it
keeps the count chosen at the start, and only ``prefetch_factor`` is tuned. Random augmentations
in workers are seeded per worker (``base_seed + worker_id``, as in torch): a new worker count
changes which worker, so which random stream, makes a batch, like any change of
``num_workers`` in torch. Fix ``num_workers`` where augmentations must repeat exactly.

``Tuner.reason`` says what was chosen and why, with the figures; it is
``loader.stats().tuning``. Design note: ``docs/design/autotune.md``.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass
from typing import Any, Literal

from ferry._core.memory import available_memory as meminfo_available
from ferry._engine.work.reads import PARALLEL_FROM
from ferry._validate import as_count, available_cpus
from ferry.errors import MalformedState
from ferry.stats import LoaderStats

__all__ = ["Resumed", "Tuner"]

Setting = tuple[int, int]  # (num_workers, prefetch_factor), both chosen or fixed

PROCESS_START_CAP = 8
"""Process workers to start with, at most: enough for most pipelines, few enough to start
quickly and hold little memory; rule 1 goes further, up to the CPU count, when it is needed."""
THREAD_START_CAP = 4
"""Thread workers to start with, at most: they share the GIL, so more help only where the
per-sample work releases it; rule 1 adds more only where the next epoch proves them faster."""
UNKNOWN_CPUS = 2
"""The CPU count to assume when the platform does not say."""
DEFAULT_PREFETCH = 2  # torch's default
PREFETCH_CAP = 8
"""Batches each worker may load ahead, at most: deeper queues smooth uneven batch times but
hold memory, and beyond a few batches per worker they only do the latter."""
MIN_BATCHES = 20
"""Epochs shorter than this are not judged: start-up and the pipeline filling dominate them."""
BUSY = 0.7
"""Mean busy fraction above which the workers are the limit (rule 1); a rule-3 removal must
keep the remaining workers below it, which leaves a margin against switching back."""
IDLE = 0.5
"""Mean busy fraction below which workers are candidates for removal (rule 3)."""
AHEAD = 0.1
"""Share of batches the loop may wait for and still count as well ahead (rule 3): each epoch
without persistent workers waits for its first batch or two while they start."""
GAIN = 1.05
"""A change meant to be faster is kept only if batches/s rose at least this much (5 %)."""
MEMORY_SHARE = 0.1
"""Share of the available memory the prefetched batches may take (rule 2)."""

WAITING_THREAD_CAP = 16
"""Thread workers rule 1 may reach, whatever the CPU count, when their reads wait (each already
reads a batch's samples at once; more of them overlap the batches): a trial keeps only what is
faster."""

GIL_BOUND = 0.7
"""Thread workers whose reads took this many CPU seconds per second of wall time or more,
with the loader behind, were bound by the one GIL they share: process workers, one GIL each, do
better wherever there are two CPUs or more (:meth:`Tuner.gil_bound`)."""

Goal = Literal["faster", "leaner"]


def _threads_wait(stats: LoaderStats) -> bool:
    """Thread workers whose batches were mostly waiting (their reads' wall time over CPU time,
    or their batches', at least ``PARALLEL_FROM``)."""
    ratio = max(stats.read_wait_ratio, stats.made_per_cpu)
    return stats.engine == "thread" and ratio >= PARALLEL_FROM


_STREAM_KEEPS_COUNT = "a stream keeps its worker count, which decides its shards"


@dataclass(frozen=True)
class _Trial:
    """A change on trial: the setting it replaced and what it must achieve to be kept."""

    before: Setting
    goal: Goal
    rate_before: float  # batches/s of the epoch before the change


@dataclass(frozen=True)
class _Step:
    """What the last epoch's figures call for: a new setting (or None: stay), and why."""

    setting: Setting | None
    goal: Goal | None
    why: str


@dataclass(frozen=True)
class Resumed:
    """What a loaded state's ``tuning`` gives the loader for its next iterators: the options,
    the kind of worker, and whether "auto" chose threads for reads that wait."""

    num_workers: int
    prefetch_factor: int | None
    worker_type: str
    threads_for_waits: bool


class Tuner:
    """Chooses a loader's ``num_workers`` and ``prefetch_factor`` when either is ``"auto"``.

    The loader calls :meth:`first` once, when it is made, and :meth:`after_epoch` at each epoch
    boundary; see the module docstring for the policy.
    """

    def __init__(
        self,
        num_workers: int | None,
        prefetch_factor: int | None,
        *,
        auto_prefetch: bool,
        iterable: bool,
        worker_type: str,
        cpus: int | None,
        memory: int | None,
    ) -> None:
        """``num_workers``: None where "auto", else the user's value; ``prefetch_factor``: the
        user's value where not ``auto_prefetch``. ``cpus``: the CPUs this loader may use (None:
        unknown); ``memory``: the bytes of memory available (None: unknown)."""
        self._fixed_workers = num_workers
        self._fixed_prefetch = prefetch_factor
        self._auto_prefetch = auto_prefetch
        self._iterable = iterable
        self._threads = worker_type == "thread"
        self._cpus = cpus
        self._memory = memory
        self._epochs = 0  # full epochs seen by after_epoch
        self._trial: _Trial | None = None
        self._tried: set[Setting] = set()
        self._settled = False
        self.reason = ""
        # num_workers="auto"'s process workers: an epoch judged their reads to compute, so the
        # next ones start every worker at once (see HeldWorkers in switch.py).
        self.reads_compute = False
        # Thread workers that "auto" chose were found bound by the GIL and became processes
        # again: the loader's epochs stay with processes (no judge moves them to threads).
        self.threads_refused = False

    @classmethod
    def for_options(
        cls, num_workers: object, prefetch_factor: object, *, iterable: bool, worker_type: str
    ) -> Tuner | None:
        """A tuner when either option is ``"auto"`` (None otherwise: the loader validates the
        options as usual). Out-of-range values of the other option are left for the loader's
        checks to reject, with their usual messages."""
        # Neither "auto": any other value (a string too) is the loader's to check, in torch's
        # order (validate.worker_options).
        auto_workers, auto_prefetch = num_workers == "auto", prefetch_factor == "auto"
        if not (auto_workers or auto_prefetch):
            return None
        fixed_workers = None if auto_workers else as_count("num_workers", num_workers)
        if auto_prefetch and fixed_workers == 0:
            raise ValueError(
                "prefetch_factor option could only be specified in multiprocessing: it is the "
                "number of batches each worker loads ahead, so with num_workers=0 leave it None "
                "(or set num_workers > 0 or 'auto'), got prefetch_factor='auto'"
            )
        fixed_prefetch = (
            None
            if auto_prefetch or prefetch_factor is None
            else as_count("prefetch_factor", prefetch_factor)
        )
        return cls(
            fixed_workers,
            fixed_prefetch,
            auto_prefetch=auto_prefetch,
            iterable=iterable,
            worker_type=worker_type,
            cpus=cpus_for_this_process(),
            memory=available_memory(),
        )

    # -- the policy ----------------------------------------------------------------------------

    def first(self) -> tuple[int, int]:
        """The setting of the first epoch."""
        workers, prefetch = self._fixed_workers, self._fixed_prefetch
        parts = []
        if workers is None:
            cap = THREAD_START_CAP if self._threads else PROCESS_START_CAP
            workers = max(1, min(self._limit, cap))
            kind = "thread" if self._threads else "process"
            parts.append(
                f"{self._cpus_text}, and {kind} workers start at one per CPU (at most {cap})"
            )
            if self._iterable:
                parts.append(_STREAM_KEEPS_COUNT)
        if prefetch is None:
            prefetch = DEFAULT_PREFETCH
            if self._auto_prefetch:
                parts.append("prefetch_factor starts at torch's default")
        parts.append(f"tuned after each epoch of at least {MIN_BATCHES} batches")
        self.reason = f"{_text((workers, prefetch))}: {'; '.join(parts)}"
        return workers, prefetch

    def after_epoch(
        self, stats: LoaderStats, current: tuple[int, int | None]
    ) -> tuple[int, int | None]:
        """The setting of the next epoch, from ``stats`` of the epoch that just ended with
        ``current``; sets :attr:`reason`."""
        if self._settled:
            return current
        self._epochs += 1
        workers, prefetch = current
        assert prefetch is not None  # "auto" always loads with workers
        setting = (workers, prefetch)
        if stats.batches < MIN_BATCHES:
            self.reason = (
                f"{_text(setting)}: epoch {self._epochs} had {stats.batches} batches, too few to "
                f"judge (fewer than {MIN_BATCHES})"
            )
            return current
        self._tried.add(setting)
        verdict = ""
        if self._trial is not None:
            trial, self._trial = self._trial, None
            kept, verdict = self._judge(trial, setting, stats)
            if not kept:
                self._settled = True
                self.reason = (
                    f"{_text(trial.before)} (settled after epoch {self._epochs}): {verdict}"
                )
                return trial.before
            verdict += "; "
        step = self._decide(stats, setting)
        if step.setting is None or step.setting in self._tried:
            self._settled = True
            why = step.why
            if step.setting is not None:
                why += f", but {_text(step.setting)} was left before and is not tried again"
            self.reason = f"{_text(setting)} (settled after epoch {self._epochs}): {verdict}{why}"
            return current
        assert step.goal is not None
        self._trial = _Trial(setting, step.goal, stats.batches_per_s)
        self.reason = (
            f"{_text(step.setting)} (on trial after epoch {self._epochs}): {verdict}{step.why}"
        )
        return step.setting

    def gil_bound(self, stats: LoaderStats) -> str:
        """Why thread workers that ``num_workers="auto"`` chose for reads that wait should be
        processes again ("": they stay): the epoch ``stats`` was long enough to judge, the
        loader was behind, there are two CPUs or more, and the reads took at least
        :data:`GIL_BOUND` CPU seconds a second: they held the GIL the threads share (reads that
        wait hold it for a small share of their time; reads that compute in Python, which the
        judge can mistake for them, hold it all along)."""
        if stats.engine != "thread" or stats.batches < MIN_BATCHES or self._limit < 2:
            return ""
        if stats.bottleneck != "loader" or stats.read_span_s <= 0:
            return ""
        share = stats.read_cpu_s / stats.read_span_s
        if share < GIL_BOUND:
            return ""
        return (
            f"the thread workers' reads took {share:.2f} CPU seconds a second, at least "
            f"{GIL_BOUND}, while the loop waited for {stats.waited} of {stats.batches} "
            f"batches: they were bound by the one GIL they share, so they are process workers "
            f"again ({self._cpus_text}), for good"
        )

    def back_to_processes(
        self, current: tuple[int, int | None], why: str
    ) -> tuple[int, int | None]:
        """Thread workers become processes again for ``why`` (see :meth:`gil_bound`): the
        setting of the next epoch, whose worker count is at most one per CPU when "auto" chose
        it (thread workers whose reads wait may be more); any change on trial is dropped, as
        the kind of worker it was tried with is gone."""
        self.threads_refused = True
        self._trial = None
        self._epochs += 1
        workers, prefetch = current
        assert prefetch is not None  # "auto" always loads with workers
        if self._tuned_workers:
            workers = min(workers, self._limit)
        self.reason = f"{_text((workers, prefetch))} (after epoch {self._epochs}): {why}"
        return workers, prefetch

    def _judge(self, trial: _Trial, setting: Setting, stats: LoaderStats) -> tuple[bool, str]:
        """Whether the change to ``setting`` met its goal in ``stats``, and a sentence why."""
        if trial.goal == "faster":
            rate, before = stats.batches_per_s, trial.rate_before
            if rate >= before * GAIN:
                return True, f"the last change raised batches/s from {before:.1f} to {rate:.1f}"
            return False, (
                f"{_text(setting)} was undone: {rate:.1f} batches/s against {before:.1f} before, "
                f"short of the {100 * (GAIN - 1):.0f}% gain a change must make"
            )
        if stats.waited <= AHEAD * stats.batches:
            return True, "the last change kept the loader ahead"
        return False, (
            f"{_text(setting)} was undone: the loop waited for {stats.waited} of "
            f"{stats.batches} batches, over {100 * AHEAD:.0f}%"
        )

    def _decide(self, stats: LoaderStats, setting: Setting) -> _Step:
        """Rules 1 to 4 of the module docstring applied to the epoch ``stats``."""
        busy = sum(w.busy_fraction for w in stats.workers) / max(len(stats.workers), 1)
        seen = (
            f"the loop waited for {stats.waited} of {stats.batches} batches, "
            f"{100 * stats.wait_share:.0f}% of its time, and the workers were "
            f"{100 * busy:.0f}% busy"
        )
        if stats.bottleneck == "loader":  # behind: judged by time, as LoaderStats does
            if busy >= BUSY:
                return self._more_workers(stats, setting, seen)
            return self._deeper_queue(stats, setting, seen)
        if stats.waited <= AHEAD * stats.batches and busy < IDLE:
            return self._fewer_workers(setting, busy, seen)
        return _Step(None, None, f"{seen}: the loader keeps up")

    def _more_workers(self, stats: LoaderStats, setting: Setting, seen: str) -> _Step:
        """Rule 1: the workers are the limit."""
        workers, prefetch = setting
        if not self._tuned_workers:
            return _Step(None, None, f"{seen}: the workers are the limit, but {self._why_fixed}")
        limit, bound, at = self._limit, "at most one per CPU", "at one per CPU"
        if _threads_wait(stats):
            # Threads whose reads wait do not compete for the CPUs: the trial decides.
            limit = max(limit, WAITING_THREAD_CAP)
            bound = f"at most {limit}: thread workers whose reads wait are not bound by the CPUs"
            at = f"at {limit}, the most for thread workers whose reads wait"
        if workers >= limit:
            limited = f"{seen}: the workers are the limit, {at} ({self._cpus_text})"
            return _Step(None, None, limited)
        worker_s = sum(w.busy_s for w in stats.workers) / stats.batches
        loop_s = (stats.wall_s - stats.wait_s) / stats.batches
        needed = math.ceil(worker_s / loop_s) if loop_s > 0 else limit
        more = min(limit, 2 * workers, max(workers + 1, needed))
        return _Step(
            (more, prefetch),
            "faster",
            f"{seen}: a batch took {1000 * worker_s:.2f} ms of worker time and the loop "
            f"{1000 * loop_s:.2f} ms, so {needed} workers would keep up; {more} are tried (at "
            f"most twice as many, {bound})",
        )

    def _deeper_queue(self, stats: LoaderStats, setting: Setting, seen: str) -> _Step:
        """Rule 2: the loader is behind while its workers idle."""
        workers, prefetch = setting
        uneven = f"{seen}: batch times are uneven"
        if not self._auto_prefetch:
            return _Step(None, None, f"{uneven}, but prefetch_factor is fixed")
        if prefetch >= PREFETCH_CAP:
            return _Step(None, None, f"{uneven}, but prefetch_factor is at its cap, {PREFETCH_CAP}")
        deeper = min(PREFETCH_CAP, 2 * prefetch)
        held = stats.hand_off_bytes / stats.batches * workers * deeper
        if self._memory is not None and held > MEMORY_SHARE * self._memory:
            return _Step(
                None,
                None,
                f"{uneven}, but prefetch_factor={deeper} would hold {held / 2**20:.0f} MiB of "
                f"batches, over {100 * MEMORY_SHARE:.0f}% of the "
                f"{self._memory / 2**30:.1f} GiB available",
            )
        return _Step(
            (workers, deeper), "faster", f"{uneven}, so each worker loads more batches ahead"
        )

    def _fewer_workers(self, setting: Setting, busy: float, seen: str) -> _Step:
        """Rule 3: the loader is well ahead and its workers mostly idle."""
        workers, prefetch = setting
        if not self._tuned_workers or workers <= 1:
            return _Step(None, None, f"{seen}: the loader keeps up")
        remaining = busy * workers / (workers - 1)
        if remaining >= BUSY:
            return _Step(None, None, f"{seen}: the loader keeps up and needs all its workers")
        return _Step(
            (workers - 1, prefetch),
            "leaner",
            f"{seen}: one worker fewer would be {100 * remaining:.0f}% busy and frees a CPU",
        )

    # -- resume --------------------------------------------------------------------------------

    def to_plain(
        self, setting: tuple[int, int | None], worker_type: str, threads_for_waits: bool
    ) -> dict[str, Any]:
        """What this tuner found, for the loader's ``state_dict()`` (``tuning``; plain data):
        the loader's ``setting`` and ``worker_type`` for its next iterator, whether "auto"
        chose threads because reads waited, the facts found about the dataset's reads, and
        where the tuning stands (the epochs judged, the settings tried, a change on trial)."""
        trial = self._trial
        return {
            "cpus": self._cpus,
            "num_workers": setting[0],
            "prefetch_factor": setting[1],
            "worker_type": worker_type,
            "threads_for_waits": threads_for_waits,
            "threads_refused": self.threads_refused,
            "reads_compute": self.reads_compute,
            "epochs": self._epochs,
            "settled": self._settled,
            "tried": sorted([list(tried) for tried in self._tried]),
            "trial": None
            if trial is None
            else {
                "before": list(trial.before),
                "goal": trial.goal,
                "rate_before": trial.rate_before,
            },
            "reason": self.reason,
        }

    def resumed(self, plain: object, current: tuple[int, int | None]) -> tuple[Tuner, Resumed]:
        """A copy of this tuner that goes on from ``plain`` (a state's ``tuning``, from
        :meth:`to_plain`), and the loader's options with it (``current``: the loader's as
        built). This tuner is left as it is, for a load that fails further on.

        On a machine with the saving tuner's CPU count, everything goes on where it was: the
        counts tuning reached (or had on trial), and no epoch is judged again that was. On
        another, the counts start again from this machine's (a stream's count excepted: its
        state needs the count it was saved with) and the tuning starts again; what was found
        about the dataset's reads holds anywhere: threads for reads that wait, processes for
        reads that held the GIL, no worker held back for reads that compute. Only the options
        given as ``"auto"`` change; ``worker_type="thread"`` given by the user stays."""
        saved = _ResumedTuning.parse(plain)
        same = saved.cpus == self._cpus
        workers, prefetch = current
        assert prefetch is not None  # "auto" always loads with workers
        if self._fixed_workers is None and (same or self._iterable):
            workers = saved.num_workers
        if self._auto_prefetch and same:
            prefetch = saved.prefetch_factor
        kind = "thread" if self._threads else saved.worker_type
        tuner = copy.copy(self)
        tuner.threads_refused, tuner.reads_compute = saved.threads_refused, saved.reads_compute
        if same:
            tuner._epochs, tuner._settled = saved.epochs, saved.settled
            tuner._tried = set(saved.tried)
            tuner._trial = saved.trial
            tuner.reason = f"{saved.reason} (the loaded state's tuning)"
        else:
            tuner._epochs, tuner._settled, tuner._tried, tuner._trial = 0, False, set(), None
            tuner.reason = (
                f"{_text((workers, prefetch))}: the loaded state was tuned with "
                f"{saved.cpus} CPUs; {tuner._cpus_text}, so tuning starts again"
            )
        return tuner, Resumed(workers, prefetch, kind, saved.threads_for_waits and kind == "thread")

    # -- helpers -------------------------------------------------------------------------------

    @property
    def _tuned_workers(self) -> bool:
        return self._fixed_workers is None and not self._iterable

    @property
    def _why_fixed(self) -> str:
        return _STREAM_KEEPS_COUNT if self._iterable else "num_workers is fixed"

    @property
    def _limit(self) -> int:
        """The most workers rule 1 may reach: one per CPU."""
        return self._cpus if self._cpus is not None else UNKNOWN_CPUS

    @property
    def _cpus_text(self) -> str:
        if self._cpus is None:
            return f"the CPU count is unknown, so {UNKNOWN_CPUS} are assumed"
        return f"{self._cpus} CPU{'s' if self._cpus != 1 else ''} for this process"


@dataclass(frozen=True)
class _ResumedTuning:
    """A state's ``tuning`` (see :meth:`Tuner.to_plain`), checked."""

    cpus: int | None
    num_workers: int
    prefetch_factor: int
    worker_type: str
    threads_for_waits: bool
    threads_refused: bool
    reads_compute: bool
    epochs: int
    settled: bool
    tried: tuple[Setting, ...]
    trial: _Trial | None
    reason: str

    @classmethod
    def parse(cls, plain: object) -> _ResumedTuning:
        """:class:`MalformedState`, naming the entry, where ``plain`` is not what
        :meth:`Tuner.to_plain` wrote."""

        def bad(name: str, value: object) -> MalformedState:
            return MalformedState(
                f"DataLoader state is malformed: its 'tuning' entry {name!r} is {value!r}; pass "
                "the dict that state_dict() returned, unchanged apart from a json or torch.save "
                "round trip"
            )

        def entry(name: str, kind: type | tuple[type, ...], of: dict[str, Any]) -> Any:
            value = of.get(name)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise bad(name, value)
            return value

        def setting(value: object, name: str) -> Setting:
            if (
                not isinstance(value, (list, tuple))
                or len(value) != 2
                or not all(type(n) is int and n >= 1 for n in value)
            ):
                raise bad(name, value)
            return value[0], value[1]

        if not isinstance(plain, dict):
            raise MalformedState(
                f"DataLoader state is malformed: its 'tuning' is a {type(plain).__name__}, "
                "not the dict that state_dict() wrote"
            )
        cpus = plain.get("cpus")
        if cpus is not None:
            entry("cpus", int, plain)
        options = [entry(name, int, plain) for name in ("num_workers", "prefetch_factor")]
        for name, value in zip(("num_workers", "prefetch_factor"), options, strict=True):
            if value < 1:  # ("auto" always loads with workers)
                raise bad(name, value)
        worker_type = entry("worker_type", str, plain)
        if worker_type not in ("process", "thread"):
            raise bad("worker_type", worker_type)
        trial = plain.get("trial")
        on_trial = None
        if trial is not None:
            if not isinstance(trial, dict):
                raise bad("trial", trial)
            goal = entry("goal", str, trial)
            if goal not in ("faster", "leaner"):
                raise bad("goal", goal)
            rate = entry("rate_before", (int, float), trial)
            on_trial = _Trial(setting(trial.get("before"), "before"), goal, float(rate))
        return cls(
            cpus=cpus,
            num_workers=options[0],
            prefetch_factor=options[1],
            worker_type=worker_type,
            threads_for_waits=entry("threads_for_waits", bool, plain),
            threads_refused=entry("threads_refused", bool, plain),
            reads_compute=entry("reads_compute", bool, plain),
            epochs=entry("epochs", int, plain),
            settled=entry("settled", bool, plain),
            tried=tuple(setting(tried, "tried") for tried in entry("tried", list, plain)),
            trial=on_trial,
            reason=entry("reason", str, plain),
        )


def _text(setting: Setting) -> str:
    return f"num_workers={setting[0]}, prefetch_factor={setting[1]}"


def cpus_for_this_process() -> int | None:
    """The CPUs this process's workers may use (None: unknown): its affinity, shared with the
    node's other ranks (``LOCAL_WORLD_SIZE``) unless the affinity is already a subset."""
    cpus, _ = available_cpus()
    if cpus is None:
        return None
    machine = os.cpu_count()
    bound = machine is not None and cpus < machine  # pinned to a share by the launcher
    try:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        ranks = 1
    if bound or ranks <= 1:
        return cpus
    return max(1, cpus // ranks)


def available_memory() -> int | None:
    """Bytes of memory available without swapping (None: unknown): ``MemAvailable`` (free
    memory plus reclaimable cache, as the slab allocator reads it), else free pages."""
    known = meminfo_available()
    if known is not None:
        return known
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None
