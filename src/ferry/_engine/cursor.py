"""The loader's position: one explicit object, and its plain-data form.

A :class:`Cursor` says where the next batch comes from. The iterator writes it in one place,
where a batch is handed to the user; a fresh epoch is a resume from :meth:`Cursor.zero`. Its
plain form (:func:`to_plain`, :func:`from_plain`) is what ``DataLoader.state_dict()`` returns
and ``load_state_dict()`` takes: JSON-safe, loadable with ``torch.load(weights_only=True)``,
versioned, and checked against the loader it is loaded into. ``docs/design/state.md`` explains
each field and why each edge case resumes exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ferry._engine.keys import KeysCursor
from ferry._engine.rng import ProcessRng, generator_from_state

__all__ = [
    "FORMAT",
    "VERSION",
    "Cursor",
    "LoaderIdentity",
    "WorkerCursor",
    "from_plain",
    "to_plain",
]

FORMAT = "ferry.DataLoader"
VERSION = 1


@dataclass(frozen=True)
class Snapshot:
    """A worker's user-side state, taken every ``snapshot_every_n_steps`` batches.

    ``items``: how many samples its stream had handed out then; ``dataset``/``stream``: what
    ``state_dict()`` of the dataset and of the stream's iterator returned (None: not stateful).
    """

    items: int = 0
    dataset: Any = None
    stream: Any = None


@dataclass(frozen=True)
class WorkerCursor:
    """One worker's position after the last batch the user received from it.

    ``items``: samples its stream has handed out this epoch (iterable-style datasets);
    ``rng``: its process's generators (None: as seeded); ``snapshot``: its last snapshot.
    """

    items: int = 0
    rng: ProcessRng | None = None
    snapshot: Snapshot = field(default_factory=Snapshot)


@dataclass(frozen=True)
class Cursor:
    """Where the loader's next batch comes from.

    ``started``: an epoch is under way (False: the next iterator begins a fresh epoch, whose
    draws come from the generators as restored here). ``base_seed``: the workers' base seed of
    the epoch under way, or of the persistent workers. ``generator``: the loader generator's
    state (after the base seed was drawn, when started). ``keys`` and ``position``: where the
    sampler's keys continue (``position`` keys of the epoch were handed out, plus those in
    ``ahead``, out of order). ``turn``: the worker whose batch comes next (in order).
    ``workers``: each worker's position, for ``num_workers`` workers (0: the main process).
    """

    started: bool = False
    base_seed: int | None = None
    generator: str | None = None
    keys: KeysCursor = field(default_factory=lambda: KeysCursor("skip"))
    position: int = 0
    ahead: frozenset[int] = frozenset()
    turn: int = 0
    num_workers: int = 0
    workers: tuple[WorkerCursor, ...] = ()
    # on_error="skip": samples dropped, and samples seen, over the run so far (the budget).
    skipped: int = 0
    seen: int = 0

    @classmethod
    def zero(cls) -> Cursor:
        """A fresh loader's position: nothing to restore, everything drawn anew."""
        return cls()


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


def to_plain(cursor: Cursor, identity: LoaderIdentity) -> dict[str, Any]:
    keys = cursor.keys
    return {
        "format": FORMAT,
        "version": VERSION,
        "loader": identity.to_plain(),
        "epoch": {
            "started": cursor.started,
            "base_seed": cursor.base_seed,
            "generator": cursor.generator,
            "keys": {
                "kind": keys.kind,
                "start": keys.start,
                "snapshot": keys.snapshot,
                "snapshot_at": keys.snapshot_at,
                "base": keys.base,
            },
            "position": cursor.position,
            "ahead": sorted(cursor.ahead),
            "turn": cursor.turn,
        },
        "errors": {"skipped": cursor.skipped, "seen": cursor.seen},
        "workers": [
            {
                "items": w.items,
                "rng": None if w.rng is None else w.rng.to_plain(),
                "snapshot": {
                    "items": w.snapshot.items,
                    "dataset": w.snapshot.dataset,
                    "stream": w.snapshot.stream,
                },
            }
            for w in cursor.workers
        ],
    }


def from_plain(state: Any, identity: LoaderIdentity) -> Cursor:
    """The cursor a state describes, checked against the loader it is loaded into.

    Raises ValueError naming what differs (or what is malformed).
    """
    if not isinstance(state, dict):
        raise ValueError(
            f"DataLoader.load_state_dict expects the dict that state_dict() returned, got "
            f"{type(state).__name__}"
        )
    if state.get("format") != FORMAT:
        raise ValueError(
            f"this is not a ferry DataLoader state: its 'format' is {state.get('format')!r}, "
            f"expected {FORMAT!r} (a state from torchdata's StatefulDataLoader, or from another "
            "object, cannot be loaded)"
        )
    if state.get("version") != VERSION:
        raise ValueError(
            f"DataLoader state version {state.get('version')!r} is not supported by this ferry, "
            f"which reads version {VERSION}"
        )
    try:
        saved = state["loader"]
        _check_identity(saved, identity)
        epoch = state["epoch"]
        keys = epoch["keys"]
        workers = tuple(
            WorkerCursor(
                int(w["items"]),
                None if w["rng"] is None else ProcessRng.from_plain(w["rng"]),
                Snapshot(
                    int(w["snapshot"]["items"]), w["snapshot"]["dataset"], w["snapshot"]["stream"]
                ),
            )
            for w in state["workers"]
        )
        cursor = Cursor(
            started=bool(epoch["started"]),
            base_seed=None if epoch["base_seed"] is None else int(epoch["base_seed"]),
            generator=epoch["generator"],
            keys=KeysCursor(
                keys["kind"],
                keys["start"],
                keys["snapshot"],
                int(keys["snapshot_at"]),
                int(keys["base"]),
            ),
            position=int(epoch["position"]),
            ahead=frozenset(int(n) for n in epoch["ahead"]),
            turn=int(epoch["turn"]),
            num_workers=int(saved["num_workers"]),
            workers=workers,
            # (absent from states saved before on_error existed)
            skipped=int(state.get("errors", {}).get("skipped", 0)),
            seen=int(state.get("errors", {}).get("seen", 0)),
        )
        _check_generator_states(cursor)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise ValueError(
            f"DataLoader state is malformed ({type(exc).__name__}: {exc}); pass the dict that "
            "state_dict() returned, unchanged apart from a json or torch.save round trip"
        ) from None
    if cursor.keys.kind not in ("builtin", "stateful", "skip", "stream"):
        raise ValueError(f"DataLoader state has an unknown sampler kind {cursor.keys.kind!r}")
    if cursor.position < 0 or len(cursor.workers) not in (0, max(cursor.num_workers, 1)):
        raise ValueError("DataLoader state is malformed: its position or worker list is invalid")
    return cursor


def _check_generator_states(cursor: Cursor) -> None:
    """Raise now, not at the next ``iter()``, if a generator state in ``cursor`` is unusable."""
    states = [cursor.generator]
    start = cursor.keys.start
    if start is not None:
        if not isinstance(start, dict):
            raise TypeError(f"the sampler's start must be a dict, got {type(start).__name__}")
        states.append(start.get("generator"))
        if "seed" in start and not isinstance(start["seed"], int):
            raise TypeError(f"the sampler's seed must be an int, got {start['seed']!r}")
    for state in states:
        if state is not None:
            if not isinstance(state, str):
                raise TypeError(f"a generator state must be a string, got {type(state).__name__}")
            generator_from_state(state)
    size = torch.get_rng_state().numel()
    if any(w.rng is not None and len(w.rng.torch_state) != size for w in cursor.workers):
        raise ValueError("a worker's torch generator state has the wrong size")


def _check_identity(saved: dict[str, Any], identity: LoaderIdentity) -> None:
    here = identity.to_plain()
    differences = [
        f"{name}: the state has {saved.get(name)!r}, this loader has {here[name]!r}"
        for name in (
            "dataset",
            "dataset_length",
            "batch_size",
            "drop_last",
            "sampler",
            "batch_sampler",
        )
        if saved.get(name) != here[name]
    ]
    if differences:
        raise ValueError(
            "DataLoader state does not fit this loader: it was saved from a loader with other "
            "data or options (" + "; ".join(differences) + "). Build the loader as it was "
            "when the state was saved."
        )
