"""Datasets, collate functions and worker_init_fns of the worker, fault and message tests.

Everything here is module level so that spawn and forkserver workers can unpickle it (by
reference to ``_support.datasets``). Datasets that need to know which worker runs them take the
``get_worker_info`` function to call: ``torch.utils.data.get_worker_info`` inside torch's
workers, ``ferry.get_worker_info`` inside ferry's. Iterable datasets derive from torch's
``IterableDataset``, which both libraries recognise.
"""

from __future__ import annotations

import collections
import ctypes
import faulthandler
import multiprocessing
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

try:
    import numpy as np
except ImportError:  # the run without numpy (make test-nonumpy): samples hold no numpy values
    np = None  # type: ignore[assignment]
import torch
import torch.utils.data as tud

import ferry

InfoFn = Callable[[], Any]

RELEASE = threading.Event()
"""Thread workers blocked by :class:`Blocking` wait on this; the tests' cleanup sets it.
(A process worker has its own copy, never set: it blocks until it is stopped.)"""

INIT_CALLS: list[dict[str, Any]] = []
"""What :func:`record_init` saw, in the process that ran it (cleared before every test)."""

Point = collections.namedtuple("Point", ["x", "flag"])


def any_worker_info() -> Any:
    """The worker info of whichever library's worker runs the caller."""
    return ferry.get_worker_info() or tud.get_worker_info()


def sample(i: int) -> dict[str, Any]:
    """A sample with every kind of leaf default_collate handles."""
    return {
        "index": i,
        "value": i / 4,
        "name": f"item-{i}",
        "tensor": torch.arange(3, dtype=torch.float32) + i,
        "pair": (torch.tensor([i, -i]), i if np is None else np.int64(i)),
        "array": torch.full((2,), i) if np is None else np.full((2,), i, dtype=np.int16),
        "point": Point(i, torch.tensor(i % 3 == 0)),
    }


# -- map-style -----------------------------------------------------------------------------------


class Items:
    """Map-style (by protocol): ``sample(i)`` for ``i`` in ``range(n)``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return sample(index)


class Indices:
    """Map-style: the index itself."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class AllAtOnce:
    """Sample ``i`` is ``i``, read only once ``count`` reads wait together (a barrier): a read
    returns only if that many run at once, else the barrier breaks after ``timeout``."""

    def __init__(self, count: int, timeout: float = 10) -> None:
        self._together = threading.Barrier(count, timeout=timeout)

    def __getitem__(self, index: int) -> int:
        self._together.wait()
        return index


class Blocks:
    """Map-style: a tensor of ``shape`` and ``dtype`` filled with the index."""

    def __init__(self, n: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> None:
        self.n = n
        self.shape = shape
        self.dtype = dtype

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full(self.shape, index, dtype=torch.int64).to(self.dtype)


class TwoBlocks(Blocks):
    """Map-style: a large block and a small one per sample (a batch with two tensor leaves)."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return super().__getitem__(index), torch.tensor([index, -index], dtype=torch.int16)


class SendsLambda(Indices):
    """Map-style: samples hold a lambda, which cannot be pickled back to the main process."""

    def __getitem__(self, index: int) -> Any:
        return (index, lambda: index)


class Finalized:
    """Map-style ``0..n-1``; when a copy of it is finalized, a line goes to ``log``: the pid
    of the process and whether ferry's and torch's ``get_worker_info`` answered None there."""

    def __init__(self, n: int, log: str) -> None:
        self.n = n
        self.log = log

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index

    def __del__(self) -> None:
        infos = (ferry.get_worker_info(), tud.get_worker_info())
        with open(self.log, "a") as log:
            log.write(f"{os.getpid()} {all(info is None for info in infos)}\n")


class Probe:
    """Map-style: what the worker fetching ``index`` knows about itself."""

    def __init__(self, n: int, info_fn: InfoFn) -> None:
        self.n = n
        self.info_fn = info_fn
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        self.calls += 1
        info = self.info_fn()
        return {
            "index": index,
            "id": info.id,
            "num_workers": info.num_workers,
            "seed": info.seed,
            "initial_seed": torch.initial_seed(),
            "same_dataset": info.dataset is self,
            "dataset_id": id(info.dataset),
            "pid": os.getpid(),
            "process_type": type(multiprocessing.current_process()).__name__,
            "thread": threading.get_ident(),
            "calls": self.calls,
            "random": random.random(),
            "torch": torch.rand(()).item(),
            "numpy": 0.0 if np is None else float(np.random.rand()),
            "init": [dict(call) for call in INIT_CALLS],
        }


class Marks:
    """Map-style: sets ``marks[index] = 1`` when ``index`` is fetched (``marks`` is a tensor in
    shared memory, so the test sees what process workers fetched)."""

    def __init__(self, marks: torch.Tensor) -> None:
        self.marks = marks

    def __len__(self) -> int:
        return len(self.marks)

    def __getitem__(self, index: int) -> int:
        self.marks[index] = 1
        return index


class WaitForFlag:
    """Map-style: index 0 waits (up to ``patience`` s) until ``flag[0]`` is set; the others
    are immediate."""

    def __init__(self, n: int, flag: torch.Tensor, patience: float = 10.0) -> None:
        self.n = n
        self.flag = flag
        self.patience = patience

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == 0:
            deadline = time.monotonic() + self.patience
            while not self.flag[0] and time.monotonic() < deadline:
                time.sleep(0.002)
        return index


class Gate:
    """Map-style: marks ``marks[index] = 1`` when a fetch starts; indices from ``open_below``
    on then wait (up to ``patience`` s) until ``flag[0]`` is set."""

    def __init__(
        self, marks: torch.Tensor, flag: torch.Tensor, open_below: int, patience: float = 10.0
    ) -> None:
        self.marks = marks
        self.flag = flag
        self.open_below = open_below
        self.patience = patience

    def __len__(self) -> int:
        return len(self.marks)

    def __getitem__(self, index: int) -> int:
        self.marks[index] = 1
        if index >= self.open_below:
            deadline = time.monotonic() + self.patience
            while not self.flag[0] and time.monotonic() < deadline:
                time.sleep(0.002)
        return index


class Blocking:
    """Map-style: indices from ``block_from`` on wait for :data:`RELEASE` (at most
    ``seconds``); a thread worker is let go by the test's cleanup, a process worker has to be
    stopped."""

    def __init__(self, n: int, block_from: int, seconds: float = 60.0) -> None:
        self.n = n
        self.block_from = block_from
        self.seconds = seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index >= self.block_from:
            RELEASE.wait(self.seconds)
        return index


class Slow:
    """Map-style: each sample takes ``delay`` seconds."""

    def __init__(self, n: int, delay: float) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        time.sleep(self.delay)
        return index


class BigBytes:
    """Map-style: ``size`` bytes per sample (no tensor: the whole batch goes through the pipe)."""

    def __init__(self, n: int, size: int) -> None:
        self.n = n
        self.size = size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> bytes:
        return bytes([index % 256]) * self.size


class Unloadable(Indices):
    """Pickles, but cannot be unpickled (in a spawn or forkserver worker)."""

    def __reduce__(self) -> Any:
        return (_refuse_to_load, (self.n,))


def _refuse_to_load(n: int) -> Any:
    raise Boom(f"this dataset of {n} samples cannot be loaded here")


class Boom(Exception):
    """The error the failing datasets raise."""


class NeedsTwoArgs(Exception):
    """An exception that pickles but cannot be rebuilt from its args."""

    def __init__(self, first: str, second: str) -> None:
        super().__init__(f"{first} and {second}")


class HoldsALock(ValueError):
    """An exception that cannot be pickled (it holds a lock), whose class can."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def explode_in_getitem(index: int) -> None:
    raise Boom(f"boom at index {index}")


class FailAt:
    """Map-style: index ``bad`` raises :class:`Boom` (or ``kind``), the others return it."""

    def __init__(self, n: int, bad: int, kind: str = "boom") -> None:
        self.n = n
        self.bad = bad
        self.kind = kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == self.bad:
            if self.kind == "two-args":
                raise NeedsTwoArgs("first", "second")
            if self.kind == "key":
                raise KeyError(f"missing {index}")
            if self.kind == "locked":
                raise HoldsALock(f"bad sample {index}")
            explode_in_getitem(index)
        return index


class DieAt:
    """Map-style: the worker fetching ``at`` dies: ``how`` is ``"exit"`` (``os._exit(3)``),
    ``"segv"`` (a read of address 0) or ``"kill"`` (SIGKILL to itself)."""

    def __init__(self, n: int, at: int, how: str) -> None:
        self.n = n
        self.at = at
        self.how = how

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == self.at:
            if self.how == "exit":
                os._exit(3)
            elif self.how == "segv":
                # pytest's fault handler, inherited by a forked worker, would print this
                # deliberate crash's stack into the test log as if something had gone wrong.
                faulthandler.disable()
                ctypes.string_at(0)
            elif self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        return index


class HoldsLambda:
    """Map-style dataset that cannot be pickled (it holds a lambda)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.transform = lambda x: x

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return self.transform(index)


# -- iterable-style ------------------------------------------------------------------------------


class Sharded(tud.IterableDataset):
    """``sample(i)`` for ``i < n``, split between workers by ``i % num_workers``."""

    def __init__(self, n: int, info_fn: InfoFn) -> None:
        self.n = n
        self.info_fn = info_fn

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = self.info_fn()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield sample(i)


class Uneven(tud.IterableDataset):
    """Worker ``w`` yields ``lengths[w]`` samples ``1000 * w + k`` (tensors)."""

    def __init__(self, lengths: tuple[int, ...], info_fn: InfoFn) -> None:
        self.lengths = lengths
        self.info_fn = info_fn

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = self.info_fn()
        worker = 0 if info is None else info.id
        for k in range(self.lengths[worker]):
            yield torch.tensor([1000 * worker + k, k])


class Replicated(tud.IterableDataset):
    """Every worker yields the whole stream ``0..n-1`` (no sharding)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        yield from range(self.n)


class FerryStream(ferry.IterableDataset):
    """Like :class:`Sharded` but derived from ferry's base class."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        info = ferry.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        yield from range(start, self.n, step)


class FailingStream(tud.IterableDataset):
    """Raises :class:`Boom` in ``__iter__`` (``after`` None) or after ``after`` samples."""

    def __init__(self, after: int | None) -> None:
        self.after = after

    def __iter__(self) -> Iterator[int]:
        if self.after is None:
            raise Boom("boom in __iter__")
        return self._stream()

    def _stream(self) -> Iterator[int]:
        yield from range(self.after)
        raise Boom(f"boom after {self.after} samples")


# -- collate functions and worker_init_fns ---------------------------------------------------------


def identity(value: Any) -> Any:
    return value


class Objects:
    """Map-style: the same mutable object for an index every time."""

    def __init__(self, n: int) -> None:
        self.objects = [{"index": i, "payload": [i] * 3} for i in range(n)]

    def __len__(self) -> int:
        return len(self.objects)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.objects[index]


def record_init(worker_id: int) -> None:
    info = any_worker_info()
    INIT_CALLS.append(
        {
            "worker_id": worker_id,
            "info_id": info.id,
            "initial_seed": torch.initial_seed(),
            "random": random.random(),
            "thread": threading.get_ident(),
        }
    )


def failing_init(worker_id: int) -> None:
    raise Boom(f"boom in worker_init_fn of worker {worker_id}")


def failing_collate(batch: list[Any]) -> Any:
    raise Boom(f"boom in collate_fn for {len(batch)} samples")


def stack_plain(batch: list[torch.Tensor]) -> torch.Tensor:
    """A custom collate: one tensor made by ``torch.stack`` (not in a slab)."""
    return torch.stack(batch)


def stack_transposed(batch: list[torch.Tensor]) -> torch.Tensor:
    """A custom collate returning a non-contiguous (transposed) tensor."""
    return torch.stack(batch).t()


def default_then_slice(batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """default_collate, then views of the result: offsets and strides inside a batch tensor."""
    whole = ferry.default_collate(batch) if ferry.get_worker_info() else tud.default_collate(batch)
    return {"tail": whole[1:], "every_other": whole[:, ::2], "column": whole[:, 1]}


def views_of_a_plain_batch(batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """torch's default_collate in either loader (so not in a slab), then views of the result:
    an offset, a step, a column, a transposition and an expansion (zero strides)."""
    whole = tud.default_collate(batch)
    return {
        "tail": whole[1:, 1:],
        "every_other": whole[:, ::2],
        "column": whole[:, 1],
        "transposed": whole.t(),
        "expanded": whole[0].expand(3, -1),
    }


def plain_twice(batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One tensor made outside collate's allocator, returned twice."""
    stacked = torch.stack(batch)
    return stacked, stacked


def mixed_leaves(batch: list[torch.Tensor]) -> dict[str, Any]:
    """Tensors next to strings, bytes, numbers, None and a numpy array."""
    return {
        "stacked": torch.stack(batch),
        "names": [f"row-{int(t.flatten()[0])}" for t in batch],
        "raw": b"\x00bytes",
        "count": len(batch),
        "nothing": None,
        "array": torch.arange(len(batch)) if np is None else np.arange(len(batch)),
        "empty": torch.zeros(0, 3),
    }
