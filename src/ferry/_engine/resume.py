"""Loading a state into a loader: what it must agree with, and fitting it to the loader.

:class:`ResumableLoader` is the loader's resume API (``state_dict``, ``load_state_dict``),
the API of torchdata's ``StatefulDataLoader``.

:func:`identity_of` is what a state is checked against (see
:func:`ferry._engine.cursor.from_plain`); :func:`warn_replay` says once that a stream without
state will be fast-forwarded by reading.

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

from ferry._engine.cursor import (
    Cursor,
    LoaderIdentity,
    Snapshot,
    WorkerCursor,
    from_plain,
    to_plain,
)
from ferry._engine.iterator import EpochTrack, LoaderIterator, between_epochs_cursor

__all__ = ["ResumableLoader", "fit_workers", "identity_of", "warn_replay"]


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
    """``cursor`` made to fit a loader with ``num_workers``; ValueError when it cannot."""
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
        if any(w.snapshot.dataset is not None for w in cursor.workers):
            raise ValueError(
                f"DataLoader state does not fit this loader: {counts}, and "
                f"{type(dataset).__name__} keeps a state of its own in each worker "
                "(state_dict on the dataset), which cannot be split over another number of "
                "workers. Resume with the same num_workers."
            )
        return fresh
    if not any(w.items or w.snapshot != Snapshot() for w in cursor.workers):
        return fresh
    if not getattr(dataset, "state_per_shard", False):
        raise ValueError(
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
            raise ValueError(
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


class ResumableLoader:
    """``state_dict()`` and ``load_state_dict()`` of :class:`ferry.DataLoader` (a mixin: the
    attributes below are the loader's)."""

    dataset: Any
    num_workers: int
    generator: Any
    sampler: Any
    batch_sampler: Any
    # The state loaded for the next iterator, the epoch track of the last iterator, and the
    # state that iterator was loaded from (returned as it was until a batch moves it).
    _pending: tuple[Cursor, dict[str, Any]] | None
    _last_track: EpochTrack | None
    _last_loaded: tuple[Cursor, dict[str, Any]] | None
    _warned_replay: bool
    _live_iterator: LoaderIterator | None

    @property
    def _iterable_style(self) -> bool:
        raise NotImplementedError

    def _replace_iterator(self, iterator: LoaderIterator | None) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch this loader handed out, as plain data.

        Load it with :meth:`load_state_dict` into this loader or a new one built the same way
        (in another process, after a crash) and the next iterator continues exactly there:
        the rest of the epoch, then later epochs, with the same batches, shuffles, worker seeds
        and (process workers) random augmentations as an uninterrupted run. Taken after the
        last batch of an epoch (or before any), the next iterator begins the next epoch in full.

        The state is plain data (``json`` and ``torch.save``/``torch.load(weights_only=True)``
        keep it), small (a few kilobytes per worker, whatever the dataset's size), and cheap to
        take: no worker is asked, so call it as often as you like.

        Example::

            >>> for step, batch in enumerate(loader):
            ...     train(batch)
            ...     if step % 1000 == 0:
            ...         state = {"model": model.state_dict(), "loader": loader.state_dict()}
            ...         torch.save(state, path)
        """
        if self._pending is not None:
            return copy.deepcopy(self._pending[1])
        track = self._last_track
        if track is None:  # before the first epoch: the generators as they stand now
            cursor = between_epochs_cursor(
                Cursor(num_workers=self.num_workers),
                self.generator,
                self.sampler,
                self.batch_sampler,
            )
        else:
            cursor = track.position()
            if self._last_loaded is not None and cursor is self._last_loaded[0]:
                return copy.deepcopy(self._last_loaded[1])
        return to_plain(cursor, identity_of(self))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next iterator start where ``state_dict`` (from :meth:`state_dict`) was taken.

        The loader may have another ``num_workers`` than the one the state came from (map-style
        datasets; for streams see the README), and a :class:`~ferry.DistributedSampler` another
        world size. Raises ValueError when the state does not fit this loader (another dataset
        length, batch size, sampler kind, ...), naming what differs.
        """
        cursor = from_plain(state_dict, identity_of(self))
        cursor = fit_workers(cursor, self.num_workers, self.dataset, self._iterable_style)
        if not self._warned_replay:
            self._warned_replay = warn_replay(cursor, self.dataset, self._iterable_style)
        self._pending = (cursor, copy.deepcopy(state_dict))
        if self._live_iterator is not None:
            self._replace_iterator(None)  # persistent workers: the next iter() starts there
