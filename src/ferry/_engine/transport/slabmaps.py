"""Main-process side of a worker's shared-memory slabs: mapped once, lent with batches, given
back or retired.

:class:`SlabMaps` maps each slab a worker announces (by name, or by the descriptor that follows
the announcement) and keeps the mapping, so a slab the worker writes again costs no new mapping
and no page faults here. :meth:`SlabMaps.decode` turns a batch's slab references back into
tensors over the mapping, without a copy. A slab is *lent* with its batch and *freed* once every
tensor of that batch made from it is gone: the batch's tensors in one slab are all made over one
``memoryview`` of it, whose weak reference says when the last of them went (:class:`_Lease`).

A slab larger than ``shm.REUSE_LIMIT`` carries one batch (``NewSlab.reuse`` is false): the
worker let go of it once the batch was sent, and it is unmapped here as soon as the batch is
dropped, in whichever thread drops it, so its memory goes back at once, as torch's does.

A freed slab that can be reused goes one of two ways, decided here, where everything about the
worker's slabs is known (the worker keeps every slab until it is told):

* **given back** in the next task sent to the worker (``Fetch.freed``), to be written again;
* **retired** (``Retire``): this process drops its mapping at once and the worker closes the
  slab, so its memory goes back to the system as soon as the worker has read the message (its
  reader thread does, also while a batch is being made).

The worker is given back at most what its tasks can use: its slabs that are neither lent nor
waiting here, plus those given back, stay within the most tasks it has held at once (the
prefetch depth) times the slabs a batch takes. Slabs too small for the worker's recent batches
(sizes grew) are retired, and so are all freed slabs once the epoch has no task left to send
(:meth:`SlabMaps.drain`): a worker with nothing more to make keeps nothing it was lent.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
import threading
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch

from ferry._core.alloc import extent_bytes
from ferry._engine.transport.messages import NewSlab
from ferry._engine.transport.slabfile import (
    descriptor_limit,
    is_descriptor_limit,
    map_file,
    open_named,
    recv_fd,
)

__all__ = ["RECENT_BATCHES", "SlabMaps"]

# How many of a worker's latest batches size its slabs (here and in the worker's allocator).
RECENT_BATCHES = 8


class _Lease:
    """One batch's use of one slab: free again when the last tensor over it is gone.

    Every tensor of the batch in that slab is made over one ``memoryview`` of the slab (each
    tensor holds it), watched by a weak reference whose callback releases the slab. The lease
    (and so the reference) is kept in its :class:`SlabMaps`'s ``_lent`` until then: a plain
    callback reference, not ``weakref.finalize``, which costs a few microseconds a batch more,
    in a global registry and an exit hook that a lease does not need.
    """

    __slots__ = ("done", "key", "ref", "view")

    def __init__(self, key: int, mapping: Any, done: Callable[[int], None]) -> None:
        self.key = key
        self.view: memoryview | None = memoryview(mapping)
        self.ref: weakref.ref[memoryview] | None = None
        self.done = done

    def returned(self, ref: weakref.ref[memoryview]) -> None:
        """The batch's last tensor over the slab is gone (in whichever thread dropped it)."""
        self.done(self.key)


class _BatchUnpickler(pickle.Unpickler):
    """Unpickles one batch, making its slab references tensors over the leases' views."""

    def __init__(self, file: io.BytesIO, leases: dict[int, _Lease]) -> None:
        super().__init__(file)
        self.leases = leases
        self.loaded: dict[Any, torch.Tensor] = {}
        self.used: set[int] = set()  # the slabs its tensors are over
        self.nbytes = 0  # the bytes of the slabs they span

    def persistent_load(self, pid: Any) -> torch.Tensor:
        # The same reference twice is the same tensor object twice, as it was pickled.
        tensor = self.loaded.get(pid)
        if tensor is not None:
            return tensor
        _, slab_id, offset, dtype, shape, stride = pid
        itemsize = dtype.itemsize
        count = extent_bytes(shape, stride, itemsize) // itemsize
        self.nbytes += count * itemsize
        self.used.add(slab_id)
        flat = torch.frombuffer(self.leases[slab_id].view, dtype=dtype, count=count, offset=offset)
        tensor = self.loaded[pid] = flat.as_strided(shape, stride)
        return tensor


class SlabMaps:
    """Main-side view of one worker's slabs (see the module docstring)."""

    def __init__(self) -> None:
        self._maps: dict[int, Any] = {}
        self._sizes: dict[int, int] = {}
        # Freed since they were last given back; lent (with a batch not freed yet). Leases are
        # released in whichever thread drops a batch's last tensor, also from a garbage
        # collection inside this class's own code: hence a lock this thread may take again.
        self._freed: list[int] = []
        self._lent: dict[int, _Lease] = {}  # slab id: the lease of the batch over it
        self._once: set[int] = set()  # slabs that carry one batch (NewSlab.reuse is false)
        self._lock = threading.RLock()
        self._retired: list[int] = []  # decided, not told to the worker yet
        # No task is left to send to the worker (until it is given slabs back again: the next
        # epoch's Resume, or a task resent): freed slabs are retired (:meth:`drain`).
        self.draining = False
        self._held = 0  # bytes mapped here now, user-held batches of retired slabs included
        self.held_peak = 0  # the most _held has been
        # Tasks the worker holds (sent, not answered), the most it has held at once, the slabs
        # its latest batch took, and the bytes of its latest batches.
        self.tasks = 0
        self._peak = 0
        self._per_batch = 1
        self._recent: collections.deque[int] = collections.deque(maxlen=RECENT_BATCHES)
        # A slab announced whose descriptor has not been read yet.
        self.awaiting: NewSlab | None = None

    # -- mapping -------------------------------------------------------------------------------

    def announced(self, slab: NewSlab, worker_id: int) -> None:
        """Map the slab ``slab`` announces by its name; a slab without a name waits for the
        descriptor that follows the announcement on the connection (:meth:`take_descriptor`).
        Holds no descriptor afterwards. The slabs it replaces are unmapped."""
        if slab.replaces:
            with self._lock:
                for slab_id in slab.replaces:
                    self._maps.pop(slab_id, None)
                    self._sizes.pop(slab_id, None)
        if slab.name is None:
            self.awaiting = slab
            return
        with self._limit_reached(worker_id):
            self._keep(slab, open_named(slab.name, slab.size))

    def take_descriptor(self, conn: Connection, worker_id: int) -> None:
        """Receive the descriptor of the slab announced last and map it; call only when it is
        there to read (a stopped worker may not have sent it yet: the caller must not block)."""
        slab, self.awaiting = self.awaiting, None
        assert slab is not None
        with self._limit_reached(worker_id):
            fd = recv_fd(conn)
        try:
            self._keep(slab, map_file(fd, slab.size))
        finally:
            os.close(fd)

    def _keep(self, slab: NewSlab, mapping: Any) -> None:
        with self._lock:
            self._maps[slab.slab_id] = mapping
            self._sizes[slab.slab_id] = slab.size
            if not slab.reuse:
                self._once.add(slab.slab_id)
            self._held += slab.size
            self.held_peak = max(self.held_peak, self._held)
        weakref.finalize(mapping, self._unmapped, slab.size)

    def _unmapped(self, size: int) -> None:
        with self._lock:
            self._held -= size

    def held_bytes(self) -> int:
        """Bytes of this worker's shared memory mapped in this process now: slabs kept for
        reuse, and retired ones still under batches the user holds."""
        return self._held

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

    # -- tasks ---------------------------------------------------------------------------------

    def sent(self) -> None:
        """A task went to the worker."""
        self.tasks += 1
        self._peak = max(self._peak, self.tasks)

    def answered(self) -> None:
        """The worker answered a task (a batch, an error, the end of its stream)."""
        self.tasks = max(0, self.tasks - 1)

    # -- freed slabs: given back or retired ----------------------------------------------------

    def take_freed(self, epoch: bool = False) -> tuple[int, ...]:
        """Freed slabs to give back to the worker with its next task, or as its next ``epoch``
        begins (persistent workers); those it cannot use are retired instead
        (:meth:`take_retired`)."""
        self.draining = False
        with self._lock:
            if not self._freed:
                return ()
            freed, self._freed = self._freed, []
            lent = len(self._lent)
            if self._once:  # (lent here: counted below among the slabs it carries once)
                lent -= len(self._once.intersection(self._lent))
        need = max(self._recent, default=0)
        sizes = self._sizes
        # The worker's own: neither lent nor freed here (idle, or under a task in progress).
        own = len(self._maps) - len(self._once) - lent - len(freed)
        room = max(0, max(self._peak, 1) * self._per_batch - own)
        if epoch:
            # Also the slabs of the batch the loop will hold while the worker makes its next
            # ones (in an epoch, those are lent, outside the bound), unless it holds one of this
            # worker's now: else each epoch a worker made and faulted a slab anew (the
            # regression of persistent workers).
            room += max(0, self._per_batch - lent)
        if room and len(freed) == 1 and sizes[freed[0]] >= need:
            return (freed[0],)  # (the steady state: one batch's slab back, once a batch)
        usable = sorted((s for s in freed if sizes[s] >= need), key=sizes.__getitem__)
        given = usable[:room]
        self._retire([s for s in freed if s not in given])
        return tuple(given)

    def drain(self) -> None:
        """No task is left to send to this worker in this epoch: every freed slab is retired,
        and once the worker has answered all its tasks, the slabs it was given back too."""
        with self._lock:
            freed, self._freed = self._freed, []
            if self.tasks == 0:
                kept = self._once | self._lent.keys() | set(freed)
                freed += [slab_id for slab_id in list(self._maps) if slab_id not in kept]
        self._retire(freed)

    def take_retired(self) -> tuple[int, ...]:
        """Slabs retired since the last call, for the worker to close (``Retire``)."""
        retired, self._retired = tuple(self._retired), []
        return retired

    def _retire(self, slab_ids: list[int]) -> None:
        with self._lock:
            for slab_id in slab_ids:
                # The mapping goes with its last reference (no tensor uses a freed slab).
                del self._maps[slab_id], self._sizes[slab_id]
        self._retired.extend(slab_ids)

    def _release(self, slab_id: int) -> None:
        with self._lock:
            self._lent.pop(slab_id, None)
            if slab_id in self._once:  # the worker let go of it: unmapped now
                self._once.discard(slab_id)
                self._maps.pop(slab_id, None)
                self._sizes.pop(slab_id, None)
            else:
                self._freed.append(slab_id)

    def release(self, slab_ids: tuple[int, ...]) -> None:
        """Give back slabs of a batch that is dropped without being read."""
        for slab_id in slab_ids:
            self._release(slab_id)

    # -- batches -------------------------------------------------------------------------------

    def decode(self, payload: bytes, slabs: tuple[int, ...]) -> Any:
        """The batch ``payload`` describes, its tensors over the slabs ``slabs`` (lent until
        the batch's last tensor over each is gone; see :class:`_Lease`)."""
        if not slabs:
            return pickle.loads(payload)
        maps = self._maps
        leases = {slab_id: _Lease(slab_id, maps[slab_id], self._release) for slab_id in slabs}
        self._per_batch = len(slabs)
        unpickler = _BatchUnpickler(io.BytesIO(payload), leases)
        batch = unpickler.load()
        self._recent.append(unpickler.nbytes)
        used = unpickler.used
        with self._lock:
            for slab_id, lease in leases.items():
                view, lease.view = lease.view, None
                if slab_id in used:
                    # Watched from now on; the view goes with the batch's last tensor over it.
                    lease.ref = weakref.ref(view, lease.returned)  # type: ignore[arg-type]
                    self._lent[slab_id] = lease
                else:  # e.g. a slab holding only tensors that were dropped
                    self._release(slab_id)
        return batch

    def close(self) -> None:
        # Each mapping goes when the last tensor over it does (the user may still hold some).
        with self._lock:
            self._maps.clear()
            self._sizes.clear()
            self._once.clear()
