"""``num_workers="auto"`` with process workers: whether they give way to thread workers within
the epoch, judged from what their batches report (``WorkerIterator._become_threads`` makes the
move at the next batch boundary).

Two reasons, either enough:

* **Their reads wait.** The first batch of each worker is judged (:class:`WaitJudge`): its wall
  seconds against the CPU seconds its thread used; or, for a batch whose reads ran at once (a
  process worker's own per-sample reads), its reads' wall seconds against their CPU seconds.
  At :data:`~ferry._engine.reads.PARALLEL_FROM` times or more, thread workers reading a
  batch's samples at once do better (docs/design/io.md).
* **Their memory grows past what the system has**: copy-on-write of the dataset's Python
  objects, projected to the end of the epoch (:func:`ferry._core.memory.growth_verdict`;
  docs/design/memory.md).

Only for a map-style dataset with no state of its own (a process worker's state could not move
into the shared object), not a stream (its workers' kind decides its shards), not an async
dataset (its process workers already keep a batch's reads in flight at once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ferry._core.memory import (
    anon_bytes,
    available_memory,
    growth_verdict,
    resident_anon_bytes,
)
from ferry._engine.aio import is_async_dataset
from ferry._engine.keys import stateful_part
from ferry._engine.messages import Done
from ferry._engine.plan import EpochPlan
from ferry._engine.reads import WaitJudge
from ferry.stats import StatsRecorder

__all__ = ["ThreadSwitch", "measure_at_end"]


class ThreadSwitch:
    """Whether, and why, an auto loader's process workers should become threads now."""

    def __init__(self, plan: EpochPlan, copies: bool, replays: bool) -> None:
        """``copies``: each worker holds its own copy of the dataset (process workers);
        ``replays``: resumed workers fetch keys again (see WorkerCursor.since)."""
        self.active = (
            plan.threads_if_waiting
            and copies
            and not plan.iterable_style
            and not replays
            and not stateful_part(plan.dataset)
            and not is_async_dataset(plan.dataset)
        )
        self.judge = WaitJudge(batches=plan.num_workers)
        # The memory the system could give, and the most the workers could copy (each all of
        # the main process's resident anonymous memory), as the epoch begins.
        self._budget = available_memory() if self.active else None
        main = resident_anon_bytes() if self.active else -1
        self._ceiling = main * plan.num_workers if main >= 0 else -1
        self.why = ""  # why the workers should become threads now ("": they stay)

    def after(self, done: Done, key: Any, stats: StatsRecorder, epoch: Callable[[], int]) -> None:
        """A process worker's batch arrived (its figures are in ``stats`` already); ``epoch``
        gives the epoch's length in batches (TypeError: none)."""
        if not self.active or self.why:
            return
        if done.memory >= 0:
            self.why = self._memory(stats, epoch)
        if self.why or self.judge.decided:
            return
        if done.reads is not None:  # read at once: what its reads took, one by one
            self.why = self.judge.add(*done.reads)
        elif done.cpu >= 0:
            self.why = self.judge.add(done.timing.made_s, done.cpu, _key_length(key))

    def take(self) -> str:
        """The reason, once: the move is being made (and is made once)."""
        why, self.why, self.active = self.why, "", False
        return why

    def _memory(self, stats: StatsRecorder, epoch: Callable[[], int]) -> str:
        measured = [w for w, first in enumerate(stats.memory_first) if first >= 0]
        grown = sum(stats.memory_latest[w] - stats.memory_first[w] for w in measured)
        made = sum(stats.made[w] for w in measured)
        try:
            left = epoch() - sum(stats.made)
        except TypeError:  # a sampler with no length: as many again as made so far
            left = made
        return growth_verdict(grown, made, left, self._budget, self._ceiling)


def measure_at_end(stats: StatsRecorder, pids: list[tuple[int, int | None]]) -> None:
    """The epoch ended: read each process worker's memory from here (``(worker id, pid)``; it
    is idle now, and its own measures, at most four times a second, may miss the end of a
    short epoch)."""
    for worker_id, pid in pids:
        if pid is not None and stats.memory_first[worker_id] >= 0:
            stats.worker_memory(worker_id, anon_bytes(f"/proc/{pid}/smaps_rollup"))


def _key_length(key: Any) -> int:
    """How many samples a batch key names (1 for a single key)."""
    try:
        return max(len(key), 1)
    except TypeError:
        return 1
