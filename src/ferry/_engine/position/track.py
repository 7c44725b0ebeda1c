"""The epoch's position and its one owner, :class:`EpochTrack`.

The track is where the position moves (:meth:`EpochTrack.delivered`, once per batch handed to
the user), where a state is taken (:meth:`EpochTrack.save`) and where the next epoch begins
(:meth:`EpochTrack.next_epoch`); it outlives its iterator, so the loader can answer
``state_dict()`` after the epoch, and it holds no worker. With workers, where each stands
after the batches it made and the user has not received yet is the track's too
(:class:`InFlight`, ``track.flight``): the worker engine records each batch's report there and
asks it where a replaced worker starts. What a :class:`Delivery` carries is what an engine
hands the base iterator for each batch. See ``docs/design/state.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from ferry._core.rng import generator_state
from ferry._engine.failures import SkipBudget
from ferry._engine.plan import EpochPlan
from ferry._engine.position.cursor import Cursor, RunCounts, WorkerCursor, global_rng_fingerprint
from ferry._engine.position.keeper import WorkerReport
from ferry._engine.position.keys import EpochKeys, between_epochs, draws_from_global
from ferry._engine.work.fetch import Outcome
from ferry.errors import EpochReplayWarning, warn_from_user_code

__all__ = [
    "Delivery",
    "EpochTrack",
    "InFlight",
    "Moved",
    "between_epochs_cursor",
    "guard_replay",
]


class Delivery(NamedTuple):
    """A batch an engine hands out, and where it came from: key ``number`` of the epoch, made by
    ``worker_id`` (0 in the main process), which then stood at ``worker``. With
    ``on_error="skip"``, ``outcome`` says which samples were dropped, and ``batch`` is
    :data:`~ferry._engine.work.fetch.DROPPED` when all of them were."""

    batch: Any
    number: int
    worker_id: int
    worker: WorkerCursor | None
    outcome: Outcome | None = None


class InFlight:
    """Where each worker stands after the last batch it made (the user may not have it yet),
    for one epoch's tasks: what a batch's report resolves against, and where a worker started
    in a dead one's place begins. Delivery moves the track's own positions
    (:meth:`EpochTrack.delivered`); this moves as batches arrive."""

    def __init__(self, workers: list[WorkerCursor], replays: bool) -> None:
        self.latest = list(workers)
        # Resumed workers fetch again the keys fetched since their snapshot: each batch made
        # with no snapshot adds its key to the position (see WorkerCursor.since).
        self.replays = replays
        self.replaced: set[int] = set()  # workers started in a dead one's place this epoch

    def began(self, worker_id: int, states: Any) -> WorkerCursor | None:
        """Worker ``worker_id`` said what its user states are as its epoch begins, before any
        batch of it: that is its position (None: a worker started in a dead one's place starts
        at the dead one's, and keeps it)."""
        if worker_id in self.replaced:
            return None
        began = WorkerCursor(0, self.latest[worker_id].rng, states)
        self.latest[worker_id] = began
        return began

    def made(self, worker_id: int, index: int, report: WorkerReport | None) -> WorkerCursor:
        """Worker ``worker_id`` made batch ``index`` and reported ``report``: where it stands
        after it (what the batch's delivery will move the track to)."""
        latest = self.latest[worker_id]
        if report is not None:
            latest = report.resolve(latest)
        if self.replays and (report is None or report.snapshot is None):
            latest = latest.fetched(index)
        self.latest[worker_id] = latest
        return latest

    def restart(self, worker_id: int) -> WorkerCursor | None:
        """Worker ``worker_id`` died: where the worker started in its place begins (None: a
        fresh start), at the position after the last batch it sent."""
        self.replaced.add(worker_id)
        position = self.latest[worker_id]
        return None if position == WorkerCursor() else position


class Moved(NamedTuple):
    """``num_workers="auto"`` moved an epoch to thread workers: why (a sentence for
    ``stats().tuning``), and whether for the workers' memory (else their reads waited)."""

    why: str
    for_memory: bool


class EpochTrack:
    """The one owner of an epoch's position, as its loader sees it.

    The position moves in one place, :meth:`delivered`, when the user gets a batch;
    :meth:`save` says where to start again from there. The loader keeps the track of its last
    iterator, which holds no workers, so ``loader.state_dict()`` answers after that iterator is
    gone (a finished ``for`` loop drops it).
    """

    def __init__(
        self, plan: EpochPlan, keys: EpochKeys, cursor: Cursor, budget: SkipBudget | None = None
    ) -> None:
        self.budget = budget if budget is not None else SkipBudget(None)
        self.renew(plan, keys, cursor)

    def renew(self, plan: EpochPlan, keys: EpochKeys, cursor: Cursor) -> None:
        """Start tracking the epoch ``cursor`` opens (its skip budget goes on if the cursor's
        counts are the budget's)."""
        self.plan = plan
        self.keys = keys
        # The cursor's fixed part, and its moving parts kept as plain mutable fields: the
        # position moves once per batch, and this is on every batch's path.
        self._fixed = cursor
        self.next_key = cursor.position  # every key below it was handed out
        self.ahead: set[int] = set(cursor.ahead)
        self.turn = cursor.turn
        self.workers = list(cursor.workers)
        # The main process's position read when asked (num_workers=0), instead of reports.
        self.live: Callable[[], WorkerCursor] | None = None
        self.loaded: Cursor | None = None  # the cursor this epoch was resumed from
        self.yielded = 0  # batches handed out by this iterator in this epoch
        self.finished = False  # StopIteration was raised
        # What num_workers="auto" changed within the epoch, and why (None: nothing).
        self.switched: Moved | None = None
        # num_workers="auto" judged the process workers' reads to compute (they stay): the
        # loader's next epochs do not hold workers back for a first look (see HeldWorkers).
        self.reads_compute = False
        # The workers' positions as their batches arrive (the worker engine: open_flight).
        self.flight = InFlight([], False)
        # on_error="skip": the samples dropped so far in the run (counts are in the cursor).
        run = cursor.run
        if (self.budget.skipped, self.budget.seen) != (run.skipped, run.seen):
            self.budget = SkipBudget(None, run.skipped, run.seen)
        self.budget.max_errors = plan.failures.max_errors  # (the loader's may have changed)

    def open_flight(self, replays: bool) -> InFlight:
        """The epoch's tasks begin (or begin again, with no task of the old ones left): each
        worker stands where the track has it."""
        self.flight = InFlight(self.workers, replays)
        return self.flight

    def worker_began(self, worker_id: int, states: Any) -> None:
        """Worker ``worker_id`` said its user states as its epoch begins (see InFlight.began):
        in flight and delivered, that is where it stands."""
        began = self.flight.began(worker_id, states)
        if began is not None:
            self.workers[worker_id] = began

    def moved_to(self, plan: EpochPlan, why: str, for_memory: bool = False) -> None:
        """``num_workers="auto"`` moved the epoch to other workers (``plan``), for ``why`` (the
        workers' memory, or their reads that wait); no worker's position moves (only a dataset
        with no state of its own moves)."""
        self.plan = plan
        self.switched = Moved(why, for_memory)

    def resumed_from(self, cursor: Cursor | None) -> None:
        """This epoch was resumed from ``cursor`` (None: it was not): saved as it is until a
        batch moves the position."""
        self.loaded = cursor

    def after_ended(self, ended: tuple[WorkerCursor, ...]) -> None:
        """Persistent workers of a stream resumed after an epoch that had ended: each reads
        its ended epoch's stream (its position there, ``ended``) to its end first, as the
        uninterrupted run's workers had (see WorkerCursor.ended)."""
        if len(ended) == len(self.workers):
            self.workers = [
                now if then == WorkerCursor() else replace(now, ended=then)
                for now, then in zip(self.workers, ended, strict=True)
            ]

    def read_live(self, live: Callable[[], WorkerCursor]) -> None:
        """The main process's position is read when a state is asked for (``live()``, no
        worker: no report per batch)."""
        self.live = live

    def handed(self, number: int, worker_id: int, worker: WorkerCursor | None) -> None:
        """Batch ``number`` was handed to the user (see :meth:`delivered`)."""
        self.delivered(number, worker_id, worker)
        self.yielded += 1

    def ended(self) -> None:
        """The epoch ended (StopIteration was raised)."""
        self.finished = True

    def delivered(self, number: int, worker_id: int, worker: WorkerCursor | None) -> None:
        """Batch ``number`` is consumed (made by ``worker_id``, which then stood at ``worker``):
        the user has it, or it was dropped whole (``on_error="skip"``). The one place the
        position moves."""
        ahead = self.ahead
        if number == self.next_key:
            number += 1
            while number in ahead:
                ahead.discard(number)
                number += 1
            self.next_key = number
        else:
            ahead.add(number)
        if worker is not None:
            self.workers[worker_id] = worker
        count = self._fixed.num_workers
        self.turn = (worker_id + 1) % count if count else 0

    def save(self) -> Cursor:
        """Where to start again after the last batch handed to the user (see :mod:`.cursor`).

        Nothing handed out since a load: the cursor loaded. After ``StopIteration``: the next
        epoch, from the generators as they stand. Otherwise the epoch under way, also when its
        last batch was handed out (a resumed iterator then ends that epoch without a batch,
        and the next ``iter()`` begins the next one, as torchdata's loader does).
        """
        if self.loaded is not None and self.yielded == 0 and not self.finished:
            return self.loaded
        # (a state keeps the current epoch's fingerprint: resumed, the epoch may still end)
        current = replace(
            self._current(self.run_counts(keep_open=True)), keys=self.keys.cursor_at(self.next_key)
        )
        if not self.finished:
            return current
        plan = self.plan
        # (the next epoch's draws from torch's global RNG are made from it as it stands now)
        draws = plan.generator is None and draws_from_global(plan, not plan.persistent_workers)
        return replace(current, finished=True, global_rng=global_rng_state() if draws else None)

    def next_epoch(self) -> Cursor:
        """The cursor that begins the next epoch from here, with the generators as they stand."""
        # (a resume that went through an ended epoch found the keys its workers fetch again)
        current = self._current(self.run_counts())
        return current.next_epoch(self.plan.persistent_workers, self.keys.recovered)

    def _current(self, run: RunCounts) -> Cursor:
        return replace(
            self._fixed,
            position=self.next_key,
            ahead=frozenset(self.ahead),
            turn=self.turn,
            workers=(self.live(),) if self.live is not None else tuple(self.workers),
            run=run,
        )

    def run_counts(self, keep_open: bool = False) -> RunCounts:
        """What spans the run, as it stands now, carried to the next epoch: an epoch that was
        left before its end leaves no fingerprint for a later one to repeat (``keep_open``:
        it does, for a state taken during it)."""
        run = self._fixed.run
        if not (keep_open or self.finished):
            run = run.left_unfinished()
        return replace(run, skipped=self.budget.skipped, seen=self.budget.seen, opened=None)


def between_epochs_cursor(
    after: Cursor, generator: Any, sampler: Any, batch_sampler: Any
) -> Cursor:
    """``after`` (a cursor that starts no epoch) with the generators as they stand now: the
    loader's and the sampler's, restored before the next epoch draws from them."""
    own = generator if isinstance(generator, torch.Generator) else None
    # A loader without a generator draws the next epoch's seeds from torch's global RNG: as it
    # stands now, when it does (workers, or a sampler without a generator of its own).
    draws = generator is None and (
        after.num_workers > 0 or getattr(sampler, "generator", False) is None
    )
    return replace(
        after,
        generator=generator_state(own) if own is not None else None,
        keys=between_epochs(sampler, batch_sampler),
        global_rng=global_rng_state() if draws else None,
    )


def global_rng_state() -> str:
    """torch's global CPU generator's state as it stands now, as a string."""
    return generator_state(torch.default_generator)


def guard_replay(run: RunCounts, state: torch.Tensor | None = None) -> RunCounts:
    """Note where torch's global RNG stands as an epoch that draws from it begins (or
    ``state``, a copy of it the epoch draws from), and warn if an earlier epoch began there:
    this one would repeat it (its shuffle and worker seeds)."""
    fingerprint = global_rng_fingerprint(state)
    if fingerprint in run.epoch_starts:
        warn_from_user_code(
            "DataLoader: this epoch begins with torch's global random generator exactly where "
            "it stood when an earlier epoch began, so it repeats that epoch's shuffle and "
            "worker seeds (and random augmentations). This happens when a resumed run seeds "
            "the global RNG as the first run did (seed_everything, torch.manual_seed) without "
            "restoring it: the loader's state restores its own position, not torch's global "
            "RNG. Pass generator=torch.Generator().manual_seed(seed) to the DataLoader (its "
            "state then covers every later epoch), or save torch.get_rng_state() with the "
            "checkpoint and restore it with torch.set_rng_state().",
            EpochReplayWarning,
        )
    return run.with_start(fingerprint)
