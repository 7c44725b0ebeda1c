"""What ``iter(loader)`` returns: the common part of every engine, and the inline engine.

:class:`LoaderIterator` owns what does not depend on where batches are made: the epoch's keys
(from the sampler), the workers' base seed, the epoch's track (the position, moved where a
batch is handed to the user) and its statistics recorder, counting and the length check for
iterable datasets, and pinning. An engine supplies ``_next_batch()``.

Every epoch begins from a :class:`~ferry._engine.position.cursor.Cursor`: a fresh one is the zero
cursor, a resumed one is the cursor a state was loaded from. The order of random draws
matches torch: the sampler is asked for its iterator first, then the base seed is drawn from
the loader's generator (or torch's global RNG), and a shuffling sampler draws its own seed
only when the first batch is asked for. A resumed epoch redraws nothing from torch's global RNG
(the state holds what was drawn) and restores the generators it owns.

Iterators work from an :class:`~ferry._engine.plan.EpochPlan` and hold no reference to their
loader (see that module for why).
"""

from __future__ import annotations

import hashlib
import warnings
import weakref
from dataclasses import replace
from typing import Any

import torch

from ferry._batching import batch_count
from ferry._core.rng import generator_from_state, generator_state, set_generator_state
from ferry._core.stateful import has_state_methods
from ferry._engine.failures import SkipBudget
from ferry._engine.plan import EpochPlan
from ferry._engine.position.cursor import (
    Cursor,
    RunCounts,
    WorkerCursor,
    run_numbers,
)
from ferry._engine.position.keeper import PositionKeeper
from ferry._engine.position.keys import (
    EpochKeys,
    KeysCursor,
    builtin_source,
    draws_from_global,
    restore_between_epochs,
)
from ferry._engine.position.track import Delivery, EpochTrack, guard_replay
from ferry._engine.transport.pin import pin_batch
from ferry._engine.work.aio import AsyncReads, is_async_dataset
from ferry._engine.work.fetch import (
    DROPPED,
    IterableFetcher,
    MapFetcher,
    make_batch,
    make_fetcher,
    one_call_gather,
)
from ferry._torch_types import TorchLoaderIterator
from ferry.errors import TooManyErrors
from ferry.stats import StatsRecorder

__all__ = ["InlineIterator", "IteratorOver", "LoaderIterator"]


def _option(name: str) -> Any:
    """A read-only attribute answering the epoch plan's ``name``."""
    return property(lambda self: getattr(self._plan, name), doc=f"The loader's ``{name}``.")


class IteratorOver(StopIteration):
    """From ``_next_batch``: an error that ended this iterator was raised already; this
    ``next()`` says it is over without ending the epoch (its position stays where the error
    found it)."""


class LoaderIterator(TorchLoaderIterator):
    """Base of the loader's iterators (see the module docstring).

    A subclass of torch's ``_BaseDataLoaderIter`` for the type only (Lightning's
    ``CombinedLoader`` tells loader iterators apart by it): every method of that class is
    defined here again, so none of torch's code runs on a ferry iterator.
    """

    _track: EpochTrack
    _stats: StatsRecorder
    _base_seed: int

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
    def stopped_by_error(self) -> bool:
        """Whether an error ended this iterator and stopped its workers (a kept, persistent
        iterator then cannot begin another epoch: the loader makes a new one)."""
        return False

    @property
    def _dataset_kind(self) -> int:  # type: ignore[override]
        """0 for a map-style dataset, 1 for an iterable-style one (torch's ``_DatasetKind``)."""
        return 1 if self._iterable_style else 0

    def __init__(
        self,
        plan: EpochPlan,
        resume: Cursor | None = None,
        budget: SkipBudget | None = None,
        run: RunCounts | None = None,
        *,
        base_seed: int | None = None,
    ) -> None:
        """``base_seed``: a fresh epoch's workers take it instead of drawing one (persistent
        workers an error stopped, replaced: as torch's, they keep their seed)."""
        self._plan = plan
        self._iterable_style = plan.iterable_style
        self._gathers = (
            one_call_gather(plan.dataset, plan.auto_collation, plan.collate_fn) is not None
        )
        # The skip budget spans the run: a fresh epoch goes on with the last iterator's.
        start = resume if resume is not None else Cursor.zero()
        if resume is None and budget is not None:
            start = replace(start, run=replace(start.run, skipped=budget.skipped, seen=budget.seen))
        if resume is None and run is not None:
            start = replace(start, run=replace(start.run, epoch_starts=run.epoch_starts))
        if resume is None and base_seed is not None:
            start = replace(start, base_seed=base_seed, seed_drawn=False)
        self._carried_budget = budget
        if resume is not None and not start.started:
            self._at_save_point(start)  # between epochs: the state came before the draws
        if start.finished:
            # The saved epoch had ended: go through it (its keys are drawn and skipped, as
            # torchdata's loader does with a finished iterator), then begin the next one. Its
            # draws from torch's global RNG were made before the state was taken, so they are
            # made on a copy: the next epoch draws from the global RNG as it stood at the save
            # (as the uninterrupted run's next epoch does, when the global RNG was restored
            # with the checkpoint or never left the process).
            global_rng = torch.get_rng_state()
            try:
                self._open_epoch(start)
                self._track.keys.exhausted()
            finally:
                torch.set_rng_state(global_rng)
            self._at_save_point(start)
            self._open_epoch(replace(self._track.next_epoch(), global_rng=start.global_rng))
            if plan.persistent_workers and plan.iterable_style:
                # Persistent workers read the ended epoch's streams to their ends first, as
                # the uninterrupted run's had (see WorkerCursor.ended).
                self._track.after_ended(start.workers)
        else:
            self._open_epoch(start)
            if resume is not None and start.started:
                self._at_save_point(start)
        self._track.resumed_from(resume)

    def _at_save_point(self, start: Cursor) -> None:
        """A resume has made the draws the interrupted run made before its state was taken
        (``start``): the engine may now restore what was saved after them (the inline engine:
        the main process's dataset, whose state may hold torch's global RNG)."""

    # -- the epoch and its cursor --------------------------------------------------------------

    def _open_epoch(self, start: Cursor) -> None:
        """Begin the epoch ``start`` describes: its keys, its base seed, its position.

        A resumed epoch draws what a fresh one draws, in torch's order (the sampler is asked
        for its iterator, then the base seed is drawn): the generators the loader owns are
        restored to where they stood, and a draw from torch's global RNG is made again and
        dropped (the state holds what it gave), so the global RNG stands where a fresh
        iterator leaves it.
        """
        plan = self._plan
        generator = plan.generator if isinstance(plan.generator, torch.Generator) else None
        keys_cursor: KeysCursor | None = start.keys
        run = start.run
        # Draws from torch's global RNG made from a copy of it as the state was taken (see
        # Cursor.global_rng): the base seed drawn from it, if the epoch draws one.
        copied: int | None = None
        if not start.started:
            # Between epochs: the generators as they stood, then a fresh epoch from them.
            restore_between_epochs(plan.sampler, plan.batch_sampler, start.keys)
            if start.keys.stateful_snapshot is None:
                keys_cursor = None
            # (persistent workers keep their base seed: then the seeds draw nothing)
            new_seeds = start.seed_drawn or start.base_seed is None
            copy = None
            if start.global_rng is not None and plan.generator is None:
                copy = generator_from_state(start.global_rng)
            if generator is None and draws_from_global(plan, new_seeds):
                run = guard_replay(run, None if copy is None else copy.get_state())
            if copy is not None:
                if new_seeds:
                    copied = int(torch.empty((), dtype=torch.int64).random_(generator=copy).item())
                source = builtin_source(plan.sampler, plan.batch_sampler)
                if keys_cursor is None and getattr(source, "generator", False) is None:
                    # a built-in sampler without a generator draws next: from the copy too
                    keys_cursor = KeysCursor("builtin", {"global": generator_state(copy)})
        if start.generator is not None and generator is not None:
            set_generator_state(generator, start.generator)
        position = start.position if start.started else 0
        ahead = start.ahead if start.started else frozenset()
        resumed = self._resumed_workers(start)
        keys = EpochKeys(
            plan,
            self._gathers,
            cursor=keys_cursor,
            position=position,
            exclude=ahead,
            snapshot_every=plan.snapshot_every,
            # keys the workers fetched since their snapshots, fetched again (see WorkerCursor)
            recover=frozenset(n for w in resumed for n in run_numbers(w.since) if n < position),
        )
        base_seed = start.base_seed
        seed_drawn = start.seed_drawn or base_seed is None
        # A resumed epoch's own generator already stands after its draw; any other draw is made.
        if seed_drawn and not (start.started and generator is not None):
            drawn = int(torch.empty((), dtype=torch.int64).random_(generator=plan.generator).item())
            if base_seed is None or not start.started:
                base_seed = drawn if copied is None else copied
        if base_seed is None:
            # A resumed epoch saved without workers (no base seed kept: nothing used it) whose
            # draw is not made again: workers of this loader need one, and no RNG is touched.
            digest = hashlib.blake2b(f"{start.generator}:{position}".encode(), digest_size=8)
            base_seed = int.from_bytes(digest.digest(), "little", signed=True)
        self._base_seed = base_seed
        self._length_warned = False
        workers = max(plan.num_workers, 1)
        cursor = Cursor(
            started=True,
            base_seed=base_seed,
            seed_drawn=seed_drawn,
            generator=generator_state(generator) if generator is not None else None,
            keys=KeysCursor(keys.kind),
            position=position,
            ahead=ahead,
            turn=start.turn % workers if start.started else 0,
            num_workers=plan.num_workers,
            workers=resumed,
            run=run,
        )
        if getattr(self, "_track", None) is None:
            self._track = EpochTrack(plan, keys, cursor, self._carried_budget)
            # Where the epoch's time goes (ferry.stats); the loader reads it too.
            self._stats = StatsRecorder(workers)
        else:  # the loader holds this track and these statistics: renewed in place
            self._track.renew(plan, keys, cursor)
            self._stats.restart(workers)

    def _resumed_workers(self, start: Cursor) -> tuple[WorkerCursor, ...]:
        """Each worker's position as the epoch opens; what of ``start`` cannot apply to this
        loader's workers is dropped (see :meth:`worker_resume`)."""
        count = max(self._plan.num_workers, 1)
        if start.num_workers == self._plan.num_workers and len(start.workers) == count:
            return start.workers
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
        return batch_count(self._plan.index_sampler)

    def __next__(self) -> Any:
        track, stats = self._track, self._stats
        asked = stats.asked()
        try:
            delivery = self._next_batch()
            if delivery.outcome is not None:  # on_error="skip" counted samples
                delivery = self._kept(delivery)
        except IteratorOver:
            raise StopIteration from None
        except StopIteration:
            track.ended()
            stats.epoch_ended(asked)
            raise
        stats.handed_out(asked)
        # The one place the position moves: the batch is now the user's.
        track.handed(delivery.number, delivery.worker_id, delivery.worker)
        if self._plan.reported_length is not None:
            self._check_length(track.yielded)
        if not self._plan.pin:
            return delivery.batch
        with stats.timing("pin"):
            return self._pinned(delivery.batch, delivery.number)

    def _kept(self, delivery: Delivery) -> Delivery:
        """With ``on_error="skip"``: count the samples ``delivery`` dropped, and pass over the
        batches whose every sample failed; the next batch with samples left."""
        while True:
            self._count_skips(self._track, self._stats, delivery)
            if delivery.batch is not DROPPED:
                return delivery
            delivery = self._next_batch()
            if delivery.outcome is None:
                return delivery

    def _check_length(self, yielded: int) -> None:
        """torch's warning when a stream yields more batches than ``len(loader)`` said (only
        a len() asked before the epoch began counts: list(loader) asks one after)."""
        reported = self._plan.reported_length
        if reported is None or yielded <= reported or self._length_warned:
            return
        self._length_warned = True
        warnings.warn(
            # torch's first sentence word for word (regexes match it), then ferry's detail;
            # once an epoch, where torch warns again at every further batch.
            f"Length of IterableDataset {self._plan.dataset} was reported to be "
            f"{reported}(when accessing len(dataloader)), but {yielded} samples have been "
            f"fetched. This DataLoader has now yielded {yielded} batches, more than "
            f"len(dataset) = {reported}; it warns once an epoch."
            + (
                " For multiprocessing data-loading, this could be caused by not properly "
                "configuring the IterableDataset replica at each worker: each of the "
                f"{self._plan.num_workers} workers runs its own copy of the stream, so "
                "each must read only its own share of it (see ferry.get_worker_info)."
                if self._plan.num_workers > 0
                else ""
            ),
            UserWarning,
            stacklevel=3,
        )

    def _pinned(self, batch: Any, number: int) -> Any:
        """Batch ``number`` in pinned memory (``pin_memory=True``): pinned here by the inline
        engine; the worker engine's pin thread pinned it as it arrived."""
        return pin_batch(batch, self._plan.pin_memory_device)

    def _next_batch(self) -> Delivery:
        raise NotImplementedError

    @staticmethod
    def _count_skips(track: EpochTrack, stats: StatsRecorder, delivery: Delivery) -> None:
        """Add a batch's dropped samples to the run's budget. A batch with no sample left is
        consumed here (the position moves past it; nothing is handed out), and so is one that
        takes the run past its budget: a resume does not fetch either again."""
        assert delivery.outcome is not None
        seen, dropped = delivery.outcome
        stats.samples_skipped(len(dropped))
        try:
            track.budget.add(seen, dropped)
        except TooManyErrors:
            track.delivered(delivery.number, delivery.worker_id, delivery.worker)
            raise
        if delivery.batch is DROPPED:
            track.delivered(delivery.number, delivery.worker_id, delivery.worker)

    @property
    def _num_yielded(self) -> int:  # type: ignore[override]
        """Batches of the current epoch handed out, as torch's iterators count them (code
        reads it to know where an epoch is); a resumed epoch counts those before the resume."""
        track = self._track
        loaded = track.loaded
        resumed = loaded is not None and loaded.started and not loaded.finished
        before = loaded.position + len(loaded.ahead) if resumed and loaded is not None else 0
        return before + track.yielded

    def _shutdown_workers(self) -> None:
        """Stop this iterator's workers now, if it has any (it yields nothing after)."""

    def _restart(self, plan: EpochPlan) -> None:
        """Begin the next epoch on the same iterator (persistent workers)."""
        raise NotImplementedError(f"{type(self).__name__} does not outlive its epoch")

    # torch's iterator protocol, for code written against ``_BaseDataLoaderIter``.

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        """Begin the next epoch on this iterator with ``loader``'s options as they are now (what
        torch's loader asks of a kept iterator each epoch with persistent workers)."""
        self._restart(loader._plan())

    def _next_data(self) -> Any:
        """The next batch (torch's name for it)."""
        return self.__next__()

    def _next_index(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__}._next_index: ferry's engines draw the epoch's keys "
            "themselves (a key drawn here would be lost to the epoch); iterate the loader's "
            "sampler or batch_sampler to see the keys"
        )

    def __getstate__(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} holds a live epoch (and maybe workers) and cannot be pickled"
        )


class _LiveReader:
    """The main process's position as it stands (``num_workers=0``), read from the epoch's
    keeper and fetcher. The loader keeps its last iterator's track, so a bound method of the
    iterator there would keep the iterator itself, its stream and its event loop, after the
    user dropped it, until the cyclic collector ran; this holds neither."""

    __slots__ = ("fetcher", "keeper")

    def __init__(self, keeper: PositionKeeper, fetcher: MapFetcher | IterableFetcher) -> None:
        self.keeper = keeper
        self.fetcher = fetcher

    def __call__(self) -> WorkerCursor:
        return self.keeper.live(self.fetcher)


class InlineIterator(LoaderIterator):
    """``num_workers=0``: every batch is fetched in the caller's thread."""

    _num_workers = 0
    _timeout = _option("timeout")

    def __init__(
        self,
        plan: EpochPlan,
        resume: Cursor | None = None,
        budget: SkipBudget | None = None,
        run: RunCounts | None = None,
    ) -> None:
        if plan.timeout != 0:  # (as torch: a NaN or a negative one set later fails too)
            raise AssertionError(
                "loading in the main process (num_workers=0) requires timeout == 0: timeout is "
                f"how long to wait for a worker, got timeout={plan.timeout}; set num_workers > 0 "
                "or leave timeout at 0"
            )
        self._keeper = PositionKeeper(plan.dataset, plan.snapshot_every, track_rng=False)
        self._dataset_restored = False  # by _at_save_point, before the fetcher opens
        super().__init__(plan, resume, budget, run)
        self._skip = plan.failures.skip
        self._allocator = plan.buffer_pool
        # Made after the base seed is drawn: an iterable dataset's stream opens here, as in
        # torch, so its __iter__ (and any random draw in it) runs at iter(loader). The main
        # process's generators are the user's: they are neither reported nor restored.
        self._reads: AsyncReads | None = None  # an async dataset's event loop (aio.py)
        first = self.worker_resume(0)
        if first is not None and self._dataset_restored:
            first = replace(first, snapshot=replace(first.snapshot, dataset=None))
        self._fetcher: MapFetcher | IterableFetcher = self._keeper.open(self._make_fetcher, first)
        # The main process's position is read when the state is asked for, user states
        # included, as torchdata's loader does without workers: no report per batch.
        self._live = _LiveReader(self._keeper, self._fetcher)
        self._track.read_live(self._live)

    def _at_save_point(self, start: Cursor) -> None:
        # A map-style dataset's own state is restored where the interrupted run took it: after
        # the epoch's draws (its base seed, and the sampler's fast-forward past the keys handed
        # out, made now rather than at the first batch), before the next epoch's. torchdata
        # restores it there too, and a dataset whose state holds torch's global RNG depends
        # on it: the draws then come out as in the uninterrupted run.
        dataset = self._plan.dataset
        if self._plan.iterable_style or start.num_workers or len(start.workers) != 1:
            return
        state = start.workers[0].snapshot.dataset
        if state is None or not has_state_methods(dataset):
            return
        if start.started and not start.finished and start.position:
            self._track.keys.exhausted()
        dataset.load_state_dict(state)
        self._dataset_restored = True

    def _restart(self, plan: EpochPlan) -> None:
        """The next epoch on this iterator, as a new iterator of the same loader would begin it
        (torch's ``_reset``; the loader itself makes a new inline iterator each epoch)."""
        if plan.num_workers != 0 or plan.timeout > 0:
            raise ValueError(
                "an iterator made with num_workers=0 cannot go on with workers or a timeout: "
                f"got num_workers={plan.num_workers}, timeout={plan.timeout}; call iter(loader)"
            )
        self._plan = plan
        self._open_epoch(self._track.next_epoch())
        self._fetcher = self._live.fetcher = self._keeper.open(
            self._make_fetcher, self.worker_resume(0)
        )

    def _make_fetcher(self) -> MapFetcher | IterableFetcher:
        plan = self._plan
        self._end_reads()  # (each epoch's fetcher has its own: the loop stops as it ends)
        if not plan.iterable_style and is_async_dataset(plan.dataset):
            self._reads = self._stats.reads = AsyncReads()
            weakref.finalize(self, self._reads.close, 1.0)
        return make_fetcher(
            plan.dataset,
            plan.iterable_style,
            plan.auto_collation,
            plan.collate_fn,
            plan.drop_last,
            skip_as=0 if self._skip else None,
            reads=self._reads,
        )

    def _end_reads(self) -> None:
        """Stop an async dataset's event loop: the epoch ended (else when this iterator is
        collected, which its loader's hold on its track delays until the loader's next
        iterator, or the loader, is)."""
        if self._reads is not None:
            self._reads.close()
            self._reads = None

    def _next_batch(self) -> Delivery:
        stats = self._stats
        try:
            with stats.timing("sampler"):
                number, key = next(self._track.keys)
        except StopIteration:
            self._end_reads()
            raise
        try:
            made = make_batch(self._fetcher, key, self._allocator, self._skip)
        except StopIteration:  # (a map-style dataset's ends the epoch)
            self._end_reads()
            raise
        stats.made_here(made.fetch_s, made.collate_s, made.cpu_s)
        return Delivery(made.batch, number, 0, None, made.outcome)
