"""Shared-memory slabs: how a process worker's batch reaches the main process without a copy.

A *slab* is a shared-memory file owned by the worker that made it: anonymous (``memfd_create``),
so nothing is ever left in ``/dev/shm``, or named under torch's ``file_system`` sharing strategy
(see :mod:`ferry._engine.slabfile`, which also explains why no process holds a descriptor per
slab). Its memory goes back to the system when the last process that maps it exits or unmaps
it, however that process ends.

In the worker, :class:`SlabAllocator` is installed as collate's allocator: batch tensors are
carved out of slabs, so collate writes each sample straight into shared memory. The batch is
then pickled by :func:`encode_batch`, which replaces every tensor by a reference
``(slab id, byte offset, dtype, shape, stride)``; the first time a slab is used, the worker
sends a ``NewSlab`` message, followed by the file's descriptor (``SCM_RIGHTS``) when it has no
name.

In the main process, :class:`SlabMaps` maps each slab once and :meth:`SlabMaps.decode` turns the
references back into tensors over the mapping. A slab is lent out with the batch and is free
again once every tensor of that batch made from it is gone (a weak reference to the
``memoryview`` each tensor was made from, as in :mod:`ferry._engine.alloc`); the main process
then lists it in the ``freed`` field of its next message to that worker.
"""

from __future__ import annotations

import collections
import contextlib
import io
import math
import os
import pickle
import threading
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch

from ferry._engine.messages import NewSlab
from ferry._engine.slabfile import (
    create_file,
    descriptor_limit,
    is_descriptor_limit,
    map_file,
    open_named,
    recv_fd,
)

__all__ = ["SLABS_SUPPORTED", "Slab", "SlabAllocator", "SlabMaps", "encode_batch"]

SLABS_SUPPORTED = hasattr(os, "memfd_create")

_ALIGN = 64
_MIN_SLAB = 1 << 20


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class Slab:
    """One shared-memory file, mapped in the worker that created it.

    ``fd`` is held only until the slab is announced to the main process (:meth:`shared`);
    ``name`` is set when slabs travel by name (see :mod:`ferry._engine.slabfile`).
    """

    def __init__(self, slab_id: int, size: int, owner_pid: int, named: bool) -> None:
        self.id = slab_id
        self.size = size
        fd, self.name = create_file(owner_pid, slab_id, size, named)
        self.fd: int | None = fd
        try:
            available = available_memory()
            if available is not None and size > available:
                raise OSError(f"{size} bytes asked, {available} available")
            os.ftruncate(fd, size)
            # Commit the memory now: otherwise running out shows up later as a SIGBUS in the
            # middle of collate. Slabs are reused, so this is paid once per slab.
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            self.map = map_file(fd, size)
        except OSError as exc:
            self._release_file()
            if is_descriptor_limit(exc):
                raise
            raise _out_of_shared_memory(size) from exc
        if self.name is not None:
            self.shared()  # found by its name: the descriptor is not needed any more
        self.whole = torch.frombuffer(self.map, dtype=torch.uint8)
        self.base = self.whole.data_ptr()
        self.used = 0
        self.lent = False  # in the main process's hands until it says otherwise
        self.announced = False

    def shared(self) -> None:
        """The main process has the slab: this process keeps only the mapping."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _release_file(self) -> None:
        self.shared()
        if self.name is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.name)

    def close(self) -> None:
        """Drop this process's hold on the slab (the mapping goes with its last view)."""
        del self.whole, self.map
        self._release_file()


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), if known.

    Checked before committing a slab: committing more than this would wake the OOM killer
    instead of failing cleanly.
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _out_of_shared_memory(size: int) -> OSError:
    return OSError(
        f"ferry could not get {size} bytes of shared memory for a batch from a worker process: "
        "the machine (or the container's memory limit) has too little free memory. Lower "
        "batch_size, num_workers or prefetch_factor, drop batches you no longer need sooner, "
        "or use worker_type='thread', which needs no shared memory."
    )


class SlabAllocator:
    """Worker-side collate allocator: carves batch tensors out of this worker's slabs.

    A batch may span several slabs. New slabs are sized to the largest batch seen so far, so in
    steady state each batch fits in one slab and no slab is created.
    """

    min_bytes = 0  # everything a worker's batch holds goes to shared memory

    def __init__(self, owner_pid: int, named: bool = False) -> None:
        # Slab files are made for main process ``owner_pid``; ``named``: they travel by name.
        self._owner_pid = owner_pid
        self._named = named
        self.slabs: dict[int, Slab] = {}
        self._current: Slab | None = None
        self._in_batch: list[Slab] = []
        self._batch_bytes = 0
        self._largest_batch = 0
        self._next_id = 0

    def begin(self, freed: tuple[int, ...]) -> None:
        """Start a batch; ``freed`` are slabs the main process has let go of."""
        for slab_id in freed:
            slab = self.slabs.get(slab_id)
            if slab is not None:
                slab.lent = False
        self._current = None
        self._in_batch = []
        self._batch_bytes = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        self._batch_bytes += _round_up(nbytes, _ALIGN)
        slab = self._current
        if slab is None or slab.used + nbytes > slab.size:
            slab = self._take(nbytes)
        start = slab.used
        slab.used = _round_up(start + nbytes, _ALIGN)
        return slab.whole[start : start + nbytes].view(dtype).view(shape)

    def _take(self, nbytes: int) -> Slab:
        want = max(nbytes, self._largest_batch)
        idle = [s for s in self.slabs.values() if not s.lent and s not in self._in_batch]
        fitting = [s for s in idle if s.size >= want] or [s for s in idle if s.size >= nbytes]
        if fitting:
            slab = min(fitting, key=lambda s: s.size)
        else:
            slab = self._new_slab(max(_round_up(want, _MIN_SLAB), _MIN_SLAB))
            self._next_id += 1
            self.slabs[slab.id] = slab
        slab.used = 0
        self._in_batch.append(slab)
        self._current = slab
        return slab

    def _new_slab(self, size: int) -> Slab:
        try:
            return Slab(self._next_id, size, self._owner_pid, self._named)
        except OSError as exc:
            if not is_descriptor_limit(exc):
                raise
            lent = sum(slab.lent for slab in self.slabs.values())
            raise descriptor_limit(
                "a DataLoader worker process",
                "creating a shared-memory slab for a batch",
                f"The worker has {len(self.slabs)} slabs, {lent} of them held by the main "
                "process (batches in flight or kept by the training loop).",
            ) from exc

    def locate(self, tensor: torch.Tensor) -> tuple[Slab, int] | None:
        """The slab holding ``tensor``'s bytes and their offset in it, if any."""
        ptr = tensor.data_ptr()
        for slab in self._in_batch:
            if slab.base <= ptr < slab.base + slab.size:
                return slab, ptr - slab.base
        return None

    def finish(self) -> list[Slab]:
        """End the batch: its slabs are now lent to the main process."""
        self._largest_batch = max(self._largest_batch, self._batch_bytes)
        used = self._in_batch
        for slab in used:
            slab.lent = True
        self._current = None
        self._in_batch = []
        return used

    def abandon(self) -> None:
        """The batch failed: its slabs were never handed out."""
        self._current = None
        self._in_batch = []

    def close(self) -> None:
        for slab in self.slabs.values():
            slab.close()
        self.slabs.clear()


def _shareable(tensor: torch.Tensor) -> bool:
    return (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and not tensor.is_nested
        and not tensor.is_quantized
    )


def _extent_bytes(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    """Bytes from a strided tensor's first element to just past its last."""
    if math.prod(shape) == 0:
        return 0
    span = sum((size - 1) * step for size, step in zip(shape, stride, strict=True))
    return (span + 1) * itemsize


class _BatchPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, allocator: SlabAllocator) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._allocator = allocator
        # One reference per tensor object: the same tensor twice in a batch stays one tensor.
        # The tensors are kept here so their ids cannot be reused while pickling.
        self._seen: dict[int, tuple[torch.Tensor, tuple[Any, ...]]] = {}

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor) or not _shareable(obj) or obj.numel() == 0:
            return None
        if any(st < 0 for st in obj.stride()):
            return None
        seen = self._seen.get(id(obj))
        if seen is not None:
            return seen[1]
        found = self._allocator.locate(obj)
        placed = obj
        if found is None:
            # Not built by collate in a slab (a custom collate_fn, batching off): one copy in.
            placed = self._copy_in(obj)
            found = self._allocator.locate(placed)
            assert found is not None
        slab, offset = found
        ref = (
            "ferry-slab",
            slab.id,
            offset,
            obj.dtype,
            tuple(placed.shape),
            tuple(placed.stride()),
        )
        self._seen[id(obj)] = (obj, ref)
        return ref

    def _copy_in(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` in a slab, with the same strides when they cover its bytes
        densely (a transposed or channels-last tensor stays so); contiguous otherwise."""
        shape, stride = tuple(tensor.shape), tuple(tensor.stride())
        dense = _extent_bytes(shape, stride, tensor.element_size()) == tensor.nbytes
        if dense:
            flat = self._allocator.empty((tensor.numel(),), tensor.dtype)
            copy = flat.as_strided(shape, stride)
        else:
            copy = self._allocator.empty(shape, tensor.dtype)
        copy.copy_(tensor)
        return copy


def encode_batch(batch: Any, allocator: SlabAllocator) -> tuple[bytes, list[Slab]]:
    """Pickle ``batch`` with its tensors as slab references; returns the bytes and the slabs
    the batch lives in (now lent to the main process)."""
    buffer = io.BytesIO()
    try:
        _BatchPickler(buffer, allocator).dump(batch)
    except BaseException:
        allocator.abandon()
        raise
    return buffer.getvalue(), allocator.finish()


class _Lease:
    """One batch's use of one slab: free again when its last tensor is gone."""

    __slots__ = ("count", "done", "key")

    def __init__(self, key: int, done: Callable[[int], None]) -> None:
        self.key = key
        self.count = 0
        self.done = done

    def release(self) -> None:
        self.count -= 1
        if self.count == 0:
            self.done(self.key)


class SlabMaps:
    """Main-side view of one worker's slabs (see the module docstring)."""

    def __init__(self) -> None:
        self._maps: dict[int, Any] = {}
        self._freed: collections.deque[int] = collections.deque()
        self._lock = threading.Lock()
        # A slab announced whose descriptor has not been read yet.
        self.awaiting: NewSlab | None = None

    def announced(self, slab: NewSlab, worker_id: int) -> None:
        """Map the slab ``slab`` announces by its name; a slab without a name waits for the
        descriptor that follows the announcement on the connection (:meth:`take_descriptor`).
        Holds no descriptor afterwards."""
        if slab.name is None:
            self.awaiting = slab
            return
        with self._limit_reached(worker_id):
            self._maps[slab.slab_id] = open_named(slab.name, slab.size)

    def take_descriptor(self, conn: Connection, worker_id: int) -> None:
        """Receive the descriptor of the slab announced last and map it; call only when it is
        there to read (a stopped worker may not have sent it yet: the caller must not block)."""
        slab, self.awaiting = self.awaiting, None
        assert slab is not None
        with self._limit_reached(worker_id):
            fd = recv_fd(conn)
        try:
            self._maps[slab.slab_id] = map_file(fd, slab.size)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _limit_reached(self, worker_id: int) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            if not is_descriptor_limit(exc):
                raise
            raise descriptor_limit(
                "the main process",
                f"receiving a shared-memory slab from worker {worker_id}",
                f"It has {len(self._maps)} slabs of that worker mapped.",
            ) from exc

    def take_freed(self) -> tuple[int, ...]:
        """Slabs whose batches are gone since the last call."""
        with self._lock:
            freed = tuple(self._freed)
            self._freed.clear()
        return freed

    def _release(self, slab_id: int) -> None:
        with self._lock:
            self._freed.append(slab_id)

    def release(self, slab_ids: tuple[int, ...]) -> None:
        """Give back slabs of a batch that is dropped without being read."""
        with self._lock:
            self._freed.extend(slab_ids)

    def decode(self, payload: bytes, slabs: tuple[int, ...]) -> Any:
        leases = {slab_id: _Lease(slab_id, self._release) for slab_id in slabs}
        maps = self._maps
        loaded: dict[Any, torch.Tensor] = {}

        def load(pid: Any) -> torch.Tensor:
            # The same reference twice is the same tensor object twice, as it was pickled.
            tensor = loaded.get(pid)
            if tensor is None:
                tensor = loaded[pid] = load_new(pid)
            return tensor

        def load_new(pid: Any) -> torch.Tensor:
            _, slab_id, offset, dtype, shape, stride = pid
            nbytes = _extent_bytes(shape, stride, dtype.itemsize)
            view = memoryview(maps[slab_id])[offset : offset + nbytes]
            lease = leases[slab_id]
            lease.count += 1
            weakref.finalize(view, lease.release)
            flat = torch.frombuffer(view, dtype=torch.uint8).view(dtype)
            return flat.as_strided(shape, stride)

        unpickler = pickle.Unpickler(io.BytesIO(payload))
        unpickler.persistent_load = load  # type: ignore[method-assign]
        batch = unpickler.load()
        for lease in leases.values():
            if lease.count == 0:  # e.g. a slab holding only tensors that were dropped
                self._release(lease.key)
        return batch

    def close(self) -> None:
        # Each mapping goes when the last tensor over it does (the user may still hold some).
        self._maps.clear()
