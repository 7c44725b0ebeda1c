"""Shared-memory slabs: how a process worker's batch reaches the main process without a copy.

A *slab* is a shared-memory file owned by the worker that made it: anonymous (``memfd_create``),
so nothing is ever left in ``/dev/shm``, or named under torch's ``file_system`` sharing strategy
(see :mod:`ferry._engine.transport.slabfile`, which also explains why no process holds a
descriptor per slab). Its memory goes back to the system when the last process that maps it
exits or unmaps it, however that process ends.

In the worker, :class:`SlabAllocator` is installed as collate's allocator: batch tensors are
carved out of slabs, so collate writes each sample straight into shared memory. The batch is
then pickled by :func:`encode_batch`, which replaces every tensor by a reference
``(slab id, byte offset, dtype, shape, stride)``; the first time a slab is used, the worker
sends a ``NewSlab`` message, followed by the file's descriptor (``SCM_RIGHTS``) when it has no
name.

A worker whose named slab cannot get its memory (``/dev/shm`` is full or too small) makes its
slabs anonymous from then on, and says so once with the next ``NewSlab`` (``fallback``), so the
main process can warn; only when anonymous memory fails too is the batch's error raised.

In the main process, :class:`~ferry._engine.transport.slabmaps.SlabMaps` maps each slab once, turns
references back into tensors, and decides which freed slabs the worker gets back and which it
closes (``Retire``, handled by :meth:`SlabAllocator.retire` in the worker's reader thread).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import io
import math
import os
import pickle
import threading
from typing import Any

import torch

from ferry._core.alloc import extent_bytes
from ferry._core.memory import available_memory
from ferry._engine.transport import slabfile
from ferry._engine.transport.messages import NewSlab
from ferry._engine.transport.slabfile import (
    create_file,
    descriptor_limit,
    is_descriptor_limit,
    map_file,
)
from ferry._engine.transport.slabmaps import RECENT_BATCHES, SlabMaps

__all__ = ["SLABS_SUPPORTED", "Slab", "SlabAllocator", "SlabMaps", "encode_batch"]

SLABS_SUPPORTED = hasattr(os, "memfd_create")

_ALIGN = 64
_MIN_SLAB = 1 << 20
_PAGE = 4096
# Slabs up to the reuse limit are kept for reuse (no new mapping, no page faults for the next
# batch: a 64 MiB batch moves in about 7 ms instead of 65); larger ones carry one batch, as
# torch's shared memory does: the worker lets go of a slab once it is sent and the main process
# unmaps it when the batch is dropped, so no memory waits for a later batch (see
# docs/design/transport.md, "Memory"). The limit is REUSE_LIMIT when set (tests, scripts), else
# 1/REUSE_SHARE of the memory available when the slab is made, at least REUSE_FLOOR: with 8
# workers and 2 batches each in flight, kept slabs stay within a quarter of it.
REUSE_LIMIT: int | None = None
REUSE_FLOOR = 64 << 20
REUSE_SHARE = 64


def reuse_limit() -> int:
    """The largest slab kept for reuse (see REUSE_LIMIT)."""
    if REUSE_LIMIT is not None:
        return REUSE_LIMIT
    return max(REUSE_FLOOR, (available_memory() or 0) // REUSE_SHARE)


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class Slab:
    """One shared-memory file, mapped in the worker that created it.

    ``fd`` is held only until the slab is announced to the main process (:meth:`shared`);
    ``name`` is set when slabs travel by name (see :mod:`ferry._engine.transport.slabfile`).
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
            # Committed now (not as collate writes it): running out shows up here, not as a
            # SIGBUS in the middle of collate. Slabs are reused, so this is paid once per slab.
            slabfile.reserve(fd, size, named)
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
        self.reuse = size <= reuse_limit()  # else it carries one batch (see REUSE_LIMIT)
        self.replaces: tuple[int, ...] = ()  # idle slabs closed when this one was made

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

    def close(self, unlink: bool = True) -> None:
        """Drop this process's hold on the slab (the mapping goes with its last view); a name
        is left for the main process to open when ``unlink`` is false."""
        del self.whole, self.map
        if unlink:
            self._release_file()
        else:
            self.shared()


def _out_of_shared_memory(size: int) -> OSError:
    return OSError(
        f"ferry could not get {size} bytes of shared memory for a batch from a worker process: "
        "the machine (or the container's memory limit) has too little free memory. Lower "
        "batch_size, num_workers or prefetch_factor, drop batches you no longer need sooner, "
        "or use worker_type='thread', which needs no shared memory."
    )


def _shm_full(exc: OSError) -> str:
    """Why a named slab failed if ``/dev/shm`` had no room for it (not the machine: no room
    for its bytes or its file); "" otherwise."""
    for error in (exc, exc.__cause__):
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EFBIG):
            return os.strerror(error.errno)
    return ""


class SlabAllocator:
    """Worker-side collate allocator: carves batch tensors out of this worker's slabs.

    A batch may span several slabs. New slabs are sized to the largest of the worker's recent
    batches, so in steady state each batch fits in one slab and no slab is created. The main
    process says which slabs are free again (:meth:`begin`) and which to close
    (:meth:`retire`, called from the worker's reader thread: hence the lock).
    """

    min_bytes = 0  # everything a worker's batch holds goes to shared memory

    def __init__(self, owner_pid: int, named: bool = False) -> None:
        # Slab files are made for main process ``owner_pid``; ``named``: they travel by name.
        self._owner_pid = owner_pid
        self._named = named
        self.slabs: dict[int, Slab] = {}
        self._lock = threading.Lock()
        self._current: Slab | None = None
        self._in_batch: list[Slab] = []
        self._batch_bytes = 0
        self._recent: collections.deque[int] = collections.deque(maxlen=RECENT_BATCHES)
        self._next_id = 0
        # Why this worker's slabs stopped travelling by name, until the main process is told.
        self.fallback = ""

    def begin(self, freed: tuple[int, ...]) -> None:
        """Start a batch; ``freed`` are slabs the main process has let go of."""
        with self._lock:
            for slab_id in freed:
                slab = self.slabs.get(slab_id)
                if slab is not None:
                    slab.lent = False
        self._current = None
        self._in_batch = []
        self._batch_bytes = 0

    def retire(self, slab_ids: tuple[int, ...]) -> None:
        """Close slabs the main process will not give back (it has unmapped them): their
        memory goes back to the system. Lent slabs only, so never one a batch is using."""
        with self._lock:
            for slab_id in slab_ids:
                slab = self.slabs.pop(slab_id, None)
                if slab is not None:
                    slab.close()

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
        slab, _ = self._idle_slab(max(nbytes, max(self._recent, default=0)))
        slab.used = 0
        self._in_batch.append(slab)
        self._current = slab
        return slab

    def expect(self, leaves: list[int]) -> None:
        """A batch whose tensors will take about ``leaves`` bytes each is on its way (its
        reads still run): make the slab it needs now, unless an idle one fits, and touch its
        pages, so that collate only copies. A worker's first batches, whose slabs are new,
        arrive that much sooner (about 1 ms a 2 MB batch)."""
        if self._current is not None:
            return  # (collate has begun)
        want = sum(_round_up(nbytes, _ALIGN) for nbytes in leaves)
        slab, new = self._idle_slab(max(want, max(self._recent, default=0)))
        if new:
            slab.whole[::_PAGE].zero_()  # (a write per page: each is mapped here now)

    def _idle_slab(self, want: int) -> tuple[Slab, bool]:
        """The smallest idle slab of at least ``want`` bytes, and whether it was made now
        (when none fitted)."""
        with self._lock:
            idle = [s for s in self.slabs.values() if not s.lent and s not in self._in_batch]
        fitting = [s for s in idle if s.size >= want]
        if fitting:
            return min(fitting, key=lambda s: s.size), False
        slab = self._new_slab(max(_round_up(want, _MIN_SLAB), _MIN_SLAB))
        self._next_id += 1
        # Idle slabs too small for this worker's batches now are closed; the new slab's
        # announcement tells the main process, which unmaps them too.
        slab.replaces = tuple(s.id for s in idle)
        with self._lock:
            for stale in idle:
                del self.slabs[stale.id]
                stale.close()
            self.slabs[slab.id] = slab
        return slab, True

    def _new_slab(self, size: int) -> Slab:
        try:
            return self._make(size)
        except OSError as exc:
            if not is_descriptor_limit(exc):
                raise
            with self._lock:
                count, lent = len(self.slabs), sum(slab.lent for slab in self.slabs.values())
            raise descriptor_limit(
                "a DataLoader worker process",
                "creating a shared-memory slab for a batch",
                f"The worker has {count} slabs, {lent} of them held by the main "
                "process (batches in flight or kept by the training loop).",
            ) from exc

    def _make(self, size: int) -> Slab:
        """A new slab; a named one that ``/dev/shm`` has no room for is made anonymous, and so
        are this worker's later slabs (see the module docstring)."""
        if not self._named:
            return Slab(self._next_id, size, self._owner_pid, named=False)
        try:
            return Slab(self._next_id, size, self._owner_pid, named=True)
        except OSError as exc:
            why = _shm_full(exc)
            if not why:
                raise
        slab = Slab(self._next_id, size, self._owner_pid, named=False)
        self._named = False
        self.fallback = why
        return slab

    def announcement(self, slab: Slab) -> NewSlab:
        """The message that tells the main process about ``slab`` (the first since this worker
        fell back to anonymous slabs says why)."""
        fallback = "" if slab.name is not None else self.fallback
        if fallback:
            self.fallback = ""
        return NewSlab(slab.id, slab.size, slab.name, fallback, slab.reuse, slab.replaces)

    def handed_off(self, used: list[Slab]) -> None:
        """The batch in ``used`` was sent: slabs that carry one batch are let go of here (the
        main process unmaps them when the batch is dropped)."""
        with self._lock:
            for slab in used:
                if not slab.reuse:
                    del self.slabs[slab.id]
                    slab.close(unlink=False)

    def locate(self, tensor: torch.Tensor) -> tuple[Slab, int] | None:
        """The slab holding ``tensor``'s bytes and their offset in it, if any."""
        ptr = tensor.data_ptr()
        for slab in self._in_batch:
            if slab.base <= ptr < slab.base + slab.size:
                return slab, ptr - slab.base
        return None

    def finish(self) -> list[Slab]:
        """End the batch: its slabs are now lent to the main process."""
        self._recent.append(self._batch_bytes)
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
        with self._lock:
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
        """A copy in a slab of the bytes ``tensor`` spans, with its strides, as torch's
        batches keep them (its whole storage goes to shared memory there): a transposed or
        channels-last tensor stays so, a slice keeps its steps, an expanded one its zero
        strides (and only the bytes it spans are copied, not one per element)."""
        shape, stride = tuple(tensor.shape), tuple(tensor.stride())
        count = extent_bytes(shape, stride, tensor.element_size()) // tensor.element_size()
        flat = self._allocator.empty((count,), tensor.dtype)
        flat.copy_(tensor.as_strided((count,), (1,)))
        return flat.as_strided(shape, stride)


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
