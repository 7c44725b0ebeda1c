"""The main process's end of a group of workers: tasks out, typed messages back.

One :class:`Channel` type serves both kinds of worker, so the worker iterator never asks which
kind it runs:

* :class:`ProcessChannel`: one pipe per worker process; the main process waits on every pipe
  *and* every process sentinel at once (:func:`multiprocessing.connection.wait`), so a worker
  that dies is noticed as soon as it dies. Batches arrive as pickles whose tensors live in
  shared-memory slabs (:mod:`ferry._engine.transport.shm`); index tensors travel as plain ints.
* :class:`ThreadChannel`: thread workers put their messages on one shared queue; objects pass
  as they are.

:meth:`Channel.receive` returns the next :data:`WorkerMessage` (slab announcements are handled
inside) or None when ``wait_for`` passed; a worker found dead raises :class:`WorkerGone`.

Freed slabs go back to their worker with its next task, or are retired (closed, their memory
returned) when the worker could not use them (see :mod:`ferry._engine.transport.slabmaps`); once the
iterator says no task is left to send this epoch (:meth:`Channel.no_more_tasks`), every slab
freed from then on is retired at the next :meth:`Channel.receive`.
"""

from __future__ import annotations

import contextlib
import math
import queue
import select
from abc import ABC, abstractmethod
from collections.abc import Sequence
from multiprocessing.connection import wait
from typing import Any, Generic, TypeVar, cast

from ferry._engine.crew.group import ProcessHandle, ThreadHandle, WorkerGroup, WorkerHandle
from ferry._engine.transport.messages import (
    Done,
    Exhausted,
    Failed,
    Fetch,
    FirstLook,
    IndexTensor,
    NewSlab,
    Ready,
    Resume,
    Retire,
    Stack,
)
from ferry._engine.transport.slabfile import SHM_DIR, shm_space
from ferry.errors import SharedMemoryWarning, warn_from_user_code

__all__ = [
    "Channel",
    "ProcessChannel",
    "ThreadChannel",
    "WorkerGone",
    "WorkerMessage",
]

WorkerMessage = Ready | Done | Exhausted | Failed | Stack | FirstLook

H = TypeVar("H", bound=WorkerHandle)


def take(box: queue.SimpleQueue[Any], wait_for: float) -> Any:
    """The next item of ``box`` within ``wait_for`` seconds (0: one already there), or None.

    ``get_nowait()`` first, always: on Python 3.10, ``SimpleQueue.get(timeout=...)`` can block
    for ever. A ``put()`` leaves the queue's lock released, and a ``get()`` that finds the item
    does not take the lock back; the next ``get(timeout=0)`` then acquires the free lock, finds
    the queue empty, and waits again with what is left of its timeout, which is negative once a
    microsecond has passed: no limit (a thread loop hung within 50,000 rounds; Python 3.11
    clamps it). ``get_nowait()`` leaves the lock held, as a timed wait needs it."""
    try:
        return box.get_nowait()
    except queue.Empty:
        if wait_for <= 0:
            return None
    try:
        return box.get(timeout=wait_for)
    except queue.Empty:
        return None


class WorkerGone(Exception):
    """A worker's process or thread ended without being asked to (its pipe closed, it died)."""

    def __init__(self, worker: WorkerHandle) -> None:
        super().__init__(f"worker {worker.worker_id} is gone")
        self.worker = worker


class Channel(ABC, Generic[H]):
    """Sends tasks to a group's workers (handles of type ``H``) and receives their messages
    (see the module doc)."""

    def __init__(self, group: WorkerGroup[H]) -> None:
        self.workers = group.workers

    @abstractmethod
    def send_task(self, worker: H, task: int, key: Any) -> None:
        """Ask ``worker`` to make batch ``task`` from ``key``; WorkerGone if it is gone."""

    @abstractmethod
    def resume(self, worker: H) -> None:
        """A new epoch begins for ``worker`` (persistent workers); OSError if it is gone."""

    def drop(self, worker_id: int, done: Done) -> None:
        """``done`` will never be read (its epoch was abandoned): what it holds goes back."""
        return  # (thread workers' batches hold nothing of the worker's)

    def no_more_tasks(self) -> None:
        """The epoch has no task left to send: the slabs freed from now on are retired, not
        kept for tasks that will not come (until a task is sent again: the next epoch)."""
        return  # (thread workers have no slabs)

    def held_bytes(self) -> int:
        """Bytes of shared memory the workers' batches hold in this process now (slabs mapped:
        kept for reuse, or under batches in flight or held by the user)."""
        return 0

    def held_peak_bytes(self) -> int:
        """The most :meth:`held_bytes` has been for each worker, summed (an upper bound of the
        most held at once)."""
        return 0

    @abstractmethod
    def receive(
        self, wait_for: float, in_flight: Sequence[int]
    ) -> tuple[int, WorkerMessage] | None:
        """The next message and its worker's id, or None after ``wait_for`` seconds.

        ``in_flight[w]``: how many tasks worker ``w`` holds (a worker that ended holding none
        is not missed).
        """

    @abstractmethod
    def batch(self, worker_id: int, done: Done) -> Any:
        """The batch a :class:`Done` carries, ready for the user."""

    def replaced(self, old: H, new: H) -> None:
        """Worker ``old`` died and ``new`` took its place (process workers only)."""
        raise NotImplementedError(f"{type(self).__name__} does not replace workers")

    def joined(self, workers: Sequence[H]) -> None:
        """``workers`` were started after the channel was made (they are in the group's list)."""
        return


class ProcessChannel(Channel[ProcessHandle]):
    def __init__(self, group: WorkerGroup[ProcessHandle]) -> None:
        super().__init__(group)
        # Every pipe and every sentinel, fixed once the workers have started: registered once
        # in a poll object (multiprocessing's wait() builds a selector on every call, which
        # costs tens of microseconds a batch).
        self._pipes: dict[int, ProcessHandle] = {}
        self._sentinels: dict[int, ProcessHandle] = {}
        self._poller = select.poll() if hasattr(select, "poll") else None
        for worker in self.workers:
            self._watch(worker)
        self._group = group
        self._warned = False  # SharedMemoryWarning, once per group of workers

    def no_more_tasks(self) -> None:
        for worker in self.workers:
            worker.slabs.draining = True
        self._retire_freed()

    def _retire_freed(self) -> None:
        for worker in self.workers:
            if not worker.slabs.draining:
                continue
            worker.slabs.drain()
            if retired := worker.slabs.take_retired():
                with contextlib.suppress(OSError, ValueError):  # gone: nothing to close there
                    worker.send(Retire(retired))

    def held_bytes(self) -> int:
        handles = [*self._group.workers, *self._group.replaced]
        return sum(worker.slabs.held_bytes() for worker in handles)

    def held_peak_bytes(self) -> int:
        handles = [*self._group.workers, *self._group.replaced]
        return sum(worker.slabs.held_peak for worker in handles)

    def _watch(self, worker: ProcessHandle) -> None:
        pipe, sentinel = worker.conn.fileno(), worker.process.sentinel
        self._pipes[pipe] = self._sentinels[sentinel] = worker
        if self._poller is not None:
            self._poller.register(pipe, select.POLLIN)
            self._poller.register(sentinel, select.POLLIN)

    def joined(self, workers: Sequence[ProcessHandle]) -> None:
        for worker in workers:
            self._watch(worker)

    def replaced(self, old: ProcessHandle, new: ProcessHandle) -> None:
        """Worker ``old`` died and ``new`` took its place: watch the new one instead."""
        for fds in (self._pipes, self._sentinels):
            for fd in [fd for fd, worker in fds.items() if worker is old]:
                del fds[fd]
                if self._poller is not None:
                    self._poller.unregister(fd)
        self._watch(new)

    def send_task(self, worker: ProcessHandle, task: int, key: Any) -> None:
        slabs = worker.slabs
        slabs.sent()
        freed = slabs.take_freed()
        try:
            if retired := slabs.take_retired():
                worker.send(Retire(retired))
            worker.send(Fetch(task, IndexTensor.pack(key), freed))
        except OSError:
            raise WorkerGone(worker) from None

    def resume(self, worker: ProcessHandle) -> None:
        worker.send(Resume(worker.slabs.take_freed(epoch=True)))

    def drop(self, worker_id: int, done: Done) -> None:
        if done.slabs:  # (dropped unread, its slabs go straight back)
            self.workers[worker_id].slabs.release(done.slabs)

    def _ready(self, wait_for: float) -> list[int]:
        if self._poller is not None:
            return [fd for fd, _ in self._poller.poll(math.ceil(wait_for * 1000))]
        # No poll() (Windows): multiprocessing's wait takes descriptors as they are.
        ready = wait([*self._pipes, *self._sentinels], wait_for)
        return [cast(int, fd) for fd in ready]

    def receive(
        self, wait_for: float, in_flight: Sequence[int]
    ) -> tuple[int, WorkerMessage] | None:
        self._retire_freed()
        ready = self._ready(wait_for)
        for fd in ready:
            worker = self._pipes.get(fd)
            if worker is not None and (message := self._read(worker)) is not None:
                return worker.worker_id, message
        for fd in ready:
            worker = self._sentinels.get(fd)
            if worker is None:
                continue
            while worker.conn.poll(0):  # its last words first
                if (message := self._read(worker)) is not None:
                    return worker.worker_id, message
            raise WorkerGone(worker)
        return None

    def _read(self, worker: ProcessHandle) -> WorkerMessage | None:
        """The worker's next message, reading only what is already there, so a worker stopped
        (SIGSTOP) between a slab's announcement, its descriptor and its batch cannot block the
        loop and its ``timeout``: None when only a slab arrived so far."""
        try:
            while True:
                message = worker.receive()  # (a slab's announcement or descriptor: mapped)
                if isinstance(message, NewSlab):
                    if message.fallback and not self._warned:
                        self._warned = True
                        _warn_fallback(message)
                elif message is not None:
                    break
                if not worker.conn.poll(0):
                    return None
        except (EOFError, OSError):
            raise WorkerGone(worker) from None
        assert isinstance(message, (Ready, Done, Exhausted, Failed, Stack, FirstLook)), message
        if isinstance(message, (Done, Exhausted, Failed)):
            worker.slabs.answered()
        return message

    def batch(self, worker_id: int, done: Done) -> Any:
        return self.workers[worker_id].slabs.decode(done.payload, done.slabs)


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def _warn_fallback(slab: NewSlab) -> None:
    """Say once that a worker's batches left /dev/shm, why, and how to keep them there."""
    total, _ = shm_space()
    warn_from_user_code(
        f"DataLoader: {SHM_DIR} has no room for a batch ({_mib(slab.size)} of shared memory "
        f"asked; {SHM_DIR} is {_mib(total)}: {slab.fallback}). Under "
        "torch.multiprocessing.set_sharing_strategy('file_system'), a worker whose batch does "
        "not fit now sends its batches in anonymous shared memory passed by file descriptor, "
        f"as the default strategy does, which the size of {SHM_DIR} does not limit: training "
        f"goes on. To keep 'file_system', enlarge {SHM_DIR} (docker run --shm-size=8g, or "
        "--ipc=host; in Kubernetes, a memory-backed emptyDir mounted on /dev/shm) or lower "
        "batch_size, prefetch_factor or num_workers; or leave the sharing strategy at its "
        "default ('file_descriptor').",
        SharedMemoryWarning,
    )


class ThreadChannel(Channel[ThreadHandle]):
    def __init__(self, group: WorkerGroup[ThreadHandle]) -> None:
        super().__init__(group)
        self._outbox = group.outbox

    def send_task(self, worker: ThreadHandle, task: int, key: Any) -> None:
        worker.send(Fetch(task, key, ()))

    def resume(self, worker: ThreadHandle) -> None:
        worker.send(Resume())

    def receive(
        self, wait_for: float, in_flight: Sequence[int]
    ) -> tuple[int, WorkerMessage] | None:
        got: tuple[int, WorkerMessage] | None = take(self._outbox, wait_for)
        if got is None:
            for worker in self.workers:
                if not worker.thread.is_alive() and in_flight[worker.worker_id]:
                    raise WorkerGone(worker) from None
        return got

    def batch(self, worker_id: int, done: Done) -> Any:
        return done.payload
