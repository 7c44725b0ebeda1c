"""Where collate puts batch memory.

Collate asks :func:`batch_empty` for each batch tensor it builds. Outside a loader that is a
plain ``torch.empty``. A loader installs an allocator for the thread that runs collate:

* :class:`BufferPool` in the main process and thread workers: large batch buffers are reused
  once every tensor made from them is gone, so a batch costs one write of its bytes and no page
  faults (a fresh multi-megabyte ``torch.empty`` page-faults on every first touch, which costs
  several times the copy itself).
* shared-memory slabs in process workers, so the batch crosses to the main process as is.

A buffer is known to be free through a weak reference to the ``memoryview`` the tensor was made
from: the tensor's storage holds that view, and every view or slice of the tensor holds the
storage, so the weak reference dies only when the last user of those bytes is gone.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Protocol

import torch

__all__ = ["Allocator", "BufferPool", "batch_empty", "using_allocator"]

_local = threading.local()


class Allocator(Protocol):
    """Gives an uninitialised CPU tensor of the given shape and dtype."""

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...


def batch_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor from this thread's allocator (plain ``torch.empty`` if none)."""
    allocator: Allocator | None = getattr(_local, "allocator", None)
    if allocator is None:
        return torch.empty(shape, dtype=dtype)
    return allocator.empty(shape, dtype)


def active_allocator() -> Allocator | None:
    """This thread's allocator, if a loader installed one."""
    return getattr(_local, "allocator", None)


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


class _Buffer:
    __slots__ = ("data", "lent")

    def __init__(self, nbytes: int) -> None:
        self.data = bytearray(nbytes)
        self.lent: weakref.ref[memoryview] | None = None

    def is_free(self) -> bool:
        return self.lent is None or self.lent() is None


class BufferPool:
    """Reusable host buffers for batch tensors (see the module docstring).

    Buffers under ``min_bytes`` are not pooled: the allocator already serves those from memory
    that is mapped. At most ``max_idle`` free buffers are kept; beyond that they are released.
    Thread-safe, so thread workers can share one pool.
    """

    def __init__(self, *, min_bytes: int = 1 << 18, max_idle: int = 4) -> None:
        self._min_bytes = min_bytes
        self._max_idle = max_idle
        self._buffers: list[_Buffer] = []
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self._min_bytes:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            buffer = self._take(nbytes)
            view = memoryview(buffer.data)[:nbytes]
            buffer.lent = weakref.ref(view)
        flat = torch.frombuffer(view, dtype=torch.uint8)
        return flat.view(dtype).view(shape)

    def _take(self, nbytes: int) -> _Buffer:
        idle = [b for b in self._buffers if b.is_free()]
        # Best fit among buffers that waste at most half their size.
        fits = [b for b in idle if nbytes <= len(b.data) <= 2 * nbytes]
        chosen = min(fits, key=lambda b: len(b.data)) if fits else _Buffer(nbytes)
        if not fits:
            self._buffers.append(chosen)
        surplus = [b for b in idle if b is not chosen][self._max_idle :]
        if surplus:
            drop = {id(b) for b in surplus}
            self._buffers = [b for b in self._buffers if id(b) not in drop]
        return chosen

    def __len__(self) -> int:
        """How many buffers the pool holds, lent or idle."""
        return len(self._buffers)
