"""Datasets and samplers of the resume tests.

Everything here is module level so spawn and forkserver workers can unpickle it (by reference
to ``resume.datasets``). Datasets that count what they produce keep their counters on the
object: with thread workers (or ``num_workers=0``) the test reads them directly.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

try:
    import numpy as np
except ImportError:  # the run without numpy (make test-nonumpy): no numpy draw
    np = None  # type: ignore[assignment]
import torch

import ferry

# -- map-style datasets --------------------------------------------------------------------------


class Ints(ferry.Dataset[int]):
    """Map-style: plain ints, ``10 * index + 3`` (deterministic)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return 10 * index + 3


class Augmented(ferry.Dataset[tuple[int, float, float, float]]):
    """Map-style: the index with a random "augmentation" from each global generator (torch,
    ``random``, numpy's legacy one), as a transform in ``__getitem__`` would draw them."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[int, float, float, float]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        drawn = 0.0 if np is None else float(np.random.rand())
        return (index, torch.rand(()).item(), random.random(), drawn)


class Counted(ferry.Dataset[tuple[int, int]]):
    """Map-style: ``(index, fetches before this one)``, with a state of its own
    (``state_dict`` on the dataset): how many samples this copy of the dataset fetched."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.fetched = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[int, int]:
        self.fetched += 1
        return (index, self.fetched - 1)

    def state_dict(self) -> dict[str, Any]:
        return {"fetched": self.fetched}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fetched = state["fetched"]


GATE = threading.Event()
""":class:`Gated` holds index 0 until this is set (thread workers only)."""


class Gated(Ints):
    """Map-style :class:`Ints` whose index 0 waits (up to 10 s) for :data:`GATE`."""

    def __getitem__(self, index: int) -> int:
        if index == 0:
            GATE.wait(10)
        return super().__getitem__(index)


class Huge(ferry.Dataset[int]):
    """Map-style: ``n`` samples (the index), nothing stored per sample."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


# -- user samplers -------------------------------------------------------------------------------


class FixedOrder(ferry.Sampler[int]):
    """A user's sampler with no state: the same order every epoch (odd indices descending,
    then even ones ascending). Resumes by skipping indices."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        odd = [i for i in range(self.n) if i % 2][::-1]
        even = [i for i in range(self.n) if not i % 2]
        return iter(odd + even)

    def __len__(self) -> int:
        return self.n


def _permutation(n: int, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed * 1000 + epoch)
    return [int(i) for i in torch.randperm(n, generator=generator)]


class StatefulShuffler(ferry.Sampler[int]):
    """A user's stateful sampler (state on the sampler object, torchdata style): a new
    permutation each epoch, from its seed and its epoch counter.

    ``state_dict`` gives (seed, epoch, keys yielded this epoch); after ``load_state_dict`` the
    next ``iter()`` continues that epoch. ``loads`` records the states loaded and
    ``state_calls`` counts ``state_dict`` calls.
    """

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed
        self.epoch = 0
        self.yielded = 0
        self._resume = False
        self.loads: list[dict[str, Any]] = []
        self.state_calls = 0

    def __iter__(self) -> Iterator[int]:
        order = _permutation(self.n, self.seed, self.epoch)
        start = self.yielded if self._resume else 0
        self._resume = False
        self.yielded = start
        for index in order[start:]:
            self.yielded += 1
            yield index
        self.epoch += 1
        self.yielded = 0

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, Any]:
        self.state_calls += 1
        return {"seed": self.seed, "epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loads.append(dict(state))
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        self.yielded = state["yielded"]
        self._resume = True


class _ShufflerIterator:
    """The iterator of :class:`IterStatefulShuffler`: the state lives here."""

    def __init__(self, owner: IterStatefulShuffler) -> None:
        self.owner = owner
        self.order = _permutation(owner.n, owner.seed, owner.epoch)
        self.yielded = 0
        self.done = False

    def __iter__(self) -> _ShufflerIterator:
        return self

    def __next__(self) -> int:
        if self.yielded >= len(self.order):
            if not self.done:
                self.done = True
                self.owner.epoch += 1
            raise StopIteration
        index = self.order[self.yielded]
        self.yielded += 1
        return index

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.owner.epoch - self.done, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.owner.epoch = state["epoch"]
        self.order = _permutation(self.owner.n, self.owner.seed, state["epoch"])
        self.yielded = state["yielded"]
        self.done = False


class IterStatefulShuffler(ferry.Sampler[int]):
    """A user's sampler whose *iterator* has ``state_dict``/``load_state_dict`` (the sampler
    object has none): a new permutation each epoch."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed
        self.epoch = 0

    def __iter__(self) -> Iterator[int]:
        return _ShufflerIterator(self)

    def __len__(self) -> int:
        return self.n


# -- iterable-style datasets ---------------------------------------------------------------------


def _my_share(n: int) -> range:
    """The items of ``range(n)`` the calling worker reads (every one in the main process)."""
    info = ferry.get_worker_info()
    if info is None:
        return range(n)
    return range(info.id, n, info.num_workers)


class Stream(ferry.IterableDataset[int]):
    """A stateless stream of ``range(n)`` (sharded over workers by ``get_worker_info``).
    ``produced`` lists every item its iterators made (thread workers / main process)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.produced: list[int] = []

    def __iter__(self) -> Iterator[int]:
        for item in _my_share(self.n):
            self.produced.append(item)
            yield item


class _StatefulStreamIterator:
    def __init__(self, owner: StatefulStream) -> None:
        self.owner = owner
        self.items = list(_my_share(owner.n))
        self.offset = 0

    def __iter__(self) -> _StatefulStreamIterator:
        return self

    def __next__(self) -> int:
        if self.offset >= len(self.items):
            raise StopIteration
        item = self.items[self.offset]
        self.offset += 1
        self.owner.produced.append(item)
        return item

    def state_dict(self) -> dict[str, Any]:
        return {"offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.owner.loads.append(dict(state))
        self.offset = state["offset"]


class StatefulStream(ferry.IterableDataset[int]):
    """A stream of ``range(n)`` whose iterator has ``state_dict``/``load_state_dict``: it
    resumes by seeking, without making the items before the resume point again."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.produced: list[int] = []
        self.loads: list[dict[str, Any]] = []

    def __iter__(self) -> Iterator[int]:
        return _StatefulStreamIterator(self)


class PositionedStream(ferry.IterableDataset[int]):
    """A stream of ``range(n)`` with its state on the dataset object: where its current
    iteration stands; after ``load_state_dict`` the next ``iter()`` starts there."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.position = 0
        self._start: int | None = None
        self.produced: list[int] = []

    def __iter__(self) -> Iterator[int]:
        items = list(_my_share(self.n))
        start, self._start = (self._start or 0), None
        self.position = start
        for item in items[start:]:
            self.position += 1
            self.produced.append(item)
            yield item

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._start = state["position"]


SHARDS = 4
SHARD_SIZE = 5


class _ShardIterator:
    """Reads the shards of its worker one after another; its state: ``{shard: offset}`` for
    those shards. ``load_state_dict`` takes the offsets of *all* shards and keeps its own (a
    shard missing from it starts from the beginning)."""

    def __init__(self) -> None:
        info = ferry.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        self.shards = [s for s in range(SHARDS) if s % workers == worker]
        self.offsets = {f"shard{s}": 0 for s in self.shards}

    def __iter__(self) -> _ShardIterator:
        return self

    def __next__(self) -> int:
        for shard in self.shards:
            name = f"shard{shard}"
            if self.offsets[name] < SHARD_SIZE:
                item = shard * 100 + self.offsets[name]
                self.offsets[name] += 1
                return item
        raise StopIteration

    def state_dict(self) -> dict[str, int]:
        return dict(self.offsets)

    def load_state_dict(self, state: dict[str, int]) -> None:
        for name in self.offsets:
            self.offsets[name] = state.get(name, 0)  # a shard nobody read yet: from its start


class ShardedStream(ferry.IterableDataset[int]):
    """``SHARDS`` shards of ``SHARD_SIZE`` items, split over workers, with per-shard state
    (``state_per_shard = True``): resumable with another number of workers."""

    state_per_shard = True

    def __iter__(self) -> Iterator[int]:
        return _ShardIterator()


def all_shard_items() -> list[int]:
    return [s * 100 + j for s in range(SHARDS) for j in range(SHARD_SIZE)]
