"""The loader's position: one explicit object made of parts, and its plain-data form.

A :class:`Cursor` says where the next batch comes from. It nests parts, and each part turns
itself into plain data and back (``to_plain``/``from_plain``), the way Grain's
``get_state/set_state`` and torchdata.nodes' ``get_state/reset`` nest theirs:

* :class:`~ferry._engine.position.keys.KeysCursor`: where the sampler's keys continue;
* :class:`WorkerCursor` per worker (with its :class:`Snapshot` of user states and its
  :class:`~ferry._core.rng.ProcessRng`): where each worker's stream and generators stand;
* :class:`RunCounts`: what spans the run rather than the epoch (the skip budget's counts, and
  where torch's global generator stood when earlier epochs began).

Adding a resumable stage adds a part here; nothing else lists fields. The iterator's
:class:`~ferry._engine.position.track.EpochTrack` is the one owner that moves the position, in one
place, where a batch is handed to the user; a fresh epoch is a resume from
:meth:`Cursor.zero`. :class:`LoaderState` is what ``DataLoader.state_dict()`` returns and
``load_state_dict()`` takes: JSON-safe, loadable with ``torch.load(weights_only=True)``,
versioned, and checked against the loader it is loaded into. ``docs/design/state.md`` explains
each field and why each save point resumes exactly.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ferry._core.rng import ProcessRng, generator_from_state, tensor_bytes
from ferry._engine.position.keys import KeysCursor
from ferry.errors import MalformedState, StateMismatch

__all__ = [
    "FORMAT",
    "VERSION",
    "Cursor",
    "LoaderIdentity",
    "LoaderState",
    "MalformedState",
    "RunCounts",
    "Snapshot",
    "StateMismatch",
    "WorkerCursor",
    "global_rng_fingerprint",
]

FORMAT = "ferry.DataLoader"
VERSION = 2

# Fingerprints of torch's global generator kept in a state (one per epoch that drew from it).
_FINGERPRINTS_KEPT = 64


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True)
class Snapshot:
    """A worker's user-side state, taken every ``snapshot_every_n_steps`` batches.

    ``items``: how many samples its stream had handed out then; ``dataset``/``stream``: what
    ``state_dict()`` of the dataset and of the stream's iterator returned (None: not stateful,
    or, for ``dataset``, a stream that is the dataset itself, whose state is ``stream``).
    """

    items: int = 0
    dataset: Any = None
    stream: Any = None

    def to_plain(self) -> dict[str, Any]:
        return {"items": self.items, "dataset": self.dataset, "stream": self.stream}

    @classmethod
    def from_plain(cls, plain: dict[str, Any]) -> Snapshot:
        return cls(int(plain["items"]), plain["dataset"], plain["stream"])


# Key numbers as runs: (first, step, count), the numbers first, first + step, ... (count of them).
Runs = tuple[tuple[int, int, int], ...]


def add_number(runs: Runs, number: int) -> Runs:
    """``runs`` with ``number`` added after the others (a worker's keys come in steps of the
    worker count: one run per epoch, as a rule)."""
    if runs:
        first, step, count = runs[-1]
        if count == 1 and number > first:
            return (*runs[:-1], (first, number - first, 2))
        if number == first + step * count:
            return (*runs[:-1], (first, step, count + 1))
    return (*runs, (number, 1, 1))


def run_numbers(runs: Runs) -> list[int]:
    """The numbers ``runs`` holds, in order."""
    return [first + step * i for first, step, count in runs for i in range(count)]


@dataclass(frozen=True)
class WorkerCursor:
    """One worker's position after the last batch the user received from it.

    ``items``: samples its stream has handed out this epoch (iterable-style datasets);
    ``rng``: its process's generators (None: as seeded); ``snapshot``: its last snapshot.
    ``since`` (a map-style dataset with a state of its own, process workers): the numbers of
    the epoch's keys it fetched since that snapshot, as runs: a resumed worker fetches them
    again after loading the snapshot, so the dataset's state moves on as it did. ``replay``:
    keys to fetch again before those, found when a resume went through an ended epoch (not
    saved: the worker reports its states once it has fetched them, see ``pool.py``).
    ``ended`` (a persistent worker's stream, when a resume went through an ended epoch): its
    position in that epoch; the worker opens its stream there and reads it to its end before
    this epoch begins, so a dataset whose state says where its stream stands goes on from that
    end, as the uninterrupted worker's did (not saved). ``exhausted``: its stream ran out while
    it made its last batch (a short one): resumed there, it has no batch left this epoch,
    whatever its states say (a dataset that rewinds itself when its stream ends would
    otherwise read the epoch again).
    """

    items: int = 0
    rng: ProcessRng | None = None
    snapshot: Snapshot = field(default_factory=Snapshot)
    since: Runs = ()
    replay: tuple[Any, ...] = field(default=(), compare=False)
    ended: WorkerCursor | None = field(default=None, compare=False)
    exhausted: bool = False

    def fetched(self, number: int) -> WorkerCursor:
        """This position after the worker fetched key ``number`` and took no snapshot."""
        return replace(self, since=add_number(self.since, number))

    def replay_with(self, recovered: dict[int, Any]) -> tuple[Any, ...]:
        """The keys this worker fetches again as it starts at this position: those it had to,
        and those it fetched since its snapshot, found in ``recovered`` (by number); only the
        first when some are missing (it then resumes at its snapshot)."""
        numbers = run_numbers(self.since)
        if not all(n in recovered for n in numbers):
            return self.replay
        return (*self.replay, *(recovered[n] for n in numbers))

    def between_epochs(self, keep_rng: bool, keys: dict[int, Any] | None = None) -> WorkerCursor:
        """This worker as the next epoch finds it: its stream starts again; its dataset (and,
        with ``keep_rng``, its generators) go on as they are. ``keys``: the ended epoch's keys
        by number, when a resume went through it: the worker fetches those in ``since`` again."""
        replay = self.replay
        if keys and self.since:
            replay = (*replay, *(keys[n] for n in run_numbers(self.since) if n in keys))
        rng = self.rng if keep_rng else None
        return WorkerCursor(0, rng, Snapshot(0, self.snapshot.dataset), replay=replay)

    def to_plain(self) -> dict[str, Any]:
        return {
            "items": self.items,
            "rng": None if self.rng is None else self.rng.to_plain(),
            "snapshot": self.snapshot.to_plain(),
            "since": [list(run) for run in self.since],
            "exhausted": self.exhausted,
        }

    @classmethod
    def from_plain(cls, plain: dict[str, Any]) -> WorkerCursor:
        rng = None if plain["rng"] is None else ProcessRng.from_plain(plain["rng"])
        if rng is not None and len(rng.torch_state) != torch.get_rng_state().numel():
            raise ValueError("a worker's torch generator state has the wrong size")
        # (a state saved before "since" existed has none: it loads as before)
        since = tuple((int(a), int(b), int(c)) for a, b, c in plain.get("since", ()))
        if any(a < 0 or b < 1 or c < 1 for a, b, c in since):
            raise ValueError("a worker's key numbers are invalid")
        # (nor "exhausted": such a state was saved by a ferry that did not tell)
        exhausted = plain.get("exhausted", False)
        if not isinstance(exhausted, bool):
            raise ValueError("a worker's 'exhausted' must be true or false")
        snapshot = Snapshot.from_plain(plain["snapshot"])
        return cls(int(plain["items"]), rng, snapshot, since, exhausted=exhausted)


@dataclass(frozen=True)
class RunCounts:
    """What spans the run, not one epoch: the skip budget's counts (``on_error="skip"``), and
    fingerprints of torch's global generator where earlier epochs that drew from it began (an
    epoch that would begin at one of them again would repeat that epoch: see
    :func:`global_rng_fingerprint`)."""

    skipped: int = 0
    seen: int = 0
    epoch_starts: tuple[str, ...] = ()
    # The current epoch's own fingerprint, last in epoch_starts, while it runs (not saved): an
    # epoch left before its end is not one a later epoch can repeat (see EpochTrack.run_counts).
    opened: str | None = field(default=None, compare=False)

    def with_start(self, fingerprint: str) -> RunCounts:
        kept = (*self.epoch_starts, fingerprint)[-_FINGERPRINTS_KEPT:]
        return replace(self, epoch_starts=kept, opened=fingerprint)

    def left_unfinished(self) -> RunCounts:
        """These counts without the current epoch's fingerprint: it was left before its end
        (Lightning's sanity check runs two validation batches inside ``isolate_rng``, then the
        first validation epoch begins where it began; a ``break``). Nothing of it repeats in
        a later epoch that begins there."""
        if self.opened is None:
            return self
        starts = list(self.epoch_starts)
        if starts and starts[-1] == self.opened:
            starts.pop()
        return replace(self, epoch_starts=tuple(starts), opened=None)

    def to_plain(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "seen": self.seen}

    @classmethod
    def from_plain(cls, errors: dict[str, Any], starts: list[Any]) -> RunCounts:
        if not all(isinstance(s, str) for s in starts):
            raise TypeError("the global generator's fingerprints must be strings")
        return cls(int(errors["skipped"]), int(errors["seen"]), tuple(starts))


def global_rng_fingerprint(state: torch.Tensor | None = None) -> str:
    """A short digest of torch's global CPU generator's state as it stands now (or of
    ``state``, a state of a CPU generator)."""
    data = tensor_bytes(torch.get_rng_state() if state is None else state)
    return hashlib.blake2b(data, digest_size=8).hexdigest()


@dataclass(frozen=True)
class Cursor:
    """Where the loader's next batch comes from.

    ``started``: an epoch is under way (False: the next iterator begins a fresh epoch, whose
    draws come from the generators as restored here). ``base_seed``: the workers' base seed of
    the epoch under way, or of the persistent workers (None without workers: nothing uses it).
    ``seed_drawn``: the epoch drew its base seed when it began (a persistent workers' later
    epoch does not). ``generator``: the loader generator's state (after the base seed was drawn,
    when started). ``keys`` and ``position``: where the sampler's keys continue (``position``
    keys of the epoch were handed out, plus those in ``ahead``, out of order). ``turn``: the
    worker whose batch comes next (in order). ``workers``: each worker's position, for
    ``num_workers`` workers (0: the main process). ``run``: what spans the run.
    ``global_rng`` (a loader without a generator, saved before an epoch's draws: before the
    first ``iter()`` or after ``StopIteration``): torch's global RNG when the state was taken;
    the next epoch's base seed and a built-in sampler's draws are made from a copy of it (and
    made on the global RNG too, dropped), so they are those of the uninterrupted run.
    """

    started: bool = False
    # The epoch under way had ended (StopIteration): a resume goes through it, drawing what it
    # drew (as torchdata's loader recreates a finished iterator), then begins the next one.
    finished: bool = False
    base_seed: int | None = None
    seed_drawn: bool = True
    generator: str | None = None
    keys: KeysCursor = field(default_factory=lambda: KeysCursor("skip"))
    position: int = 0
    ahead: frozenset[int] = frozenset()
    turn: int = 0
    num_workers: int = 0
    workers: tuple[WorkerCursor, ...] = ()
    run: RunCounts = field(default_factory=RunCounts)
    global_rng: str | None = None

    @classmethod
    def zero(cls) -> Cursor:
        """A fresh loader's position: nothing to restore, everything drawn anew."""
        return cls()

    def next_epoch(self, persistent: bool, keys: dict[int, Any] | None = None) -> Cursor:
        """The cursor of the epoch after this one, drawing from the generators as they stand.

        Persistent workers keep their base seed, their generators and their datasets; the main
        process (``num_workers=0``) keeps its dataset, as an uninterrupted run does. ``keys``:
        see :meth:`WorkerCursor.between_epochs`.
        """
        keep = persistent or self.num_workers == 0
        return Cursor(
            base_seed=self.base_seed if persistent else None,
            seed_drawn=not persistent,
            num_workers=self.num_workers,
            workers=tuple(w.between_epochs(persistent, keys) for w in self.workers) if keep else (),
            run=self.run,
        )

    def to_plain(self) -> dict[str, Any]:
        return {
            "started": self.started,
            "finished": self.finished,
            "base_seed": self.base_seed if self.num_workers else None,
            "seed_drawn": self.seed_drawn,
            "generator": self.generator,
            "keys": self.keys.to_plain(),
            "position": self.position,
            "ahead": sorted(self.ahead),
            "turn": self.turn,
            "global_rng": self.global_rng,
        }

    @classmethod
    def from_plain(cls, epoch: dict[str, Any], state: dict[str, Any]) -> Cursor:
        generator = epoch["generator"]
        if generator is not None:
            if not isinstance(generator, str):
                raise TypeError(f"a generator state must be a string, got {type(generator)}")
            generator_from_state(generator)
        global_rng = epoch.get("global_rng")  # (a state from before it existed has none)
        if global_rng is not None:
            if not isinstance(global_rng, str):
                raise TypeError(f"a generator state must be a string, got {type(global_rng)}")
            generator_from_state(global_rng)
        cursor = cls(
            started=bool(epoch["started"]),
            finished=bool(epoch.get("finished", False)),
            base_seed=_int_or_none(epoch["base_seed"]),
            seed_drawn=bool(epoch["seed_drawn"]),
            generator=generator,
            keys=KeysCursor.from_plain(epoch["keys"]),
            position=int(epoch["position"]),
            ahead=frozenset(int(n) for n in epoch["ahead"]),
            turn=int(epoch["turn"]),
            num_workers=int(state["loader"]["num_workers"]),
            workers=tuple(WorkerCursor.from_plain(w) for w in state["workers"]),
            # (both may be left out: a state with neither starts a fresh budget)
            run=RunCounts.from_plain(
                state.get("errors", {"skipped": 0, "seen": 0}), state.get("epoch_starts", [])
            ),
            global_rng=global_rng,
        )
        if cursor.position < 0 or len(cursor.workers) not in (0, max(cursor.num_workers, 1)):
            raise ValueError("its position or worker list is invalid")
        return cursor


@dataclass(frozen=True)
class LoaderIdentity:
    """What a state must agree with to load into a loader."""

    iterable: bool
    dataset_length: int | None
    batch_size: int | None
    drop_last: bool
    sampler: str
    batch_sampler: str | None
    num_workers: int

    def to_plain(self) -> dict[str, Any]:
        return {
            "dataset": "iterable" if self.iterable else "map",
            "dataset_length": self.dataset_length,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "sampler": self.sampler,
            "batch_sampler": self.batch_sampler,
            "num_workers": self.num_workers,
        }

    def check(self, saved: dict[str, Any]) -> None:
        """Raise :class:`StateMismatch` naming each option ``saved`` differs in."""
        here = self.to_plain()
        differences = [
            f"{name}: the state has {saved.get(name)!r}, this loader has {here[name]!r}"
            for name in here
            if name != "num_workers" and saved.get(name) != here[name]
        ]
        if differences:
            raise StateMismatch(
                "DataLoader state does not fit this loader: it was saved from a loader with "
                "other data or options (" + "; ".join(differences) + "). Build the loader as "
                "it was when the state was saved."
            )


@dataclass(frozen=True)
class LoaderState:
    """A whole state: the loader it was saved from, and the position (see the module doc)."""

    identity: LoaderIdentity
    cursor: Cursor

    def to_plain(self) -> dict[str, Any]:
        cursor = self.cursor
        return {
            "format": FORMAT,
            "version": VERSION,
            "loader": self.identity.to_plain(),
            "epoch": cursor.to_plain(),
            "errors": cursor.run.to_plain(),
            "epoch_starts": list(cursor.run.epoch_starts),
            "workers": [w.to_plain() for w in cursor.workers],
        }

    @staticmethod
    def cursor_from_plain(state: Any, identity: LoaderIdentity) -> Cursor:
        """The cursor ``state`` describes, checked against the loader it is loaded into.

        Raises :class:`StateMismatch` when it was saved from a loader built otherwise, and
        :class:`MalformedState` when it is not what ``state_dict()`` returned.
        """
        if not isinstance(state, dict):
            raise MalformedState(
                f"DataLoader.load_state_dict expects the dict that state_dict() returned, got "
                f"{type(state).__name__}"
            )
        if state.get("format") != FORMAT:
            raise MalformedState(
                f"this is not a ferry DataLoader state: its 'format' is "
                f"{state.get('format')!r}, expected {FORMAT!r} (a state from torchdata's "
                "StatefulDataLoader, or from another object, cannot be loaded)"
            )
        if state.get("version") != VERSION:
            raise MalformedState(
                f"DataLoader state version {state.get('version')!r} is not supported by this "
                f"ferry, which reads version {VERSION}"
            )
        saved = state.get("loader")
        if isinstance(saved, dict):
            identity.check(saved)  # what does not fit is said as such, before any parsing
        try:
            cursor = Cursor.from_plain(state["epoch"], state)
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
            raise MalformedState(
                f"DataLoader state is malformed ({type(exc).__name__}: {exc}); pass the dict "
                "that state_dict() returned, unchanged apart from a json or torch.save round "
                "trip"
            ) from None
        return cursor
