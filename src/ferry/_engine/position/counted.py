"""Datasets whose ``state_dict`` is not torchdata's: those resumed from a count of samples.

torchdata's protocol, which ferry follows for a dataset and its stream, is ``state_dict()``
with no argument, asked where the dataset iterates (each worker). Some datasets have a method
of that name that takes arguments, and torch's loader, which never calls it, iterates them
all the same. :func:`judge_dataset` tells them apart once, when the loader first needs to:

* **torchdata's protocol** (:func:`snapshots_itself`): the worker takes the state (see
  :mod:`ferry._engine.position.keeper`);
* **a count of samples** (:class:`CountedProtocol`): MosaicML Streaming's and litdata's
  ``StreamingDataset``. Their position is how many samples the training loop consumed this
  epoch: their own loaders count them, ask the dataset in the main process for a state built
  from that count, and hand it back to the dataset before the next iteration, whose workers
  then deal out only the rest of the epoch. ferry does the same from its cursor (the samples
  each worker's stream handed out, up to the last batch the user received), keeps the state
  in its own (:class:`DatasetPosition`, JSON-safe) and loads it at ``load_state_dict``.
  They are recognized by the names of ``state_dict``'s parameters, which are their documented
  protocol, so neither library is imported;
* **anything else**: iterated as torch's loader does, with one warning saying what a resume
  does (the dataset is treated as one without state).
"""

from __future__ import annotations

import inspect
import math
import pickle
from dataclasses import dataclass, replace
from typing import Any

from ferry._core.stateful import has_state_methods
from ferry._engine.position.cursor import Cursor, Snapshot
from ferry.errors import MalformedState, StateMismatch, warn_from_user_code

__all__ = [
    "CountedProtocol",
    "DatasetPosition",
    "judge_dataset",
    "snapshots_itself",
    "own_copies",
]

_PLAIN = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _required(method: Any) -> list[str] | None:
    """The parameters ``method`` cannot be called without (None: its signature is unknown)."""
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):
        return None
    return [
        name
        for name, p in signature.parameters.items()
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]


def snapshots_itself(obj: object) -> bool:
    """Whether ``obj`` follows torchdata's Stateful protocol: ``load_state_dict`` and a
    ``state_dict`` that can be called without arguments."""
    return has_state_methods(obj) and not _required(obj.state_dict)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class CountedProtocol:
    """How one library builds its dataset's state from the samples consumed.

    ``parameters``: ``state_dict``'s parameter names, in order, by which it is recognized;
    ``restart_turn``: after a load the library deals the rest of the epoch out again from
    worker 0 (MosaicML), rather than going on with each worker's own share (litdata), so the
    loader's round-robin starts again at worker 0 too; ``forget``: the dataset's method that
    drops a loaded state, called when the next epoch begins (litdata keeps it on the dataset,
    which each epoch's workers copy, and its own loader calls it so; MosaicML knows a state
    from an epoch gone by itself).
    """

    library: str
    parameters: tuple[str, ...]
    restart_turn: bool
    forget: str | None

    def save(self, dataset: Any, cursor: Cursor, batch_size: int | None) -> DatasetPosition:
        """The dataset's own state at ``cursor`` (each worker's stream count, up to the last
        batch the user received), asked for as the library's own loader asks."""
        size = batch_size or 1
        if self.parameters[0] == "num_samples":  # MosaicML: the samples, from the epoch's start
            samples = sum(w.items for w in cursor.workers)
            return DatasetPosition(self.library, dataset.state_dict(samples, True), True)
        # litdata deals the count out over the workers in turn, a batch of the size the dataset
        # was told (set_batch_size, which its own loader calls) at a time, and counts a
        # batch slot for each batch. Told another size (torch's loader tells it none), it
        # shares the epoch out otherwise, and no count describes where each worker is: the
        # state then holds the epoch (and what the library checks) and ferry's cursor the
        # position, each worker reading and dropping what it had handed out.
        told = getattr(dataset, "batch_size", None)
        if told == size:
            slots = sum(math.ceil(w.items / size) * size for w in cursor.workers)
            state = dataset.state_dict(slots, cursor.num_workers, size)
            return DatasetPosition(self.library, state, True)
        told = told if isinstance(told, int) else size
        state = dataset.state_dict(0, cursor.num_workers, told)
        return DatasetPosition(self.library, state, False)

    def settle(self, cursor: Cursor, counted: bool) -> Cursor:
        """``cursor`` once the dataset was given its state. ``counted``: the state holds the
        position, so each worker's stream goes on from there and reads nothing again (each
        keeps its count of samples: the next save counts from the epoch's start)."""
        if not counted:
            return cursor
        workers = tuple(replace(w, snapshot=Snapshot(w.items)) for w in cursor.workers)
        return replace(cursor, workers=workers, turn=0 if self.restart_turn else cursor.turn)


PROTOCOLS = (
    CountedProtocol("MosaicML Streaming", ("num_samples", "from_beginning"), True, None),
    CountedProtocol(
        "litdata", ("num_samples_yielded", "num_workers", "batch_size"), False, "reset_state_dict"
    ),
)


def _recognize(dataset: object) -> CountedProtocol | None:
    try:
        signature = inspect.signature(dataset.state_dict)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        return None
    names = tuple(name for name, p in signature.parameters.items() if p.kind in _PLAIN)
    for protocol in PROTOCOLS:
        if names == protocol.parameters:
            return protocol
    return None


@dataclass(frozen=True)
class DatasetVerdict:
    """What the loader does with a dataset's own state (see the module docstring)."""

    counted: CountedProtocol | None = None


def judge_dataset(dataset: object) -> DatasetVerdict:
    """How ``dataset``'s own state is taken; warns once (this is called once per loader) when
    it has a ``state_dict`` that neither protocol can call."""
    if not has_state_methods(dataset) or snapshots_itself(dataset):
        return DatasetVerdict()
    counted = _recognize(dataset)
    if counted is not None:
        return DatasetVerdict(counted)
    required = _required(dataset.state_dict)  # type: ignore[attr-defined]
    name = type(dataset).__name__
    warn_from_user_code(
        f"{name}.state_dict() cannot be called without arguments (it requires "
        f"{', '.join(map(repr, required or []))}), so ferry takes no state of the dataset "
        "(torchdata's protocol calls state_dict() with none) and iterates it as torch's "
        f"DataLoader does. loader.state_dict() still works: at load_state_dict, {name} is "
        "not given a state of its own; the sampler's keys go on where they were (map-style), "
        "or each worker's stream starts again and skips the samples already delivered "
        "(iterable-style). Give the dataset state_dict()/load_state_dict() without "
        "arguments to have its state kept.",
        UserWarning,
    )
    return DatasetVerdict()


def own_copies(dataset: object, count: int) -> list[Any] | None:
    """``count`` copies of a counted dataset, one for each thread worker (None: the dataset is
    not counted, and thread workers share it).

    Both libraries keep an iteration's state on the dataset object (litdata's ``__iter__``
    returns the dataset itself), which process workers each have a copy of and thread workers
    would share: each thread is given the copy a spawned process would get (a pickle round
    trip, made when the workers start, after any ``load_state_dict``). They find their worker
    with torch's ``get_worker_info``, which answers in ferry's threads once
    :func:`ferry._core.info.publish_threads_to_torch` has run. Other datasets are shared, as
    thread workers share them.
    """
    counted = _recognize(dataset) if has_state_methods(dataset) else None
    if counted is None or snapshots_itself(dataset):
        return None
    try:
        return [pickle.loads(pickle.dumps(dataset)) for _ in range(count)]
    except Exception as exc:
        raise RuntimeError(
            f"worker_type='thread' needs a copy of {type(dataset).__name__} ({counted.library}) "
            "for each thread (it keeps each iteration's position on the dataset object), and "
            f"pickling it failed: {type(exc).__name__}: {exc}. Use worker_type='process' (the "
            "default) or num_workers=0."
        ) from exc


@dataclass(frozen=True)
class DatasetPosition:
    """The state a counted dataset gave, kept in the loader's. ``counted``: it holds the
    position too (see :meth:`CountedProtocol.save`)."""

    library: str
    state: Any
    counted: bool

    def to_plain(self) -> dict[str, Any]:
        return {"library": self.library, "state": self.state, "counted": self.counted}

    @classmethod
    def from_plain(cls, plain: Any) -> DatasetPosition | None:
        if plain is None:
            return None
        if not isinstance(plain, dict) or not isinstance(plain.get("library"), str):
            raise MalformedState(
                "DataLoader state is malformed: its 'dataset_position' is not what "
                "state_dict() wrote"
            )
        return cls(plain["library"], plain.get("state"), bool(plain.get("counted")))

    def load(self, dataset: Any, verdict: DatasetVerdict, cursor: Cursor) -> Cursor:
        """Hand the state back to ``dataset`` (the library's ``load_state_dict``, in the main
        process, before any worker starts, as its own loader does); ``cursor`` settled."""
        counted = verdict.counted
        if counted is None or counted.library != self.library:
            raise StateMismatch(
                f"DataLoader state does not fit this loader: it holds a {self.library} "
                f"dataset's position, and this loader's dataset is a {type(dataset).__name__}"
                + ("" if counted is None else f" ({counted.library})")
            )
        dataset.load_state_dict(self.state)
        return counted.settle(cursor, self.counted)
