"""Where collate puts batch memory.

Collate asks :func:`batch_empty` for each batch tensor it builds. Outside a loader that is a
plain ``torch.empty``. A loader installs an allocator for the thread that runs collate:

* :class:`BufferPool` in the main process and thread workers: large batch buffers are reused
  once every tensor made from them is gone, so a batch costs one write of its bytes and no page
  faults (a fresh multi-megabyte ``torch.empty`` page-faults on every first touch, which costs
  several times the copy itself).
* shared-memory slabs in process workers, so the batch crosses to the main process as is.

A buffer is an ordinary (resizable) torch storage. It is known to be free when the pool's own
reference is its only one: torch's storage use count (every tensor, view, slice or numpy array
made from a batch tensor holds the storage) and the Python reference count of the storage object
(``t.untyped_storage()`` returns that same object) are both back to what the pool alone holds.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable
from typing import Protocol

import torch

__all__ = [
    "Allocator",
    "BufferPool",
    "batch_empty",
    "expect_batch",
    "extent_bytes",
    "using_allocator",
]

_local = threading.local()


class Allocator(Protocol):
    """Gives an uninitialised CPU tensor of the given shape and dtype.

    ``min_bytes``: below this size the allocator would only hand out a plain ``torch.empty``,
    so callers may skip it (and any work done only to use it).
    """

    min_bytes: int

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...


def extent_bytes(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    """Bytes from a strided tensor's first element to just past its last."""
    if math.prod(shape) == 0:
        return 0
    span = sum((size - 1) * step for size, step in zip(shape, stride, strict=True))
    return (span + 1) * itemsize


def batch_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor from this thread's allocator (plain ``torch.empty`` if none)."""
    allocator: Allocator | None = getattr(_local, "allocator", None)
    if allocator is None:
        return torch.empty(shape, dtype=dtype)
    return allocator.empty(shape, dtype)


def active_allocator() -> Allocator | None:
    """This thread's allocator, if a loader installed one."""
    return getattr(_local, "allocator", None)


def expect_batch(sample: object, count: int) -> None:
    """A batch of ``count`` samples like ``sample`` is on its way, its reads still running:
    this thread's allocator may prepare the batch's memory now, while they wait (one that can:
    a worker process's slabs, see ``SlabAllocator.expect``)."""
    expect = getattr(getattr(_local, "allocator", None), "expect", None)
    if expect is None:
        return
    leaves: list[int] = []
    _leaf_bytes(sample, count, leaves, depth=0)
    if leaves:
        expect(leaves)


def _leaf_bytes(sample: object, count: int, leaves: list[int], depth: int) -> None:
    """The bytes of each tensor collate makes of ``count`` samples like ``sample`` (tensors,
    arrays and numbers; what else it holds is left out: an estimate)."""
    if isinstance(sample, torch.Tensor):
        leaves.append(sample.nbytes * count)
    elif isinstance(sample, (bool, int, float)):
        leaves.append(8 * count)
    elif depth < 8 and isinstance(sample, dict):
        for value in sample.values():
            _leaf_bytes(value, count, leaves, depth + 1)
    elif depth < 8 and isinstance(sample, (tuple, list)):
        for value in sample:
            _leaf_bytes(value, count, leaves, depth + 1)
    else:
        nbytes = getattr(sample, "nbytes", None)  # a numpy array
        if isinstance(nbytes, int) and hasattr(sample, "dtype"):
            leaves.append(nbytes * count)


class using_allocator:
    """Install ``allocator`` for the current thread for the duration of a ``with`` block."""

    def __init__(self, allocator: Allocator | None) -> None:
        self._allocator = allocator
        self._previous: Allocator | None = None

    def __enter__(self) -> None:
        self._previous = getattr(_local, "allocator", None)
        _local.allocator = self._allocator

    def __exit__(self, *exc: object) -> None:
        _local.allocator = self._previous


def _storage_use_count() -> Callable[[torch.UntypedStorage], int] | None:
    """How many holders a storage has (torch's own count), if this torch exposes it."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return lambda storage: int(count(storage._cdata))


_use_count = _storage_use_count()


def _python_refs(storages: list[torch.UntypedStorage]) -> list[int]:
    """Python references to each storage object (``t.untyped_storage()`` hands out the pool's
    own object, which torch's count does not see)."""
    return [sys.getrefcount(storage) for storage in storages]


# What _python_refs reports for a storage held by nothing but the list passed in (measured
# through the same code, since the count includes the interpreter's own temporary references).
_IDLE_PYTHON_REFS = _python_refs([torch.empty(1, dtype=torch.uint8).untyped_storage()])[0]


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class BufferPool:
    """Reusable host buffers for batch tensors (see the module docstring).

    Buffers under ``min_bytes`` are not pooled: the allocator already serves those from memory
    that is mapped. At most ``max_idle`` free buffers are kept; beyond that they are released.
    Thread-safe, so thread workers can share one pool. Without torch's storage use count (very
    old torch), nothing is pooled.
    """

    def __init__(self, *, min_bytes: int = 1 << 18, max_idle: int = 4) -> None:
        self.min_bytes = max(min_bytes, 1)
        self._max_idle = max_idle
        self._storages: list[torch.UntypedStorage] = []
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.min_bytes or _use_count is None:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            storage = self._take(nbytes)
            # Made while the lock is held, so no other thread can see the buffer as idle.
            return torch.empty(0, dtype=dtype).set_(storage, 0, shape, _contiguous(shape))

    def _take(self, nbytes: int) -> torch.UntypedStorage:
        assert _use_count is not None
        # The pool's own reference is the only one: no tensor, view, array or storage object
        # outside the pool uses the bytes.
        refs = _python_refs(self._storages)
        idle = [
            s
            for s, n in zip(self._storages, refs, strict=True)
            if n <= _IDLE_PYTHON_REFS and _use_count(s) == 1
        ]
        # Best fit among buffers that waste at most half their size.
        fits = [s for s in idle if nbytes <= s.nbytes() <= 2 * nbytes]
        if fits:
            chosen = min(fits, key=lambda s: s.nbytes())
        else:
            chosen = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
            self._storages.append(chosen)
        surplus = [s for s in idle if s is not chosen][self._max_idle :]
        if surplus:
            self._storages = [s for s in self._storages if all(s is not x for x in surplus)]
        return chosen

    def __len__(self) -> int:
        """How many buffers the pool holds, lent or idle."""
        return len(self._storages)
