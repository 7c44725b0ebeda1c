"""Loading a state into a loader: what it must agree with, and fitting it to the loader.

:class:`Resumer` is the loader's resume side (``state_dict``, ``load_state_dict``, the API of
torchdata's ``StatefulDataLoader``), an object each loader holds.

:func:`identity_of` is what a state is checked against (see
:meth:`ferry._engine.position.cursor.LoaderState.cursor_from_plain`); :func:`warn_replay` says
once that a stream without state will be fast-forwarded by reading.

Fitting a loaded state to a loader with another number of workers:

A map-style dataset has no per-worker position (the keys come from the main process), so a
state resumes with any ``num_workers``: the workers of the new loader start seeded from the
epoch's base seed, the old workers' generators are dropped (which worker made which batch
changes with the count anyway). Only a dataset that keeps a state of its own in each worker
(``state_dict`` on the dataset) ties the state to the count.

An iterable-style dataset's position *is* per worker (each worker reads its own share of the
stream), so another count is refused, unless the dataset declares ``state_per_shard = True``:
then its stream iterator's ``state_dict()`` returns ``{shard name: shard state}`` for the shards
that worker reads, and ``load_state_dict`` takes the states of *all* shards (each worker picks
out its own). The states of all old workers are merged and handed to every new worker.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import replace
from typing import Any

from ferry._core.stateful import has_state_methods
from ferry._engine.failures import SkipBudget
from ferry._engine.position.counted import DatasetPosition, DatasetVerdict, judge_dataset
from ferry._engine.position.cursor import (
    Cursor,
    LoaderIdentity,
    LoaderState,
    RunCounts,
    Snapshot,
    WorkerCursor,
)
from ferry._engine.position.track import EpochTrack, between_epochs_cursor
from ferry.errors import StateMismatch
from ferry.stats import StatsRecorder

__all__ = ["Resumer", "fit_workers", "identity_of", "warn_replay"]


def identity_of(loader: Any) -> LoaderIdentity:
    """What a state taken from ``loader`` (a :class:`ferry.DataLoader`) describes it by."""
    length: int | None = None
    if not loader._iterable_style:
        try:
            length = len(loader.dataset)
        except TypeError:
            length = None
    batch_sampler = loader.batch_sampler
    return LoaderIdentity(
        iterable=loader._iterable_style,
        dataset_length=length,
        batch_size=loader.batch_size,
        drop_last=loader.drop_last,
        sampler=type(loader.sampler).__qualname__,
        batch_sampler=None if batch_sampler is None else type(batch_sampler).__qualname__,
        num_workers=loader.num_workers,
    )


def warn_replay(cursor: Cursor, dataset: Any, iterable: bool) -> bool:
    """Warn if resuming at ``cursor`` reads and drops samples of a stream that has no state;
    whether it warned."""
    if not (iterable and cursor.started):
        return False
    dropped = sum(w.items - w.snapshot.items for w in cursor.workers if w.snapshot.stream is None)
    if not dropped:
        return False
    warnings.warn(
        f"{type(dataset).__name__} gives no state for its stream (its iterator has no "
        "state_dict/load_state_dict), so the resumed loader fast-forwards by reading and "
        f"dropping the {dropped} samples already delivered this epoch. Give the iterator "
        "state_dict()/load_state_dict() to resume without reading them again.",
        UserWarning,
        stacklevel=3,
    )
    return True


def fit_workers(cursor: Cursor, num_workers: int, dataset: Any, iterable: bool) -> Cursor:
    """``cursor`` made to fit a loader with ``num_workers``; :class:`StateMismatch` (a
    ValueError) when it cannot."""
    if cursor.num_workers == num_workers:
        return cursor
    fresh = replace(cursor, num_workers=num_workers, workers=(), turn=0)
    if not cursor.started:
        return fresh
    counts = (
        f"the state was saved with num_workers={cursor.num_workers}, this loader has "
        f"num_workers={num_workers}"
    )
    if not iterable:
        if any(w.snapshot.dataset is not None or w.since for w in cursor.workers):
            raise StateMismatch(
                f"DataLoader state does not fit this loader: {counts}, and "
                f"{type(dataset).__name__} keeps a state of its own in each worker "
                "(state_dict on the dataset), which cannot be split over another number of "
                "workers. Resume with the same num_workers."
            )
        return fresh
    if not any(w.items or w.snapshot != Snapshot() for w in cursor.workers):
        return fresh
    if not getattr(dataset, "state_per_shard", False):
        raise StateMismatch(
            f"DataLoader state does not fit this loader: {counts}. An iterable-style dataset's "
            "position is per worker (each reads its own share of the stream), so resume with "
            "the same num_workers, or give the dataset per-shard state (state_per_shard = "
            "True; see the README's 'Resuming')."
        )
    merged: dict[str, Any] = {}
    for worker_id, worker in enumerate(cursor.workers):
        if worker == WorkerCursor(rng=worker.rng):
            continue  # it handed out nothing: its shards start from their beginning
        states = worker.snapshot.stream
        if worker.items != worker.snapshot.items or not isinstance(states, dict):
            raise StateMismatch(
                f"DataLoader state does not fit this loader: {counts}, and worker {worker_id}'s "
                "stream state is not a per-shard dict taken after its last batch (a dataset "
                "with state_per_shard = True needs snapshot_every_n_steps=1 and a "
                "state_dict() that returns {shard name: state})"
            )
        overlap = merged.keys() & states.keys()
        if overlap:
            raise ValueError(
                f"DataLoader state has shards read by more than one worker: {sorted(overlap)}"
            )
        merged.update(states)
    every = WorkerCursor(0, None, Snapshot(0, None, merged))
    return replace(fresh, workers=tuple(every for _ in range(max(num_workers, 1))))


class Resumer:
    """The resume side of a :class:`ferry.DataLoader`, an object the loader holds.

    It owns what lies between iterators: the state loaded for the next iterator, and the
    :class:`~ferry._engine.position.track.EpochTrack` of the last one (which holds no workers), so
    ``state_dict()`` answers whether an iterator is alive, finished or gone.
    """

    def __init__(self) -> None:
        # The state loaded for the next iterator: its cursor and the dict it came from.
        # (None for the dict: carried over by the loader itself, not loaded)
        self.pending: tuple[Cursor, dict[str, Any] | None] | None = None
        # The epoch track of the last iterator, its statistics (set with the track), and the
        # state that iterator was loaded from (returned as it was, until a batch moves the
        # position).
        self.track: EpochTrack | None = None
        self.stats: StatsRecorder | None = None
        self.loaded: tuple[Cursor, dict[str, Any]] | None = None
        self.warned_replay = False
        # The type of what the loader's _get_iterator() returned last, when ferry did not make
        # it (an override returned another iterator): its position is unknown to ferry.
        self.foreign: type | None = None
        # How the dataset's own state is taken (decided once: see _engine/position/counted.py), and
        # whether a counted dataset was given a state that the next epoch must drop.
        self.verdict: DatasetVerdict | None = None
        self.given = False

    def judge(self, dataset: Any) -> DatasetVerdict:
        """How ``dataset``'s own state is taken, decided when the loader first needs it."""
        if self.verdict is None:
            self.verdict = judge_dataset(dataset)
        return self.verdict

    def begin(self, dataset: Any) -> None:
        """Called as each iterator is made, before :meth:`take_pending`: judges the dataset
        (once), and makes a counted dataset drop the state it was given once the iterator
        that resumed from it is done with."""
        counted = self.judge(dataset).counted
        if self.given and self.pending is None:
            self.given = False
            if counted is not None and counted.forget is not None:
                getattr(dataset, counted.forget)()

    def __getstate__(self) -> dict[str, Any]:
        # A pickled loader carries a loaded state, not a live epoch.
        return {**self.__dict__, "track": None, "stats": None, "loaded": None}

    def state_dict(self, loader: Any) -> dict[str, Any]:
        """``loader.state_dict()``: see :meth:`ferry.DataLoader.state_dict`."""
        if self.pending is not None:
            cursor, loaded = self.pending
            if loaded is not None:
                return copy.deepcopy(loaded)
            return LoaderState(identity_of(loader), cursor).to_plain()
        if self.foreign is not None:
            raise TypeError(
                f"state_dict() cannot describe the iterator that "
                f"{type(loader).__name__}._get_iterator() returned, a "
                f"{self.foreign.__module__}.{self.foreign.__qualname__}: ferry knows the "
                "position of its own iterators only. Return super()._get_iterator() from the "
                "override, or an object that wraps it (and hands out its batches one by one)"
            )
        track = self.track
        if track is None:  # before the first epoch: the generators as they stand now
            # (and without workers the main process's dataset, which lives on, as between
            # epochs: torchdata's state before iter() holds it too)
            dataset = loader.dataset
            main: tuple[WorkerCursor, ...] = ()
            if loader.num_workers == 0 and has_state_methods(dataset):
                main = (WorkerCursor(0, None, Snapshot(0, dataset.state_dict())),)
            cursor = between_epochs_cursor(
                Cursor(num_workers=loader.num_workers, workers=main),
                loader.generator,
                loader.sampler,
                loader.batch_sampler,
            )
        else:
            cursor = track.save()
            if self.loaded is not None and cursor is self.loaded[0]:
                return copy.deepcopy(self.loaded[1])
        plain = LoaderState(identity_of(loader), cursor).to_plain()
        counted = self.judge(loader.dataset).counted
        if counted is not None and cursor.started:
            position = counted.save(loader.dataset, cursor, loader.batch_size)
            plain["dataset_position"] = position.to_plain()
        return plain

    def load_state_dict(self, loader: Any, state_dict: dict[str, Any]) -> None:
        """``loader.load_state_dict()``: see :meth:`ferry.DataLoader.load_state_dict`."""
        cursor = LoaderState.cursor_from_plain(state_dict, identity_of(loader))
        position = DatasetPosition.from_plain(state_dict.get("dataset_position"))
        iterable = loader._iterable_style
        cursor = fit_workers(cursor, loader.num_workers, loader.dataset, iterable)
        if position is not None:
            # (as the library's own loader does: given now, read by the next iteration)
            cursor = position.load(loader.dataset, self.judge(loader.dataset), cursor)
            self.given = True
        if not self.warned_replay:
            self.warned_replay = warn_replay(cursor, loader.dataset, iterable)
        self.pending = (cursor, copy.deepcopy(state_dict))

    def carry_over(self) -> None:
        """Make the next iterator begin the next epoch as the last one would have (a change of
        ``num_workers`` between epochs: persistent workers keep their base seed)."""
        if self.track is not None and self.pending is None:
            cursor = self.track.next_epoch()
            self.pending = (cursor, None)

    def take_pending(self) -> tuple[Cursor | None, SkipBudget | None, RunCounts | None]:
        """What the next iterator starts from: a loaded cursor (or None), and the run's
        budget and counts, carried from the last iterator."""
        pending, self.pending = self.pending, None
        self.loaded = None
        if pending is not None and pending[1] is not None:
            self.loaded = (pending[0], pending[1])
        track = self.track
        budget = track.budget if track is not None else None
        run = track.run_counts() if track is not None else None
        return (pending[0] if pending is not None else None), budget, run
