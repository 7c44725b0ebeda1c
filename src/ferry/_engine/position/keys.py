"""The keys of one epoch, started from a cursor: a fresh epoch, or one resumed mid-way.

An epoch hands out one *key* per batch (see :mod:`ferry._engine.work.fetch`), numbered from 0.
:class:`EpochKeys` yields ``(number, key)`` pairs and can say, for any number ``n`` of keys
handed out, how to start again right after them (:meth:`EpochKeys.cursor_at`), as plain data
(:class:`KeysCursor`). How depends on the sampler:

``builtin``
    ferry's own samplers (and ferry's :class:`~ferry.BatchSampler` around them): the
    sequence is fixed by how the iteration began (a generator state, a seed, an epoch), so the
    cursor is that start and a resume slices the first ``n`` keys off, drawing nothing twice and
    fetching nothing.
``stateful``
    a user's sampler (or its iterator) with ``state_dict()``/``load_state_dict()``: its state is
    taken every ``snapshot_every`` keys; a resume loads the last snapshot at or before ``n`` and
    skips the keys after it.
``skip``
    any other sampler: a resume iterates it afresh and skips ``n`` keys (indices only). One
    with a ``torch.Generator`` of its own (torch's ``RandomSampler(generator=g)`` and the like:
    a ``generator`` attribute) has that generator's state kept from when its iteration began,
    and put back before the resume iterates it, so it draws the epoch's order again.
``stream``
    an iterable-style dataset: keys are only batch sizes; the workers' streams hold the
    position.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from ferry._batching import batched
from ferry._core.rng import generator_from_state, generator_state, set_generator_state
from ferry._core.stateful import has_state_methods
from ferry._engine.plan import EpochPlan
from ferry._sampler_keys import (
    first_draw_bytes,
    index_batches,
    is_builtin_batch_sampler,
    is_builtin_sampler,
    run_keys,
)
from ferry.samplers import SamplerRun, pending_start

__all__ = [
    "EpochKeys",
    "KeysCursor",
    "between_epochs",
    "builtin_source",
    "draws_from_global",
    "has_state_methods",
]

KeysKind = Literal["builtin", "stateful", "skip", "stream"]


@dataclass(frozen=True)
class KeysCursor:
    """Where an epoch's keys start again (see the module docstring for each kind).

    ``base`` is how many keys of the epoch came before ``start`` (not 0 only after a
    :class:`~ferry.DistributedSampler` was resumed with another world size: its start then
    describes the rest of the epoch).
    """

    kind: KeysKind
    start: dict[str, Any] | None = None
    snapshot: Any = None
    snapshot_at: int = 0
    base: int = 0
    # (stateful) the sampler had ended when the cursor was taken: its state may already
    # describe the next epoch, so a resume loads it and hands out no key
    ended: bool = False
    # (skip) the state of the sampler's own torch.Generator when its iteration began (between
    # epochs: as it stands); None when it has none (see foreign_generator)
    sampler_generator: str | None = None

    # What each kind of cursor starts from (the kind is a string in a saved state; these are
    # the one place it is compared).

    @property
    def builtin_start(self) -> dict[str, Any] | None:
        """A built-in sampler's start (``builtin``), else None."""
        return self.start if self.kind == "builtin" else None

    @property
    def stateful_snapshot(self) -> Any:
        """A stateful sampler's snapshot (``stateful``), else None."""
        return self.snapshot if self.kind == "stateful" else None

    @property
    def stateful_ended(self) -> bool:
        """A stateful sampler had handed out every key when the cursor was taken."""
        return self.kind == "stateful" and self.ended

    @property
    def skip_generator(self) -> str | None:
        """The own generator's state of a sampler without state (``skip``), else None."""
        return self.sampler_generator if self.kind == "skip" else None

    def to_plain(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "start": self.start,
            "snapshot": self.snapshot,
            "snapshot_at": self.snapshot_at,
            "base": self.base,
            "ended": self.ended,
            "sampler_generator": self.sampler_generator,
        }

    @classmethod
    def from_plain(cls, plain: dict[str, Any]) -> KeysCursor:
        kind = plain["kind"]
        if kind not in ("builtin", "stateful", "skip", "stream"):
            raise ValueError(f"unknown sampler kind {kind!r}")
        start = plain["start"]
        if start is not None:
            if not isinstance(start, dict):
                raise TypeError(f"the sampler's start must be a dict, got {type(start).__name__}")
            if "seed" in start and not isinstance(start["seed"], int):
                raise TypeError(f"the sampler's seed must be an int, got {start['seed']!r}")
            generator = start.get("generator")
            if generator is not None:
                if not isinstance(generator, str):
                    raise TypeError(
                        f"a generator state must be a string, got {type(generator).__name__}"
                    )
                generator_from_state(generator)
        # (a state saved before sampler_generator existed has none: it loads as before)
        own = plain.get("sampler_generator")
        if own is not None:
            if not isinstance(own, str):
                raise TypeError(f"a generator state must be a string, got {type(own).__name__}")
            generator_from_state(own)
        return cls(
            kind,
            start,
            plain["snapshot"],
            int(plain["snapshot_at"]),
            int(plain["base"]),
            bool(plain["ended"]),
            own,
        )


def builtin_source(sampler: Any, batch_sampler: Any) -> Any:
    """The built-in sampler whose iteration an epoch's keys follow (alone, or in ferry's
    BatchSampler), or None when the keys come from a user's sampler."""
    if batch_sampler is None:
        return sampler if is_builtin_sampler(sampler) else None
    if is_builtin_batch_sampler(batch_sampler) and is_builtin_sampler(batch_sampler.sampler):
        return batch_sampler.sampler
    return None


def user_source(sampler: Any, batch_sampler: Any) -> Any:
    """The user's sampler whose state an epoch's keys keep: the one ferry's BatchSampler wraps,
    or the index sampler itself."""
    if is_builtin_batch_sampler(batch_sampler):
        return batch_sampler.sampler
    return batch_sampler if batch_sampler is not None else sampler


def foreign_generator(source: Any, loader_generator: Any) -> torch.Generator | None:
    """The ``torch.Generator`` of its own that a user's sampler without state draws from (as
    torch's ``RandomSampler``, ``SubsetRandomSampler`` and ``WeightedRandomSampler`` given
    ``generator=``), looked for on the sampler and on the sampler a batch sampler wraps. None
    without one, and for the loader's own generator (restored with the loader's state)."""
    for holder in (source, getattr(source, "sampler", None)):
        generator = getattr(holder, "generator", None)
        if isinstance(generator, torch.Generator):
            return None if generator is loader_generator else generator
    return None


def between_epochs(sampler: Any, batch_sampler: Any, loader_generator: Any = None) -> KeysCursor:
    """How the next epoch's keys start, between epochs: a built-in sampler's generator as it
    stands, or a stateful user sampler's state as it stands (a new iteration of a sampler
    whose state lives in its iterator starts afresh anyway), or the state of another user
    sampler's own generator as it stands."""
    source = builtin_source(sampler, batch_sampler)
    if source is not None:
        start = pending_start(source)
        return KeysCursor("builtin", start) if start is not None else KeysCursor("skip")
    source = user_source(sampler, batch_sampler)
    if has_state_methods(source):
        return KeysCursor("stateful", snapshot=source.state_dict())
    own = foreign_generator(source, loader_generator)
    return KeysCursor("skip", sampler_generator=None if own is None else generator_state(own))


def draws_from_global(plan: EpochPlan, new_seeds: bool = True) -> bool:
    """Whether an epoch of a loader without a generator takes what it yields from torch's
    global RNG: its workers' seeds (unless ``new_seeds`` is false: persistent workers keep
    theirs), or a sampler without a generator of its own (ferry's, or any with a
    ``generator`` attribute left None, as torch's random samplers)."""
    if plan.num_workers > 0 and new_seeds:
        return True
    source = builtin_source(plan.sampler, plan.batch_sampler)
    if source is None:
        source = user_source(plan.sampler, plan.batch_sampler)
    return hasattr(source, "generator") and source.generator is None


def restore_between_epochs(sampler: Any, batch_sampler: Any, keys: KeysCursor) -> None:
    """Put a built-in sampler's generator where :func:`between_epochs` found it (before the
    base seed is drawn: the two may share one generator, and the epoch draws in torch's
    order from there)."""
    source = builtin_source(sampler, batch_sampler)
    generator = getattr(source, "generator", None)
    start = keys.builtin_start
    if start and "generator" in start and isinstance(generator, torch.Generator):
        set_generator_state(generator, start["generator"])
    if keys.skip_generator is not None and source is None:
        own = foreign_generator(user_source(sampler, batch_sampler), None)
        if own is not None:
            set_generator_state(own, keys.skip_generator)


class _Watched(Iterator[Any]):
    """A user sampler's iterator, noting when it has ended (a partial last batch ends it
    before the batch is handed out)."""

    def __init__(self, iterator: Iterator[Any]) -> None:
        self._iterator = iterator
        self.ended = False

    def __next__(self) -> Any:
        try:
            return next(self._iterator)
        except StopIteration:
            self.ended = True
            raise


class KeyKind:
    """How one epoch's keys follow their sampler, and how they start again: one class per kind
    (see the module docstring), made when :class:`EpochKeys` opens the sampler. The kind keeps
    what its cursor needs; :class:`EpochKeys` numbers the keys and skips."""

    name: ClassVar[KeysKind]

    def cursor_at(self, keys: EpochKeys, count: int) -> KeysCursor:
        """How to start again after the first ``count`` keys of the epoch."""
        return KeysCursor(self.name)

    def first_draw_bytes(self) -> int | None:
        """At most how many bytes drawing the epoch's first key leaves in this process (None:
        a user's sampler draws it)."""
        return None

    # Whether each key drawn is noted (:meth:`took`): off the common path otherwise. A plain
    # attribute, read on every batch's path.
    per_key = False

    def took(self, taken: int) -> None:
        """``taken`` keys of the epoch were drawn (see :attr:`per_key`)."""

    def rebased(self, skipped: int) -> int:
        """How far the epoch's base moves once the first key was drawn (see EpochKeys)."""
        return 0


class StreamKeys(KeyKind):
    """An iterable-style dataset: keys are only batch sizes; the workers' streams hold the
    position."""

    name = "stream"

    def first_draw_bytes(self) -> int | None:
        return 0


class BuiltinKeys(KeyKind):
    """ferry's own samplers: the cursor is the start of their iteration (``run``)."""

    name = "builtin"

    def __init__(self, run: SamplerRun, sampler: Any, asked_skip: int) -> None:
        self.run = run
        self.sampler = sampler
        self.asked_skip = asked_skip  # what the sampler was asked to slice off

    def cursor_at(self, keys: EpochKeys, count: int) -> KeysCursor:
        start = self.run.start
        if start is None:
            start = pending_start(self.sampler)
        return KeysCursor("builtin", start, base=keys.base)

    def first_draw_bytes(self) -> int | None:
        return first_draw_bytes(self.sampler)

    def rebased(self, skipped: int) -> int:
        # A built-in sampler may rewrite its start when it begins (a DistributedSampler
        # resumed with another world size): the keys skipped so far then precede the start.
        return skipped if self.asked_skip and self.run.skip == 0 else 0


class StatefulKeys(KeyKind):
    """A user's sampler (or its iterator, ``holder``) with a state: snapshots every ``every``
    keys (0: at the epoch's start only), by the number of keys drawn."""

    name = "stateful"

    def __init__(self, holder: Any, watched: _Watched, every: int) -> None:
        self.holder = holder
        self.watched = watched
        self.every = every
        self.snapshots: dict[int, Any] = {}

    per_key = True

    def took(self, taken: int) -> None:
        if self.every and taken % self.every == 0:
            self.snapshots[taken] = self.holder.state_dict()

    def cursor_at(self, keys: EpochKeys, count: int) -> KeysCursor:
        snapshots = self.snapshots
        at = max(n for n in snapshots if n <= count)
        for old in [n for n in snapshots if n < at]:
            del snapshots[old]  # never asked for again: the cursor only moves forward
        if self.watched.ended and keys.drawn_ahead is None and count == keys.taken:
            # Every key was handed out and the sampler's iteration is over: its state now
            # is the one after that end (it may already describe its next epoch).
            state = self.holder.state_dict()
            return KeysCursor("stateful", snapshot=state, snapshot_at=count, ended=True)
        return KeysCursor("stateful", snapshot=snapshots[at], snapshot_at=at)


class SkipKeys(KeyKind):
    """Any other user's sampler: a resume iterates it afresh and skips; its own generator's
    state when its iteration began (``began``), if it has one, is kept."""

    name = "skip"

    def __init__(self, began: str | None) -> None:
        self.began = began

    def cursor_at(self, keys: EpochKeys, count: int) -> KeysCursor:
        return KeysCursor("skip", sampler_generator=self.began)


class LazyUserKeys(KeyKind):
    """ferry's BatchSampler around a user's sampler, whose ``iter()`` runs at the first batch
    (as in torch): until then its cursor is the sampler's as it stands; from then on, the
    kind it was opened as (``opened``)."""

    def __init__(self, plan: EpochPlan) -> None:
        self.plan = plan
        self.opened: KeyKind | None = None
        self._guess: KeysKind = (
            "stateful" if has_state_methods(plan.batch_sampler.sampler) else "skip"
        )

    @property
    def name(self) -> KeysKind:  # type: ignore[override]
        return self.opened.name if self.opened is not None else self._guess

    def open(self, kind: KeyKind) -> None:
        """The user's sampler was opened as ``kind``: the keys follow it from now on."""
        self.opened = kind
        self.per_key = kind.per_key

    def took(self, taken: int) -> None:
        if self.opened is not None:
            self.opened.took(taken)

    def cursor_at(self, keys: EpochKeys, count: int) -> KeysCursor:
        if self.opened is not None:
            return self.opened.cursor_at(keys, count)
        plan = self.plan
        if self._guess == "stateful":  # its state as it stands
            return between_epochs(plan.sampler, plan.batch_sampler, plan.generator)
        own = foreign_generator(user_source(plan.sampler, plan.batch_sampler), plan.generator)
        return KeysCursor("skip", sampler_generator=None if own is None else generator_state(own))


class EpochKeys(Iterator[tuple[int, Any]]):
    """One epoch's numbered keys, from ``cursor``, after the first ``position`` of the epoch.

    ``exclude`` holds numbers of keys already handed out past ``position`` (out of order): they are
    drawn and dropped. ``iter()`` is called on the sampler here, eagerly, as torch does when an
    iterator is made; with ``tensor_batches``, a built-in batch sampler hands out index tensors.
    ``recover`` holds numbers below ``position`` whose keys a resumed worker fetches again: the
    fast-forward walks through them and keeps them in ``recovered`` (a stateful sampler's from
    its snapshot on only). How the keys follow the sampler, and start again, is their kind's
    (:class:`KeyKind`, ``self.source``).
    """

    def __init__(
        self,
        plan: EpochPlan,
        tensor_batches: bool,
        *,
        cursor: KeysCursor | None = None,
        position: int = 0,
        exclude: frozenset[int] = frozenset(),
        snapshot_every: int = 1,
        recover: frozenset[int] = frozenset(),
    ) -> None:
        self._plan = plan
        self._recover = recover
        self.recovered: dict[int, Any] = {}
        self._exclude = exclude
        self._every = snapshot_every  # 0: the state at the epoch's start only
        self.base = cursor.base if cursor is not None else 0
        self._skip = position - self.base  # keys to skip past the cursor's start
        self._rebase_checked = False
        self.taken = position  # numbers handed out (or skipped) so far
        self.drawn_ahead: tuple[int, Any] | None = None  # (see exhausted)
        self.source: KeyKind
        self.source, self._keys = self._open(tensor_batches, cursor, self._skip)

    @property
    def kind(self) -> KeysKind:
        """The kind's name, as a saved cursor holds it."""
        return self.source.name

    def first_draw_bytes(self) -> int | None:
        """At most how many bytes drawing the epoch's first key leaves in this process (see
        :func:`ferry._sampler_keys.first_draw_bytes`); None when a user's sampler draws it."""
        return self.source.first_draw_bytes()

    # -- opening -------------------------------------------------------------------------------

    def _open(
        self, tensor_batches: bool, cursor: KeysCursor | None, skip: int
    ) -> tuple[KeyKind, Iterator[Any]]:
        plan = self._plan
        if plan.iterable_style:
            return StreamKeys(), itertools.repeat(plan.batch_size)
        batch_sampler, sampler = plan.batch_sampler, plan.sampler
        start = cursor.builtin_start if cursor is not None else None
        builtin = builtin_source(sampler, batch_sampler)
        # Keys to recover are walked through: only those before the first are sliced off.
        fast = skip
        if self._recover:
            fast = max(0, min(skip, min(self._recover) - self.base))
        if builtin is not None and batch_sampler is None:
            run = SamplerRun(start, fast)
            keys = self._walk(run_keys(sampler, run), skip - fast, fast)
            return BuiltinKeys(run, sampler, fast), keys
        if builtin is not None:
            size, drop_last = batch_sampler.batch_size, batch_sampler.drop_last
            run = SamplerRun(start, fast * size)
            source = BuiltinKeys(run, builtin, fast)
            if tensor_batches:
                batches = index_batches(batch_sampler, run)
                if batches is not None:
                    return source, self._walk(batches, skip - fast, fast)
            keys = batched(run_keys(batch_sampler.sampler, run), size, drop_last)
            return source, self._walk(keys, skip - fast, fast)
        # A user's sampler: stateful or not. ferry's BatchSampler around a user's sampler is
        # opened here so the state is the inner sampler's; its iter() runs at the first batch,
        # as in BatchSampler.__iter__ (torch's too), unless a resume needs it now.
        wrapped = is_builtin_batch_sampler(batch_sampler)
        snapshot = cursor.stateful_snapshot if cursor is not None else None
        at = cursor.snapshot_at if snapshot is not None and cursor is not None else 0
        restore = cursor.skip_generator if cursor is not None else None
        if wrapped and not skip and snapshot is None:
            lazy = LazyUserKeys(plan)

            def lazily() -> Iterator[Any]:
                kind, keys = self._open_user(True, None, 0, 0, restore=restore)
                lazy.open(kind)
                yield from keys

            return lazy, lazily()
        ended = cursor is not None and cursor.stateful_ended
        return self._open_user(wrapped, snapshot, at, skip, restore=restore, ended=ended)

    def _open_user(
        self,
        wrapped: bool,
        snapshot: Any,
        at: int,
        skip: int,
        *,
        restore: str | None,
        ended: bool = False,
    ) -> tuple[KeyKind, Iterator[Any]]:
        """A user's sampler opened: its kind, and its keys. ``restore``: its own generator's
        state to put back before it is iterated (a resume of a sampler without state)."""
        plan = self._plan
        batch_sampler = plan.batch_sampler
        source = user_source(plan.sampler, batch_sampler)
        holder: Any = None
        began: str | None = None
        if has_state_methods(source):
            if snapshot is not None:
                source.load_state_dict(snapshot)
            it = iter(source)
            holder = source
        else:
            own = foreign_generator(source, plan.generator)
            if own is not None:
                if restore is not None:
                    set_generator_state(own, restore)
                began = generator_state(own)
            it = iter(source)
            if has_state_methods(it):
                if snapshot is not None:
                    it.load_state_dict(snapshot)
                holder = it
            else:
                at = 0
        watched = _Watched(it)
        keys: Iterator[Any] = (
            batched(watched, batch_sampler.batch_size, batch_sampler.drop_last)
            if wrapped
            else watched
        )
        if holder is None:
            kind: KeyKind = SkipKeys(began)
        else:
            stateful = StatefulKeys(holder, watched, self._every)
            stateful.snapshots[at] = holder.state_dict()
            kind = stateful
            if ended:  # every key was handed out: the state loaded is the next epoch's
                watched.ended = True
                return kind, iter(())
        # Fast-forward past the keys after the snapshot (indices only, no sample is fetched),
        # when the first key is asked for: after the epoch's base seed was drawn, as torchdata
        # fast-forwards, so a sampler that draws from torch's global RNG draws what it drew.
        return kind, (self._walk(keys, skip - at, at) if skip > at else keys)

    def _walk(self, keys: Iterator[Any], count: int, first: int) -> Iterator[Any]:
        """``keys`` (from key ``first`` past the start) without their first ``count``, keeping
        those to recover."""
        if not count:
            return keys
        return _skipping(keys, count, self.base + first, self._recover, self.recovered)

    def take_recovered(self) -> dict[int, Any]:
        """The keys recovered so far (see ``recover``), handed over once: the fast-forward is
        made now if it was not yet (the base seed is drawn by then)."""
        if self._recover and not self.recovered:
            self.exhausted()
        recovered, self.recovered = self.recovered, {}
        return recovered

    # -- iteration -----------------------------------------------------------------------------

    def __next__(self) -> tuple[int, Any]:
        if self.drawn_ahead is not None:
            pair, self.drawn_ahead = self.drawn_ahead, None
            return pair
        key = next(self._keys)
        number = self.taken
        self.taken = number + 1
        source = self.source
        if not self._exclude and self._rebase_checked and not source.per_key:
            return number, key  # the common case, on every batch's path
        if not self._rebase_checked:
            self._rebase_checked = True
            self.base += source.rebased(self._skip)
        source.took(self.taken)
        if number not in self._exclude:
            return number, key
        return next(self)

    def exhausted(self) -> bool:
        """Whether no key is left (draws the next one ahead, kept for the next ``next``)."""
        if self.drawn_ahead is not None:
            return False
        try:
            self.drawn_ahead = next(self)
        except StopIteration:
            return True
        return False

    # -- the cursor ----------------------------------------------------------------------------

    def cursor_at(self, count: int) -> KeysCursor:
        """How to start again after the first ``count`` keys of the epoch (with
        ``position=count``)."""
        return self.source.cursor_at(self, count)


_END = object()


def _skipping(
    keys: Iterator[Any],
    count: int,
    first: int = 0,
    wanted: frozenset[int] = frozenset(),
    kept: dict[int, Any] | None = None,
) -> Iterator[Any]:
    """``keys`` without their first ``count``; those numbered (from ``first``) in ``wanted`` are
    kept in ``kept``."""
    for number in range(first, first + count):
        key = next(keys, _END)
        if key is _END:
            return
        if kept is not None and number in wanted:
            kept[number] = key
    yield from keys
