"""A worker's side of the cursor: open its fetcher at a saved position, report each new one.

Every place that fetches (a worker process, a worker thread, the main process with
``num_workers=0``) holds one :class:`PositionKeeper`. Opening an epoch restores, in this order,
what the uninterrupted run had done by the last batch the user received from this worker:

1. the dataset's own state (``dataset.load_state_dict``), before its stream is opened;
2. the stream (``iter(dataset)``), then its iterator's state (``load_state_dict``) if it has one;
3. the samples taken since that state: read and dropped (a stream with no state drops them all);
4. the process's random generators, last, so draws made while dropping do not count twice.

After each batch, :meth:`PositionKeeper.after_batch` reports the new position: the stream's
sample count always, the generators only when they changed, the user states every
``snapshot_every`` batches.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ferry._core.rng import ProcessRng, RngWatch
from ferry._engine.position.counted import snapshots_itself
from ferry._engine.position.cursor import Snapshot, WorkerCursor
from ferry._engine.work.fetch import BatchDropped, IterableFetcher, MapFetcher
from ferry.datasets import is_iterable_style
from ferry.errors import warn_from_user_code

__all__ = ["PositionKeeper", "WorkerReport"]


@dataclass(frozen=True)
class WorkerReport:
    """What changed in a worker's position with one batch (sent with the batch).

    ``rng`` and ``snapshot`` are None when unchanged since the worker's previous batch.
    """

    items: int
    rng: ProcessRng | None = None
    snapshot: Snapshot | None = None
    exhausted: bool = False  # the stream ran out while this batch was made

    def resolve(self, previous: WorkerCursor) -> WorkerCursor:
        """The full position this report describes, given the worker's previous one (the keys
        fetched since the previous snapshot go on until a new snapshot)."""
        rng = self.rng if self.rng is not None else previous.rng
        if self.snapshot is not None:
            return WorkerCursor(self.items, rng, self.snapshot, exhausted=self.exhausted)
        return WorkerCursor(
            self.items,
            rng,
            previous.snapshot,
            previous.since,
            previous.replay,
            exhausted=self.exhausted,
        )


# The classes whose state_dict() raised the first time it was asked, in this process: their
# objects are not asked again (by the next epoch's keepers either), and it is said once.
_RAISED: set[type] = set()


class _Refused(Exception):
    """(A class in _RAISED: not asked again.)"""


class PositionKeeper:
    """Restores and reports one fetcher's position (see the module docstring)."""

    def __init__(self, dataset: Any, snapshot_every: int, track_rng: bool) -> None:
        self._dataset = dataset
        self._every = snapshot_every  # 0: never after the epoch's start
        # (a state_dict that needs arguments is not torchdata's: see _engine/position/counted.py)
        self._dataset_stateful = snapshots_itself(dataset)
        # Whether a batch can change anything worth reporting (else the caller may skip
        # after_batch): a stream's count, a generator, or a user state.
        self.reports = track_rng or self._dataset_stateful or is_iterable_style(dataset)
        self._batches = 0
        self._rng = RngWatch() if track_rng else None
        self._stream_stateful = False  # decided when a stream opens
        # The parts whose state_dict() has answered once; one that raised the first time it
        # was asked is not asked again (see _state_of).
        self._answered: set[str] = set()
        self._stream_refused = False

    def open(
        self,
        make: Callable[[], MapFetcher | IterableFetcher],
        resume: WorkerCursor | None,
        replay: tuple[Any, ...] = (),
    ) -> MapFetcher | IterableFetcher:
        """A fetcher made by ``make()``, at ``resume`` (or fresh, with None). ``replay``: keys a
        map-style dataset fetched since its snapshot, fetched again (results dropped) so its
        own state moves on as it did, as torchdata's workers do."""
        self._batches = 0
        if resume is not None and resume.ended is not None:
            # The ended epoch first: its stream from where it stood, read to its end. The
            # dataset then stands as the uninterrupted worker's did when this epoch began.
            ended = self.open(make, resume.ended)
            if isinstance(ended, IterableFetcher):
                ended.drop(sys.maxsize)
            self._batches = 0
            kept = replace(resume.snapshot, dataset=None)
            resume = replace(resume, ended=None, snapshot=kept)
        snapshot = resume.snapshot if resume is not None else Snapshot()
        if snapshot.dataset is not None and self._dataset_stateful:
            self._dataset.load_state_dict(snapshot.dataset)
        fetcher = make()
        if isinstance(fetcher, MapFetcher):
            for key in replay:
                # (on_error="skip": a batch it dropped the first time, it drops again)
                with contextlib.suppress(BatchDropped):
                    fetcher.fetch(key)
        self._stream_stateful = (
            isinstance(fetcher, IterableFetcher)
            and not self._stream_refused
            and snapshots_itself(fetcher.stream)
        )
        if isinstance(fetcher, IterableFetcher) and resume is not None:
            fetcher.items = snapshot.items
            if resume.exhausted:
                # Its stream had run out: nothing is left of this epoch, whatever the states
                # say (torchdata's fetcher keeps the same mark). The dataset's state, loaded
                # above, is where the next epoch starts.
                fetcher.items = resume.items
                fetcher.end()
            else:
                if snapshot.stream is not None and self._stream_stateful:
                    fetcher.stream.load_state_dict(snapshot.stream)  # type: ignore[attr-defined]
                fetcher.drop(resume.items - snapshot.items)
        if resume is not None and resume.rng is not None and self._rng is not None:
            resume.rng.restore()
        if self._rng is not None:
            self._rng.changed()  # the reference: what the next batch is compared with
        return fetcher

    def after_batch(self, fetcher: MapFetcher | IterableFetcher) -> WorkerReport | None:
        """What the batch just made changed in the position; None when nothing did (a
        map-style dataset whose worker drew nothing: the common case, kept off the wire)."""
        self._batches += 1
        items = fetcher.items if isinstance(fetcher, IterableFetcher) else 0
        rng: ProcessRng | None = None
        if self._rng is not None:
            rng = self._rng.changed()
        snapshot: Snapshot | None = None
        every = self._every
        if (
            every
            and self._batches % every == 0
            and (self._dataset_stateful or self._stream_stateful)
        ):
            snapshot = self.states(fetcher)
        if rng is None and snapshot is None and not isinstance(fetcher, IterableFetcher):
            return None
        exhausted = isinstance(fetcher, IterableFetcher) and fetcher.ended
        return WorkerReport(items, rng, snapshot, exhausted)

    def states(self, fetcher: MapFetcher | IterableFetcher) -> Snapshot:
        """The user states as they stand now. A stream that is the dataset itself has one
        state, its iterator's: it is restored after ``iter(dataset)``, as torchdata does, since
        its ``load_state_dict`` may use what ``__iter__`` sets up."""
        if not isinstance(fetcher, IterableFetcher):
            dataset = self._state_of(self._dataset, "dataset") if self._dataset_stateful else None
            return Snapshot(0, dataset)
        stream = fetcher.stream
        own = stream is not self._dataset
        dataset = (
            self._state_of(self._dataset, "dataset") if self._dataset_stateful and own else None
        )
        state = self._state_of(stream, "stream") if self._stream_stateful else None
        if dataset is None and state is None:
            return Snapshot()  # nothing describes the stream: a resume reads it again
        # As torchdata: a stream with a state, or from a dataset with one, is not read again.
        return Snapshot(fetcher.items, dataset, state)

    def _state_of(self, part: Any, name: str) -> Any:
        """``part.state_dict()``. One that raises the first time it is asked cannot be called
        as the protocol expects: like one that needs arguments
        (``_engine/position/counted.py``), it is taken for a part without state from then on,
        said once, and iteration goes on as with torch's loader, which never asks. Once it has
        answered, what it raises is the user's."""
        if name in self._answered:
            return part.state_dict()
        refused = type(part) in _RAISED
        try:
            if refused:
                raise _Refused
            state = part.state_dict()
        except Exception as exc:
            if name == "dataset":
                self._dataset_stateful = False
            else:
                self._stream_refused, self._stream_stateful = True, False
            if refused:
                return None
            _RAISED.add(type(part))
            warn_from_user_code(
                f"{type(part).__name__}.state_dict() raised {type(exc).__name__}: {exc}. "
                f"ferry takes no state of this {name} from now on and iterates it as torch's "
                "DataLoader does; at load_state_dict it is resumed as a "
                f"{name} without state (the keys go on, or the stream skips what it had "
                "handed out).",
                UserWarning,
            )
            return None
        self._answered.add(name)
        return state

    def live(self, fetcher: MapFetcher | IterableFetcher) -> WorkerCursor:
        """The position as it stands now, user states included (the main process's, which the
        loader reads when its state is asked for, as torchdata does without workers)."""
        if not isinstance(fetcher, IterableFetcher):
            return WorkerCursor(0, None, self.states(fetcher))
        return WorkerCursor(fetcher.items, None, self.states(fetcher), exhausted=fetcher.ended)
