"""Datasets of :mod:`workers.test_restarts` (``max_worker_restarts``) and
:mod:`workers.test_stall` (``stall_warning``).

Module level, so that process workers can unpickle them under any start method (by reference
to ``workers.restart_datasets``). Every sample carries its index (or stream item) and a random
"augmentation" drawn from each global generator a transform would use (torch, numpy's legacy
one, Python's ``random``), so comparing two runs checks the order *and* the random draws.

A dataset can end its own worker process at some indices or items (``die_at``): it dies at
each the first time only, remembered by a marker file per index (``marker`` is their common
prefix; :func:`trip` creates the file atomically), so the replacement worker fetches the same
index and lives. ``arm``, when given, is a file that must exist before a wire trips: the test
creates it to choose the epoch.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import random
import signal
import time
from collections.abc import Collection, Iterator
from typing import Any

try:
    import numpy as np
except ImportError:  # the run without numpy (make test-nonumpy): no numpy draw
    np = None  # type: ignore[assignment]
import torch

import ferry

# -- dying on purpose ----------------------------------------------------------------------------

HOW = ("kill", "segv", "abort")
"""Ways :func:`die` ends the process: SIGKILL (as the OOM killer does), a segfault, abort()."""


def die(how: str) -> None:
    """End this process at once, without any cleanup, as ``how`` says (see :data:`HOW`)."""
    faulthandler.disable()  # (else pytest's handler prints every thread's stack to stderr)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "segv":
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    elif how == "abort":
        os.abort()
    raise AssertionError(f"die({how!r}) returned")


def trip(marker: str | None, index: int, die_at: Collection[int], arm: str | None) -> bool:
    """Whether ``index`` is one of ``die_at`` met for the first time (after ``arm`` exists,
    if given): the file ``{marker}.{index}`` is created then, so later calls, in any process,
    answer False."""
    if index not in die_at or marker is None:
        return False
    if arm is not None and not os.path.exists(arm):
        return False
    try:
        with open(f"{marker}.{index}", "x"):
            return True
    except FileExistsError:
        return False


def augmentation() -> tuple[torch.Tensor, float, float]:
    """One random draw from each global generator, as a transform would make them."""
    return torch.rand(3), 0.0 if np is None else float(np.random.rand()), random.random()


def shard(n: int) -> range:
    """The items of ``range(n)`` the calling worker reads (every one in the main process)."""
    info = ferry.get_worker_info()
    if info is None:
        return range(n)
    return range(info.id, n, info.num_workers)


# -- map-style -----------------------------------------------------------------------------------


class Augmented(ferry.Dataset[tuple[int, torch.Tensor, float, float]]):
    """Map-style: ``(index, torch.rand(3), np.random.rand(), random.random())``.

    ``die_at``: indices whose first fetch ends the worker process (``how``, see :func:`die`;
    once each, remembered by files named ``marker`` + ``.index``; after ``arm`` exists, if
    given). ``delay``: seconds every fetch
    sleeps, so that workers are busy when the test kills one from outside. ``slow``: index ->
    seconds that index's fetch sleeps (a stall), in every worker and every epoch.
    """

    def __init__(
        self,
        n: int,
        *,
        die_at: Collection[int] = (),
        marker: str | None = None,
        how: str = "kill",
        arm: str | None = None,
        delay: float = 0.0,
        slow: dict[int, float] | None = None,
    ) -> None:
        if die_at and marker is None:
            raise ValueError("die_at needs a marker path")
        self.n = n
        self.die_at = frozenset(die_at)
        self.marker = marker
        self.how = how
        self.arm = arm
        self.delay = delay
        self.slow = dict(slow or {})

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, float, float]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        if trip(self.marker, index, self.die_at, self.arm):
            die(self.how)
        if self.delay:
            time.sleep(self.delay)
        if index in self.slow:
            time.sleep(self.slow[index])  # the stalled fetch: a stall report shows this line
        return (index, *augmentation())


class Counted(Augmented):
    """:class:`Augmented` with a state of its own (``state_dict`` on the dataset): each sample
    also says how many samples this copy of the dataset had fetched before it."""

    def __init__(self, n: int, **options: Any) -> None:
        super().__init__(n, **options)
        self.fetched = 0

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, float, float, int]:  # type: ignore[override]
        sample = super().__getitem__(index)
        self.fetched += 1
        return (*sample, self.fetched - 1)

    def state_dict(self) -> dict[str, Any]:
        return {"fetched": self.fetched}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fetched = state["fetched"]


# -- iterable-style ------------------------------------------------------------------------------


class Stream(ferry.IterableDataset[tuple[int, torch.Tensor, float, float]]):
    """Iterable-style, with no state: items ``range(n)``, sharded over workers by
    ``get_worker_info``, each as ``(item, torch.rand(3), np.random.rand(), random.random())``.
    A resume reads and drops the items already delivered.

    ``die_at``, ``marker``, ``how``, ``arm``: as for :class:`Augmented`, for an item.
    ``slow``: item -> seconds making that item sleeps.
    """

    def __init__(
        self,
        n: int,
        *,
        die_at: Collection[int] = (),
        marker: str | None = None,
        how: str = "kill",
        arm: str | None = None,
        slow: dict[int, float] | None = None,
    ) -> None:
        if die_at and marker is None:
            raise ValueError("die_at needs a marker path")
        self.n = n
        self.die_at = frozenset(die_at)
        self.marker = marker
        self.how = how
        self.arm = arm
        self.slow = dict(slow or {})

    def make(self, item: int) -> tuple[int, torch.Tensor, float, float]:
        """Item ``item`` of the stream (dying or sleeping there if asked to)."""
        if trip(self.marker, item, self.die_at, self.arm):
            die(self.how)
        if item in self.slow:
            time.sleep(self.slow[item])
        return (item, *augmentation())

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, float, float]]:
        for item in shard(self.n):
            yield self.make(item)


class _SeekingIterator:
    """The iterator of a :class:`IteratorStateStream`: it resumes by seeking."""

    def __init__(self, owner: Stream) -> None:
        self.owner = owner
        self.items = list(shard(owner.n))
        self.offset = 0

    def __iter__(self) -> _SeekingIterator:
        return self

    def __next__(self) -> tuple[int, torch.Tensor, float, float]:
        if self.offset >= len(self.items):
            raise StopIteration
        item = self.items[self.offset]
        self.offset += 1
        return self.owner.make(item)

    def state_dict(self) -> dict[str, Any]:
        return {"offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.offset = state["offset"]


class IteratorStateStream(Stream):
    """:class:`Stream` whose iterator has ``state_dict``/``load_state_dict``."""

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, float, float]]:
        return _SeekingIterator(self)


class DatasetStateStream(Stream):
    """:class:`Stream` with its state on the dataset object: where its current iteration
    stands; after ``load_state_dict`` the next ``iter()`` starts there."""

    def __init__(self, n: int, **options: Any) -> None:
        super().__init__(n, **options)
        self.position = 0
        self._start = 0

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, float, float]]:
        items = list(shard(self.n))
        start, self._start = self._start, 0
        self.position = start
        for item in items[start:]:
            self.position += 1
            yield self.make(item)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._start = state["position"]


STREAMS = {"none": Stream, "iterator": IteratorStateStream, "dataset": DatasetStateStream}
"""The stream classes by where they keep their position (nowhere, iterator, dataset)."""


# -- worker_init_fn --------------------------------------------------------------------------------

TAG = 0
"""Set by :func:`tag_worker` in the worker process that runs it (0 wherever it did not run)."""


def tag_worker(worker_id: int) -> None:
    """A ``worker_init_fn``: sets :data:`TAG` to ``100 + worker_id`` in its worker process."""
    global TAG
    TAG = 100 + worker_id


class Tagged(Augmented):
    """:class:`Augmented` whose samples also carry :data:`TAG`, what ``worker_init_fn`` set."""

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, float, float, int]:  # type: ignore[override]
        return (*super().__getitem__(index), TAG)


INIT_SECONDS = 1.5
"""How long :func:`slow_init` takes."""


def slow_init(worker_id: int) -> None:
    """A ``worker_init_fn`` that takes :data:`INIT_SECONDS` (a stall before any batch)."""
    time.sleep(INIT_SECONDS)


class SlowToUnpickle(ferry.Dataset[int]):
    """Map-style ``index -> index``; unpickling it (as a spawn worker starts) takes ``delay``
    seconds."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index

    def __setstate__(self, state: dict[str, Any]) -> None:
        time.sleep(state["delay"])
        self.__dict__.update(state)
