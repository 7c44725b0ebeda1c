"""What ``iter(loader)`` returns: the common part of every engine, and the inline engine.

:class:`LoaderIterator` owns what does not depend on where batches are made: the epoch's keys
(from the sampler), the workers' base seed, the cursor (the position, written where a batch is
handed to the user), counting and the length check for iterable datasets, and pinning. An
engine supplies ``_next_batch()``.

Every epoch begins from a :class:`~ferry._engine.cursor.Cursor`: a fresh one is the zero
cursor, a resumed one is the cursor a state was loaded from. The order of random draws
matches torch: the sampler is asked for its iterator first, then the base seed is drawn from
the loader's generator (or torch's global RNG), and a shuffling sampler draws its own seed
only when the first batch is asked for. A resumed epoch redraws nothing from torch's global RNG
(the state holds what was drawn) and restores the generators it owns.

Iterators work from an :class:`~ferry._engine.plan.EpochPlan` and hold no reference to their
loader (see that module for why).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from time import perf_counter
from typing import Any, NamedTuple

import torch

from ferry._engine.alloc import using_allocator
from ferry._engine.cursor import Cursor, Snapshot, WorkerCursor
from ferry._engine.failures import SkipBudget
from ferry._engine.fetch import (
    DROPPED,
    BatchDropped,
    IterableFetcher,
    MapFetcher,
    Outcome,
    make_fetcher,
    one_call_gather,
)
from ferry._engine.keys import EpochKeys, KeysCursor, between_epochs, restore_between_epochs
from ferry._engine.pin import PinJob, pin_batch
from ferry._engine.plan import EpochPlan
from ferry._engine.position import PositionKeeper
from ferry._engine.rng import generator_state, set_generator_state
from ferry.errors import TooManyErrors
from ferry.stats import StatsRecorder

__all__ = [
    "Delivery",
    "EpochTrack",
    "InlineIterator",
    "LoaderIterator",
    "between_epochs_cursor",
    "next_epoch_start",
]


class Delivery(NamedTuple):
    """A batch an engine hands out, and where it came from: key ``number`` of the epoch, made by
    ``worker_id`` (0 in the main process), which then stood at ``worker``. With
    ``on_error="skip"``, ``outcome`` says which samples were dropped, and ``batch`` is
    :data:`~ferry._engine.fetch.DROPPED` when all of them were."""

    batch: Any
    number: int
    worker_id: int
    worker: WorkerCursor | None
    outcome: Outcome | None = None


class EpochTrack:
    """An iterator's epoch as its loader sees it: the cursor and what it is computed from.

    The loader keeps the track of its last iterator, which holds no workers, so
    ``loader.state_dict()`` answers after that iterator is gone (a finished ``for`` loop drops
    it).
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
        self.position_ = cursor.position
        self.ahead: set[int] = set(cursor.ahead)
        self.turn = cursor.turn
        self.workers = list(cursor.workers)
        self.loaded: Cursor | None = None  # the cursor this epoch was resumed from
        self.yielded = 0  # batches handed out by this iterator in this epoch
        self.finished = False  # StopIteration was raised
        # Where the epoch's time goes (ferry.stats), kept beside the cursor.
        self.stats = StatsRecorder(max(plan.num_workers, 1))
        # on_error="skip": the samples dropped so far in the run (counts are in the cursor).
        if (self.budget.skipped, self.budget.seen) != (cursor.skipped, cursor.seen):
            self.budget = SkipBudget(None, cursor.skipped, cursor.seen)
        self.budget.max_errors = plan.failures.max_errors  # (the loader's may have changed)

    def delivered(self, number: int, worker_id: int, worker: WorkerCursor | None) -> None:
        """The user now has batch ``number`` (made by ``worker_id``, which then stood at
        ``worker``): the one place the position moves."""
        ahead = self.ahead
        if number == self.position_:
            number += 1
            while number in ahead:
                ahead.discard(number)
                number += 1
            self.position_ = number
        else:
            ahead.add(number)
        if worker is not None:
            self.workers[worker_id] = worker
        count = self._fixed.num_workers
        self.turn = (worker_id + 1) % count if count else 0

    @property
    def cursor(self) -> Cursor:
        """The position after the last batch handed out (its keys part: see :meth:`position`)."""
        return replace(
            self._fixed,
            position=self.position_,
            ahead=frozenset(self.ahead),
            turn=self.turn,
            workers=tuple(self.workers),
            skipped=self.budget.skipped,
            seen=self.budget.seen,
        )

    def position(self) -> Cursor:
        """The position after the last batch handed to the user (see :mod:`.cursor`)."""
        if self.loaded is not None and self.yielded == 0 and not self.finished:
            return self.loaded  # nothing handed out since the load: the state loaded
        plan = self.plan
        cursor = self.cursor
        if self.finished or (not self.ahead and self.keys.ended_at(self.position_)):
            return between_epochs_cursor(
                next_epoch_start(cursor, plan.persistent_workers),
                plan.generator,
                plan.sampler,
                plan.batch_sampler,
            )
        return replace(cursor, keys=self.keys.cursor_at(cursor.position))


def between_epochs_cursor(
    after: Cursor, generator: Any, sampler: Any, batch_sampler: Any
) -> Cursor:
    """``after`` (a cursor that starts no epoch) with the generators as they stand now: the
    loader's and the sampler's, restored before the next epoch draws from them."""
    generator = generator if isinstance(generator, torch.Generator) else None
    return replace(
        after,
        generator=generator_state(generator) if generator is not None else None,
        keys=between_epochs(sampler, batch_sampler),
    )


def next_epoch_start(finished: Cursor, persistent: bool) -> Cursor:
    """The cursor of the epoch after one that is over, drawing from the generators as they
    stand; persistent workers keep their base seed and their generators."""
    return Cursor(
        started=False,
        base_seed=finished.base_seed if persistent else None,
        num_workers=finished.num_workers,
        workers=finished.workers if persistent else (),
        skipped=finished.skipped,
        seen=finished.seen,
    )


def _option(name: str) -> Any:
    """A read-only attribute answering the epoch plan's ``name``."""
    return property(lambda self: getattr(self._plan, name), doc=f"The loader's ``{name}``.")


class LoaderIterator:
    """Base of the loader's iterators (see the module docstring)."""

    _track: EpochTrack

    # torch's iterators mirror their loader's options in these attributes, which code reads.
    _dataset = _option("dataset")
    _index_sampler = _option("index_sampler")
    _auto_collation = _option("auto_collation")
    _drop_last = _option("drop_last")
    _collate_fn = _option("collate_fn")
    _pin_memory = _option("pin")
    _pin_memory_device = _option("pin_accelerator")  # as torch: "cuda" (...) or None
    _persistent_workers = _option("persistent_workers")
    _prefetch_factor = _option("prefetch_factor")
    _worker_init_fn = _option("worker_init_fn")

    @property
    def _dataset_kind(self) -> int:
        """0 for a map-style dataset, 1 for an iterable-style one (torch's ``_DatasetKind``)."""
        return 1 if self._iterable_style else 0

    def __init__(
        self, plan: EpochPlan, resume: Cursor | None = None, budget: SkipBudget | None = None
    ) -> None:
        self._plan = plan
        self._iterable_style = plan.iterable_style
        self._gathers = (
            one_call_gather(plan.dataset, plan.auto_collation, plan.collate_fn) is not None
        )
        # The skip budget spans the run: a fresh epoch goes on with the last iterator's.
        start = resume if resume is not None else Cursor.zero()
        if resume is None and budget is not None:
            start = replace(start, skipped=budget.skipped, seen=budget.seen)
        self._carried_budget = budget
        self._open_epoch(start)
        self._track.loaded = resume

    # -- the epoch and its cursor --------------------------------------------------------------

    def _open_epoch(self, start: Cursor) -> None:
        """Begin the epoch ``start`` describes: its keys, its base seed, its cursor.

        A map-style epoch resumed at its very end (every batch handed out, ``StopIteration``
        not yet seen) is over: the next epoch begins instead, in full, as it would have
        (not for a :class:`~ferry.DistributedSampler`, whose epochs the user begins).
        """
        plan = self._plan
        generator = plan.generator if isinstance(plan.generator, torch.Generator) else None
        while True:
            keys_cursor: KeysCursor | None = start.keys
            if not start.started:
                # Between epochs: the generators as they stood, then a fresh epoch from them.
                restore_between_epochs(plan.sampler, plan.batch_sampler, start.keys)
                if start.keys.kind != "stateful" or start.keys.snapshot is None:
                    keys_cursor = None
            if start.generator is not None and generator is not None:
                set_generator_state(generator, start.generator)
            position = start.position if start.started else 0
            ahead = start.ahead if start.started else frozenset()
            keys = EpochKeys(
                plan,
                self._gathers,
                cursor=keys_cursor,
                position=position,
                exclude=ahead,
                snapshot_every=plan.snapshot_every,
            )
            if start.started:
                assert start.base_seed is not None
                base_seed = start.base_seed
            elif start.base_seed is not None and plan.persistent_workers:
                base_seed = start.base_seed  # persistent workers keep their seed across epochs
            else:
                base_seed = int(
                    torch.empty((), dtype=torch.int64).random_(generator=plan.generator).item()
                )
            if start.started and position and not plan.iterable_style and keys.resumed_past_end():
                start = next_epoch_start(start, plan.persistent_workers)
                continue
            break
        self._base_seed = base_seed
        self._length_warned = False
        workers = max(plan.num_workers, 1)
        cursor = Cursor(
            started=True,
            base_seed=base_seed,
            generator=generator_state(generator) if generator is not None else None,
            keys=KeysCursor(keys.kind),
            position=position,
            ahead=ahead,
            turn=start.turn % workers if start.started else 0,
            num_workers=plan.num_workers,
            workers=self._resumed_workers(start),
            skipped=start.skipped,
            seen=start.seen,
        )
        if getattr(self, "_track", None) is None:
            self._track = EpochTrack(plan, keys, cursor, self._carried_budget)
        else:  # the loader holds this track: renew it in place
            self._track.renew(plan, keys, cursor)

    def _resumed_workers(self, start: Cursor) -> tuple[WorkerCursor, ...]:
        """Each worker's position as the epoch opens; what of ``start`` cannot apply to this
        loader's workers is dropped (see :meth:`worker_resume`)."""
        count = max(self._plan.num_workers, 1)
        if start.num_workers == self._plan.num_workers and len(start.workers) == count:
            if start.started:
                return start.workers
            # Between epochs only the generators carry over (persistent workers).
            return tuple(WorkerCursor(0, w.rng, Snapshot()) for w in start.workers)
        return tuple(WorkerCursor() for _ in range(count))

    def worker_resume(self, worker_id: int) -> WorkerCursor | None:
        """Where worker ``worker_id`` starts: None for a fresh start."""
        worker = self._track.workers[worker_id]
        return None if worker == WorkerCursor() else worker

    # -- iteration -----------------------------------------------------------------------------

    def __iter__(self) -> LoaderIterator:
        return self

    def __len__(self) -> int:
        # As torch: the length of the index sampler (an endless one for a stream: TypeError).
        return len(self._plan.index_sampler)

    def __next__(self) -> Any:
        track = self._track
        asked = perf_counter()
        while True:
            try:
                batch, number, worker_id, worker, outcome = delivery = self._next_batch()
            except StopIteration:
                if not self._resumed_at_stream_end():
                    track.finished = True
                    track.stats.ended = perf_counter()
                    track.stats.wait += track.stats.ended - asked
                    raise
                track = self._track  # the next epoch's
                batch, number, worker_id, worker, outcome = delivery = self._next_batch()
            if outcome is None:
                break
            self._count_skips(track, delivery)
            if batch is not DROPPED:
                break
        stats = track.stats
        got = perf_counter()
        stats.wait += got - asked
        if not stats.batches:
            stats.first_batch, stats.first_wait = got - stats.started, got - asked
        stats.batches += 1
        # The one place the position moves: the batch is now the user's.
        track.delivered(number, worker_id, worker)
        track.yielded += 1
        # Only a len() asked before the epoch began counts (list(loader) asks one after).
        reported = self._plan.reported_length
        if reported is not None and track.yielded > reported and not self._length_warned:
            self._length_warned = True
            warnings.warn(
                f"Length of IterableDataset {type(self._plan.dataset).__name__} was reported to "
                f"be {reported} (when accessing len(dataloader)), but {track.yielded} samples "
                f"have been fetched: this DataLoader has now yielded {track.yielded} batches, "
                f"more than len(dataset) = {reported}."
                + (
                    " For multiprocessing data-loading, this could be caused by not properly "
                    "configuring the IterableDataset replica at each worker: each of the "
                    f"{self._plan.num_workers} workers runs its own copy of the stream, so "
                    "each must read only its own share of it (see ferry.get_worker_info)."
                    if self._plan.num_workers > 0
                    else ""
                ),
                UserWarning,
                stacklevel=2,
            )
        if isinstance(batch, PinJob):  # pinned in the background since it arrived
            batch = self._take_pinned(batch, number)
            stats.pin += perf_counter() - got
        elif self._plan.pin:
            batch = pin_batch(batch, self._plan.pin_memory_device)
            stats.pin += perf_counter() - got
        return batch

    def _next_batch(self) -> Delivery:
        raise NotImplementedError

    def _take_pinned(self, job: PinJob, number: int) -> Any:
        """Batch ``number``, which an engine handed out as a job of its pin thread."""
        return job.take()

    @staticmethod
    def _count_skips(track: EpochTrack, delivery: Delivery) -> None:
        """Add a batch's dropped samples to the run's budget. A batch with no sample left is
        consumed here (the position moves past it; nothing is handed out), and so is one that
        takes the run past its budget: a resume does not fetch either again."""
        assert delivery.outcome is not None
        seen, dropped = delivery.outcome
        track.stats.skipped += len(dropped)
        try:
            track.budget.add(seen, dropped)
        except TooManyErrors:
            track.delivered(delivery.number, delivery.worker_id, delivery.worker)
            raise
        if delivery.batch is DROPPED:
            track.delivered(delivery.number, delivery.worker_id, delivery.worker)

    def _resumed_at_stream_end(self) -> bool:
        """Whether this epoch was resumed at the very end of a stream and has now begun the
        next epoch instead (then the next ``_next_batch`` is that epoch's first)."""
        track = self._track
        loaded = track.loaded
        if not (
            self._iterable_style
            and loaded is not None
            and loaded.started
            and loaded.position
            and track.yielded == 0
        ):
            return False
        self._open_epoch(next_epoch_start(track.cursor, self._plan.persistent_workers))
        self._reopen()
        return True

    def _reopen(self) -> None:
        """Open the streams of the epoch just begun (after a resume found a stream's end)."""
        raise NotImplementedError

    @property
    def _num_yielded(self) -> int:
        """Batches of the current epoch handed out, as torch's iterators count them (code
        reads it to know where an epoch is); a resumed epoch counts those before the resume."""
        track = self._track
        loaded = track.loaded
        before = 0 if loaded is None else loaded.position + len(loaded.ahead)
        return before + track.yielded

    def _shutdown_workers(self) -> None:
        """Stop this iterator's workers now, if it has any (it yields nothing after)."""

    def _restart(self, plan: EpochPlan) -> None:
        """Begin the next epoch on the same iterator (persistent workers)."""
        raise NotImplementedError(f"{type(self).__name__} does not outlive its epoch")

    def __getstate__(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} holds a live epoch (and maybe workers) and cannot be pickled"
        )


class InlineIterator(LoaderIterator):
    """``num_workers=0``: every batch is fetched in the caller's thread."""

    _num_workers = 0
    _timeout = _option("timeout")

    def __init__(
        self, plan: EpochPlan, resume: Cursor | None = None, budget: SkipBudget | None = None
    ) -> None:
        if plan.timeout > 0:
            raise AssertionError(
                "loading in the main process (num_workers=0) requires timeout == 0: timeout is "
                f"how long to wait for a worker, got timeout={plan.timeout}; set num_workers > 0 "
                "or leave timeout at 0"
            )
        super().__init__(plan, resume, budget)
        self._skip = plan.failures.skip
        self._allocator = plan.buffer_pool
        # Made after the base seed is drawn: an iterable dataset's stream opens here, as in
        # torch, so its __iter__ (and any random draw in it) runs at iter(loader). The main
        # process's generators are the user's: they are neither reported nor restored.
        self._keeper = PositionKeeper(plan.dataset, plan.snapshot_every, track_rng=False)
        self._fetcher: MapFetcher | IterableFetcher = self._keeper.open(
            self._make_fetcher, self.worker_resume(0)
        )

    def _make_fetcher(self) -> MapFetcher | IterableFetcher:
        plan = self._plan
        return make_fetcher(
            plan.dataset,
            plan.iterable_style,
            plan.auto_collation,
            plan.collate_fn,
            plan.drop_last,
            skip_as=0 if self._skip else None,
        )

    def _reopen(self) -> None:
        self._fetcher = self._keeper.open(self._make_fetcher, None)

    def _next_batch(self) -> Delivery:
        stats = self._track.stats
        start = perf_counter()
        number, key = next(self._track.keys)
        stats.sampler += perf_counter() - start
        fetcher = self._fetcher
        try:
            with using_allocator(self._allocator):
                batch = fetcher.fetch(key)
        except BatchDropped:  # on_error="skip", and every sample of the batch failed
            batch = DROPPED
        stats.waited += 1  # made on demand: never ready before it is asked
        stats.fetch += fetcher.fetch_s
        stats.collate += fetcher.collate_s
        outcome = fetcher.outcome if self._skip else None
        keeper = self._keeper
        report = keeper.after_batch(fetcher) if keeper.reports else None
        if report is None:
            return Delivery(batch, number, 0, None, outcome)
        return Delivery(batch, number, 0, report.resolve(self._track.workers[0]), outcome)
