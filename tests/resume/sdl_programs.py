"""One user program, run through torchdata's ``StatefulDataLoader`` (SDL) or ``ferry.DataLoader``.

The program (:func:`run`): build a loader A, run ``epochs`` epochs
(``for epoch in range(E): for batch in loader: ...``) and, at a save point, take
``A.state_dict()`` (deep-copied, as a checkpoint is) with the user's own epoch counter. Then, as
a new process would, build a fresh loader B the same way, ``B.load_state_dict(state)`` and go on
from the saved epoch counter to the end: ``for batch in B`` for the interrupted epoch (which may
yield nothing), then the remaining epochs. With a relay, B's state is taken again right after the
load (before or right after ``iter(B)``) and a third loader C resumes from it.

What the program saw is an :class:`Outcome`: per epoch, the batches loader A handed out and
those B handed out (``None``: that loader did not run in that epoch), as plain python lists, and
C's epochs for a relay. :func:`uninterrupted` is the program with no save point.

Every loader is built right after ``torch.manual_seed(GLOBAL_SEED)``, as a script that seeds at
its start does in every process that runs it: the global generator stands the same when either
library builds any loader of the program.

Datasets are module level (process workers unpickle them by reference to this module) and
written against torch's base classes (``ferry.DataLoader`` takes them as it takes any torch
dataset). Iterable datasets shard by worker with ``torch.utils.data.get_worker_info()`` (set by
SDL's workers and ferry's process workers, answered per thread for ferry's thread workers),
falling back to ``ferry.get_worker_info()``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.data as tud
from torchdata.stateful_dataloader import StatefulDataLoader

import ferry
from _support.compare import seed_cpu

GLOBAL_SEED = 1234
SAMPLER_SEED = 7
LOADER_SEED = 11

# -- sharding ------------------------------------------------------------------------------------


def worker_share(n: int) -> list[int]:
    """The items of ``range(n)`` the calling worker reads (every one in the main process)."""
    info = tud.get_worker_info() or ferry.get_worker_info()
    if info is None:
        return list(range(n))
    return list(range(info.id, n, info.num_workers))


# -- map-style datasets --------------------------------------------------------------------------


class Plain(tud.Dataset[int]):
    """Map-style: returns its index."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return index


class Counting(tud.Dataset[tuple[int, int, int]]):
    """Map-style with a state of its own (``state_dict`` on the dataset, e.g.
    ``{'i': 0, 'epoch': 1}``): ``i`` counts the samples this copy fetched in its current round
    of ``len(self)`` fetches, ``epoch`` the rounds it completed. A sample is
    ``(index, epoch, i)`` as they stood before the fetch: it shows the state it was made with."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.i = 0
        self.epoch = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[int, int, int]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        sample = (index, self.epoch, self.i)
        self.i += 1
        if self.i == self.n:
            self.i, self.epoch = 0, self.epoch + 1
        return sample

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]
        self.epoch = state["epoch"]


# -- iterable-style datasets ---------------------------------------------------------------------


class Stream(tud.IterableDataset[int]):
    """A generator-based stream of ``range(n)`` with no state (sharded by worker): a resume
    fast-forwards it by reading."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        yield from worker_share(self.n)


class _StreamIterator:
    def __init__(self, n: int) -> None:
        self.items = worker_share(n)
        self.offset = 0

    def __iter__(self) -> _StreamIterator:
        return self

    def __next__(self) -> int:
        if self.offset >= len(self.items):
            raise StopIteration
        self.offset += 1
        return self.items[self.offset - 1]

    def state_dict(self) -> dict[str, int]:
        return {"offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.offset = state["offset"]


class IterStateful(tud.IterableDataset[int]):
    """A stream of ``range(n)`` whose *iterator* (a separate object) has
    ``state_dict``/``load_state_dict``; the dataset object has none."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return _StreamIterator(self.n)


class SelfIter(tud.IterableDataset[int]):
    """An IterableDataset that is its own iterator: ``__iter__`` sets up the pass (its items
    and position: attributes ``__init__`` does not create) and returns ``self``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> SelfIter:
        self.items = worker_share(self.n)
        self.pos = 0
        return self

    def __next__(self) -> int:
        if self.pos >= len(self.items):
            raise StopIteration
        self.pos += 1
        return self.items[self.pos - 1]

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


class SelfIterLate(SelfIter):
    """:class:`SelfIter` whose ``load_state_dict`` uses what only ``__iter__`` creates (it
    checks the position against the pass's items): it works only after ``__iter__``, which is
    the order torchdata restores in (dataset state, ``iter(dataset)``, iterator state)."""

    def load_state_dict(self, state: dict[str, int]) -> None:
        if not 0 <= state["pos"] <= len(self.items):  # AttributeError before __iter__
            raise ValueError(f"position {state['pos']} is out of range")
        self.pos = state["pos"]


MAP_DATASETS: dict[str, type[Any]] = {"plain": Plain, "counting": Counting}
ITERABLE_DATASETS: dict[str, type[Any]] = {
    "stream": Stream,
    "iter_stateful": IterStateful,
    "self_iter": SelfIter,
    "self_iter_late": SelfIterLate,
}

TORCH_RANDOM = ("torch_random", "torch_random_gen")
"""Samplers that are torch's own ``RandomSampler`` objects (no ``state_dict``)."""


# -- configurations ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """How the program builds its loaders (the same in both libraries, but for ``"thread"``:
    ferry's ``worker_type="thread"``, SDL's process workers).

    ``sampler``: ``"default"`` (``shuffle=False``); ``"torch_random"``
    (``sampler=torch.utils.data.RandomSampler(ds)``, generator None); ``"torch_random_gen"``
    (the same with its own seeded generator); ``"shuffle_gen"`` (``shuffle=True`` and a seeded
    loader ``generator``).
    """

    dataset: str
    sampler: str = "default"
    batch_size: int | None = 3
    drop_last: bool = False
    workers: str = "none"  # "none", "process", "persistent", "thread" or "thread_persistent"
    snapshot: int = 1  # snapshot_every_n_steps
    epochs: int = 3
    n: int = 10
    shared: bool = False  # loaders B and C use loader A's dataset object

    @property
    def iterable(self) -> bool:
        return self.dataset in ITERABLE_DATASETS

    def __str__(self) -> str:
        batching = f"bs{self.batch_size}" + ("-drop" if self.drop_last else "")
        parts = [self.dataset, self.sampler, batching, f"w-{self.workers}", f"snap{self.snapshot}"]
        parts += [f"E{self.epochs}", f"n{self.n}"]
        if self.shared:
            parts.append("shared")
        return "-".join(parts)


@dataclass(frozen=True)
class SavePoint:
    """Where the program saves, in epoch ``epoch``:

    * ``after_iter``: right after ``it = iter(loader)``, before the first batch (``it`` alive);
    * ``mid``: after ``k`` batches (``k=-1``: half the epoch's batches, rounded up);
    * ``last``: after the last batch, still inside the ``for`` loop (StopIteration not seen);
    * ``after_loop``: after the ``for`` loop over the epoch ended, before the next ``iter()``
      (the epoch is done: the user's epoch counter saved is ``epoch + 1``).

    ``relay``: B's state is taken again right after ``B.load_state_dict``
    (``"before_iter"``) or right after ``iter(B)``, before its first batch (``"after_iter"``),
    and a third loader C resumes the program from it.
    """

    kind: str
    epoch: int
    k: int = 0
    relay: str | None = None

    def __str__(self) -> str:
        text = f"{self.kind}@{self.epoch}"
        if self.kind == "mid":
            text += f"k{'mid' if self.k < 0 else self.k}"
        if self.relay:
            text += f"+relay_{self.relay}"
        return text


KINDS = ("after_iter", "mid", "last", "after_loop", "relay")


def save_points(kind: str, epochs: int) -> list[SavePoint]:
    """The save points of one kind, at every epoch of a program of ``epochs`` epochs."""
    points = []
    for epoch in range(epochs):
        if kind == "mid":
            points += [SavePoint("mid", epoch, 1), SavePoint("mid", epoch, -1)]
        elif kind == "relay":
            for base, k in (("mid", 1), ("last", 0), ("after_loop", 0)):
                for relay in ("before_iter", "after_iter"):
                    points.append(SavePoint(base, epoch, k, relay))
        else:
            points.append(SavePoint(kind, epoch))
    return points


# -- building ------------------------------------------------------------------------------------


def make_dataset(setup: Setup) -> Any:
    kinds = {**MAP_DATASETS, **ITERABLE_DATASETS}
    return kinds[setup.dataset](setup.n)


def build(lib: str, setup: Setup, dataset: Any = None) -> Any:
    """The program's loader in ``lib`` (``"sdl"`` or ``"ferry"``), built right after
    ``torch.manual_seed(GLOBAL_SEED)`` (its CPU part: :func:`_support.compare.seed_cpu`), with a
    fresh dataset unless one is given."""
    seed_cpu(GLOBAL_SEED)
    if dataset is None:
        dataset = make_dataset(setup)
    kwargs: dict[str, Any] = {
        "batch_size": setup.batch_size,
        "drop_last": setup.drop_last,
        "snapshot_every_n_steps": setup.snapshot,
    }
    if setup.sampler == "torch_random":
        kwargs["sampler"] = tud.RandomSampler(dataset)
    elif setup.sampler == "torch_random_gen":
        generator = torch.Generator().manual_seed(SAMPLER_SEED)
        kwargs["sampler"] = tud.RandomSampler(dataset, generator=generator)
    elif setup.sampler == "shuffle_gen":
        kwargs["shuffle"] = True
        kwargs["generator"] = torch.Generator().manual_seed(LOADER_SEED)
    if setup.workers != "none":
        kwargs["num_workers"] = 2
        kwargs["persistent_workers"] = setup.workers.endswith("persistent")
        if lib == "ferry" and setup.workers.startswith("thread"):
            kwargs["worker_type"] = "thread"
        else:
            kwargs["multiprocessing_context"] = "fork"
    if lib == "sdl":
        return StatefulDataLoader(dataset, **kwargs)
    return ferry.DataLoader(dataset, **kwargs)


def plain(value: Any) -> Any:
    """A batch as plain python data (tensors as lists)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def release(loader: Any) -> None:
    """The program is done with ``loader``: its workers stop now."""
    iterator = loader._iterator
    loader._iterator = None
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:  # SDL's process workers
        shutdown()


# -- running the program -------------------------------------------------------------------------

Epochs = list[list[Any] | None]


@dataclass
class Outcome:
    """What the program saw, per epoch: ``before[e]`` from loader A, ``after[e]`` from the
    resumed loader B (``None``: that loader did not run in epoch ``e``), and, with a relay,
    ``relay[e]``: what loader C handed out in B's stead."""

    before: Epochs
    after: Epochs
    relay: Epochs | None = None

    def whole(self, resumed: Epochs | None = None) -> list[list[Any]]:
        """Each epoch's batches, whichever loader handed them out (``resumed`` in B's place)."""
        resumed = self.after if resumed is None else resumed
        return [(b or []) + (a or []) for b, a in zip(self.before, resumed, strict=True)]

    def shape(self) -> tuple[Any, ...]:
        """How many batches each loader handed out in each epoch (None: it did not run)."""

        def sizes(epochs: Epochs | None) -> Any:
            return None if epochs is None else [None if e is None else len(e) for e in epochs]

        return sizes(self.before), sizes(self.after), sizes(self.relay)


def run_epochs(loader: Any, first: int, epochs: int, into: Epochs) -> None:
    for epoch in range(first, epochs):
        into[epoch] = [plain(batch) for batch in loader]


_UNINTERRUPTED: dict[tuple[str, Setup], Outcome] = {}


def uninterrupted(lib: str, setup: Setup) -> Outcome:
    """The program run without a save point (cached: it is deterministic)."""
    key = (lib, setup)
    if key not in _UNINTERRUPTED:
        loader = build(lib, setup)
        before: Epochs = [None] * setup.epochs
        try:
            run_epochs(loader, 0, setup.epochs, before)
        finally:
            release(loader)
        _UNINTERRUPTED[key] = Outcome(before, [None] * setup.epochs)
    return copy.deepcopy(_UNINTERRUPTED[key])


def batches_before_save(lib: str, setup: Setup, point: SavePoint) -> int:
    """How many batches of its epoch the program takes before saving at ``point``."""
    length = len(uninterrupted(lib, setup).before[point.epoch] or [])
    if point.kind == "mid":
        return (length + 1) // 2 if point.k < 0 else min(point.k, length)
    if point.kind == "last":
        return length
    return 0


def run(lib: str, setup: Setup, point: SavePoint) -> Outcome:
    """The program with a save point at ``point`` (see the module docstring)."""
    epochs = setup.epochs
    before: Epochs = [None] * epochs
    after: Epochs = [None] * epochs
    take = batches_before_save(lib, setup, point)
    alive: list[Any] = []  # the shared case: A and its iterator live on, as in a notebook

    # Loader A, up to the save point.
    a = build(lib, setup)
    try:
        run_epochs(a, 0, point.epoch, before)
        seen: list[Any] = []
        before[point.epoch] = seen
        counter = point.epoch
        if point.kind == "after_loop":
            seen += [plain(batch) for batch in a]
            state = a.state_dict()
            counter += 1
        else:
            it = iter(a)
            for _ in range(take):
                seen.append(plain(next(it)))
            state = a.state_dict()
            if setup.shared:
                alive.append(it)
            del it
        state = copy.deepcopy(state)
    finally:
        if setup.shared:
            alive.append(a)
        else:
            release(a)
    dataset = a.dataset if setup.shared else None
    del a

    # Loader B: a fresh one (on A's dataset object in the shared case) loads the state.
    relay_state = None
    b = build(lib, setup, dataset)
    try:
        b.load_state_dict(copy.deepcopy(state))
        if point.relay == "before_iter":
            relay_state = copy.deepcopy(b.state_dict())
        if point.relay == "after_iter":
            it = iter(b)
            relay_state = copy.deepcopy(b.state_dict())
            if counter < epochs:
                after[counter] = [plain(batch) for batch in it]
            del it
            run_epochs(b, counter + 1, epochs, after)
        else:
            run_epochs(b, counter, epochs, after)
    finally:
        release(b)
    del b
    outcome = Outcome(before, after)

    # Loader C resumes from B's state.
    if relay_state is not None:
        c = build(lib, setup, dataset)
        outcome.relay = [None] * epochs
        try:
            c.load_state_dict(relay_state)
            run_epochs(c, counter, epochs, outcome.relay)
        finally:
            release(c)
    for loader in alive[-1:]:
        release(loader)
    return outcome
