"""A group of workers: started together, stopped together.

Each worker is held by a handle of its kind: a :class:`ProcessHandle` (its process, and its
end of a duplex pipe) or a :class:`ThreadHandle` (its thread, its queue of tasks, and what it
is doing); both are :class:`WorkerHandle`, which answers like torch's ``iter(loader)._workers``
entries. A group holds workers of one kind.

Starting: process workers get one duplex pipe each and are started with the loader's
multiprocessing context (a dataset or function that cannot be pickled under spawn or forkserver
is named in the error); thread workers get a queue each and share one result queue.

Stopping (:meth:`WorkerGroup.shutdown`) is layered and bounded: ask every worker to stop, then
terminate, then kill, each with a deadline, so every worker is gone within about two seconds
whatever it is doing. It runs from the iterator's ``weakref.finalize``, so the group holds no
reference to the iterator. At interpreter exit (an uncaught KeyboardInterrupt: Ctrl-C) a worker
in the middle of a fetch is terminated as soon as it says so, since nothing will take its batch
and the user is waiting for the prompt; idle workers still leave cleanly. The steps of each kind
are its own (:func:`_stop_processes`, :func:`_stop_threads`), set as the group's workers start.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import pickle
import queue
import threading
import time
import warnings
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from ferry._core.intra_op import settle
from ferry._core.rng import ready_to_fork
from ferry._engine.crew.placement import Tally, WorkerMover
from ferry._engine.crew.worker import (
    Activity,
    WorkerConfig,
    process_worker_main,
    sigint_held,
    sigint_ignored,
    thread_worker_main,
)
from ferry._engine.plan import EpochPlan
from ferry._engine.transport.messages import NewSlab, Stack, Stop
from ferry._engine.transport.pin import Pinner
from ferry._engine.transport.shm import SlabMaps
from ferry._engine.transport.slabfile import recv_fd, remove_names
from ferry._engine.work.aio import AsyncReads
from ferry._engine.work.reads import SampleReads, wait_for_reads

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

__all__ = [
    "ProcessHandle",
    "ThreadHandle",
    "WorkerGroup",
    "WorkerHandle",
    "start_processes",
    "start_threads",
]

# Shutdown deadlines (seconds): stop politely, then SIGTERM, then SIGKILL.
_JOIN_AFTER_STOP = 0.5
# A worker that has left its loop and is exiting (see _stop_processes).
_JOIN_LEAVING = 3.0
_JOIN_AFTER_TERMINATE = 0.5
_JOIN_AFTER_KILL = 0.5
# Thread workers cannot be interrupted: they exit after their current fetch. Wait only briefly.
_JOIN_THREADS = 0.2
# ...but at interpreter exit, wait for them up to this long: a daemon thread still inside a
# torch op when the interpreter finalizes aborts the process ("terminate called without an
# active exception").
_JOIN_THREADS_AT_EXIT = 5.0


class WorkerHandle(ABC):
    """The main process's end of one worker, of either kind.

    Like torch's ``iter(loader)._workers`` entries (multiprocessing processes), which user
    code reads: ``pid``, ``exitcode``, ``name``, ``is_alive()`` and ``join()`` answer also after
    the epoch ended and the workers were stopped. A thread worker's pid is the main process's.
    """

    # How it ended: a process worker's once it was joined; a thread has none.
    exitcode: int | None = None

    def __init__(self, worker_id: int, pid: int | None) -> None:
        self.worker_id = worker_id
        self.pid = pid
        # When it was started (time.monotonic()), and whether it said it is ready (its set-up,
        # worker_init_fn included, is done): a stall report tells start-up from a stuck fetch.
        self.started = time.monotonic()
        self.ready = False

    @property
    def name(self) -> str:
        return f"ferry-worker-{self.worker_id}"

    @abstractmethod
    def is_alive(self) -> bool: ...

    @abstractmethod
    def join(self, timeout: float | None = None) -> None: ...

    @abstractmethod
    def send(self, message: Any) -> None:
        """Hand the worker a message (OSError or ValueError: it is gone)."""


class ProcessHandle(WorkerHandle):
    """A worker process: its process object and the main process's end of their pipe."""

    def __init__(self, worker_id: int, process: BaseProcess, conn: Connection) -> None:
        super().__init__(worker_id, None)  # (its pid once it is started)
        self.process = process
        self.conn = conn
        self.slabs = SlabMaps()  # the slabs it shared, mapped here
        # Once the group is shut down (or the worker replaced), the process object is closed:
        # how it ended is kept here.
        self.ended = False
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        return not self.ended and self.process.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if not self.ended:
            self.process.join(timeout)
            self.exitcode = self.process.exitcode

    def send(self, message: Any) -> None:
        # Plain pickle, not multiprocessing's: its tensor reduction would share index tensors
        # through file descriptors and start a descriptor-sharing thread for good.
        self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def receive(self, *, keep_slabs: bool = True) -> Any:
        """One step of what the worker sent; call only when the pipe has something to read.

        One step at a time, so that a worker stopped (SIGSTOP) between a slab's announcement,
        its descriptor and its batch cannot block the reader: the next message (a
        :class:`NewSlab` included), or None when the step was the descriptor of a slab
        announced without a name. Its slabs are mapped (:class:`SlabMaps`); with
        ``keep_slabs=False`` (the group is stopping) none is mapped and a descriptor is closed
        as it comes. EOFError or OSError: the pipe closed.
        """
        slabs = self.slabs
        if slabs.awaiting is not None:
            if keep_slabs:
                slabs.take_descriptor(self.conn, self.worker_id)
            else:
                slabs.awaiting = None
                os.close(recv_fd(self.conn))
            return None
        message = pickle.loads(self.conn.recv_bytes())
        if isinstance(message, NewSlab):
            if keep_slabs:
                slabs.announced(message, self.worker_id)
            elif message.name is None:
                slabs.awaiting = message  # its descriptor follows
        return message


class ThreadHandle(WorkerHandle):
    """A worker thread: its thread, its queue of tasks, and its activity, which the main
    thread reads for stall reports."""

    def __init__(
        self,
        worker_id: int,
        thread: threading.Thread,
        inbox: queue.SimpleQueue[Any],
        activity: Activity,
    ) -> None:
        super().__init__(worker_id, os.getpid())
        self.thread = thread
        self.inbox = inbox
        self.activity = activity

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if self.thread.ident is not None:
            self.thread.join(timeout)

    def send(self, message: Any) -> None:
        self.inbox.put(message)

    def stack(self) -> Stack:
        """What it is doing now, read from this thread."""
        return self.activity.stack(self.worker_id, self.thread.ident)


H = TypeVar("H", bound=WorkerHandle)


class WorkerGroup(Generic[H]):
    """The workers of one iterator, all of one kind: started together, stopped together.

    Holds no reference to the iterator, so the iterator's finalizer can stop the group.
    """

    def __init__(self) -> None:
        self.workers: list[H] = []
        self.outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()  # thread workers' results
        self.closed = False
        # Set at shutdown: thread workers check it before each fetch, so they do not work
        # through tasks queued behind the stop request.
        self.stopping = threading.Event()
        # A forked child inherits this object (and the finalizer that calls shutdown); only the
        # process that started the workers may stop them.
        self.owner_pid = os.getpid()
        # Whether the workers' slabs travel by name (see ferry._engine.transport.slabfile).
        self.named_slabs = False
        # Dead workers that were replaced (max_worker_restarts), kept for their slabs.
        self.replaced: list[H] = []
        # pin_memory=True: the thread that pins the workers' batches as they arrive.
        self.pinner: Pinner | None = None
        # move_workers: the thread that moves process workers round their CPUs (placement.py).
        self.mover: WorkerMover | None = None
        # ... and where its process workers count the samples they make, for the mover.
        self.tally: Tally | None = None
        # Thread workers of a map-style dataset: their shared per-sample reads (reads.py); an
        # async dataset's workers: its reads on an event loop (aio.py).
        self.reads: SampleReads | AsyncReads | None = None
        # How its workers stop: their kind's steps (_stop_processes, _stop_threads), set as
        # they start. Returns the deadline the group's other threads (its reads) share.
        self.stop_workers: Callable[[WorkerGroup[H], bool], float] = _none_started

    def shutdown(self) -> None:
        """Stop every worker within about two seconds, whatever state it is in."""
        if self.closed or os.getpid() != self.owner_pid:
            return
        self.closed = True
        self.stopping.set()
        exiting = interpreter_exiting()
        with _deaf_to_interrupts(exiting):
            if self.mover is not None:
                self.mover.close()
            if self.tally is not None:
                self.tally.close()
            if self.pinner is not None:
                self.pinner.close()
            deadline = self.stop_workers(self, exiting)
            if self.reads is not None:  # after the workers: no read is asked for any more
                self.reads.close(max(0.0, deadline - time.monotonic()))


def interpreter_exiting() -> bool:
    """Whether the interpreter is exiting (an uncaught KeyboardInterrupt, or the script's end):
    threading marks the main thread ended before atexit runs the iterators' finalizers."""
    return not threading.main_thread().is_alive()


@contextlib.contextmanager
def _deaf_to_interrupts(exiting: bool) -> Iterator[None]:
    """At interpreter exit, SIGINT is ignored while ferry stops its workers.

    Ctrl-C often comes twice in quick succession (a terminal's to the whole process group, then
    ``timeout -s INT`` passing it on to the main process): the first ends the program, and the
    second, landing in this cleanup, would raise KeyboardInterrupt in an atexit callback. Python
    then prints "Exception ignored in ..." with a second traceback, and the cleanup is cut short.
    The program is ending already and every step here has its deadline (about two seconds for
    processes, ``_JOIN_THREADS_AT_EXIT`` for threads), so nothing is lost by not listening.
    Only the main thread can set a handler; elsewhere, and outside exit, this does nothing."""
    if not exiting:
        yield
        return
    with sigint_ignored():
        yield


def _none_started(group: WorkerGroup[Any], exiting: bool) -> float:
    return time.monotonic() + _JOIN_THREADS


def _ask_to_stop(workers: Sequence[WorkerHandle]) -> None:
    for worker in workers:
        with contextlib.suppress(OSError, ValueError):  # already gone
            worker.send(Stop())


def _stop_processes(group: WorkerGroup[ProcessHandle], exiting: bool) -> float:
    """Process workers: Stop, then SIGTERM, then SIGKILL, each with its deadline; then each is
    reaped and its pipe and slabs closed. ``exiting``: the interpreter is exiting."""
    processes = group.workers
    _ask_to_stop(processes)
    # Each process worker answers Stop at once, saying whether it is in a fetch. At exit such a
    # worker is terminated then and there, as torch's are (multiprocessing's atexit terminates
    # daemonic children): waiting out a fetch nobody will use only delays Ctrl-C. Otherwise it
    # gets _JOIN_AFTER_STOP to end its fetch and leave.
    leaving = _drain_until_exit(processes, time.monotonic() + _JOIN_AFTER_STOP, end_busy=exiting)
    # Workers that said they are leaving are finalizing their interpreter (a spawned one with
    # torch loaded takes about half a second): let them finish rather than SIGTERM.
    finishing = [w for w in processes if w.worker_id in leaving and w.process.is_alive()]
    _drain_until_exit(finishing, time.monotonic() + _JOIN_LEAVING)
    for step, grace in (("terminate", _JOIN_AFTER_TERMINATE), ("kill", _JOIN_AFTER_KILL)):
        alive = [w for w in processes if w.process.is_alive()]
        if not alive:
            break
        for worker in alive:
            getattr(worker.process, step)()
        _drain_until_exit(alive, time.monotonic() + grace)
    deadline = time.monotonic() + _JOIN_THREADS
    for worker in processes:
        if worker.pid is not None:
            worker.process.join(0)
            if not worker.process.is_alive():
                worker.exitcode = worker.process.exitcode
                worker.ended = True
                worker.process.close()  # its sentinel's descriptor goes now
            if group.named_slabs:  # names a worker made but the main process never opened
                remove_names(group.owner_pid, worker.pid)
        worker.conn.close()
        worker.slabs.close()
    for worker in group.replaced:  # (dead workers replaced: their slabs were kept for batches)
        worker.slabs.close()
    return deadline


def _drain_until_exit(
    workers: list[ProcessHandle], deadline: float, *, end_busy: bool = False
) -> set[int]:
    """Wait for the processes to exit, reading (and dropping) what they still send, so none
    blocks on a full pipe; file descriptors of slabs that arrive are closed. Returns the ids of
    the workers that said they are leaving (their loop ended). ``end_busy``: a worker that says
    it is in a fetch is terminated."""
    leaving: set[int] = set()
    sentinels = {w.process.sentinel: w for w in workers}
    conns = {w.conn: w for w in workers}
    while sentinels and (left := deadline - time.monotonic()) > 0:
        for ready in wait([*sentinels, *conns], timeout=left):
            if isinstance(ready, int):
                # The sentinel fires as the child closes its files, just before it can be
                # reaped: a short blocking join collects it instead of leaving a zombie.
                sentinels.pop(ready).process.join(max(0.05, deadline - time.monotonic()))
                continue
            worker = conns[cast(Connection, ready)]
            try:
                message = worker.receive(keep_slabs=False)
                if isinstance(message, Stop):
                    leaving.add(worker.worker_id)
                elif end_busy and isinstance(message, Stack) and message.task is not None:
                    worker.process.terminate()
            except (EOFError, OSError):
                conns.pop(worker.conn, None)
    return leaving


def _stop_threads(group: WorkerGroup[ThreadHandle], exiting: bool) -> float:
    """Thread workers: Stop, then a short wait for each (a thread cannot be interrupted: it
    leaves after its current fetch)."""
    _ask_to_stop(group.workers)
    deadline = time.monotonic() + _JOIN_THREADS
    # (the iterator's finalizer runs where the garbage collector freed it: possibly on one
    # of its own worker threads, which leaves by itself once asked)
    here = threading.current_thread()
    for worker in group.workers:
        if worker.thread.is_alive() and worker.thread is not here:
            worker.thread.join(max(0.0, deadline - time.monotonic()))
    return deadline


def start_processes(
    group: WorkerGroup[ProcessHandle], configs: list[WorkerConfig], context: Any
) -> None:
    group.stop_workers = _stop_processes
    with _collector_frozen(context):
        for config in configs:
            group.workers.append(_start_process(config, context))


@contextlib.contextmanager
def _collector_frozen(context: Any) -> Iterator[None]:
    """Forked workers inherit the main process's objects in the collector's permanent
    generation, so their garbage collections never walk them: a collection writes to every
    object it visits (its GC header), which copies the pages they sit on in each worker
    (copy-on-write; about 35 MB a worker measured on 3M dicts, see docs/design/memory.md).
    The main process's objects go back to its oldest generation at once.

    A program that froze objects itself (``gc.freeze()``, the advice for forking servers and
    loaders) keeps them frozen: ``gc.unfreeze()`` cannot tell its objects from the ones frozen
    here, and would give the program's back to its collector (its freeze undone by the first
    epoch). Its workers then walk only what it made since it froze."""
    if context.get_start_method() != "fork":
        yield
        return
    ready_to_fork()
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def replace_process(
    group: WorkerGroup[ProcessHandle], config: WorkerConfig, context: Any
) -> ProcessHandle:
    """Start a process in place of worker ``config.worker_id``, which died: the dead one's
    pipe and process object are closed (its slabs stay mapped while batches use them)."""
    old = group.workers[config.worker_id]
    old.process.join(0.1)
    old.exitcode, old.ended = old.process.exitcode, True
    old.conn.close()
    with contextlib.suppress(ValueError):  # (still running only if join timed out)
        old.process.close()
    if group.named_slabs and old.pid is not None:
        remove_names(group.owner_pid, old.pid)
    with _collector_frozen(context):
        new = _start_process(config, context)
    group.workers[config.worker_id] = new
    group.replaced.append(old)
    return new


def _start_process(config: WorkerConfig, context: Any) -> ProcessHandle:
    parent_end, child_end = context.Pipe(duplex=True)
    process = context.Process(
        target=process_worker_main,
        args=(config, child_end),
        name=f"ferry-worker-{config.worker_id}",
        daemon=True,
    )
    worker = ProcessHandle(config.worker_id, process, parent_end)
    try:
        with sigint_held():
            process.start()
    except Exception as exc:
        child_end.close()
        parent_end.close()
        if isinstance(exc, (TypeError, AttributeError, pickle.PicklingError)):
            warnings.warn(
                "Got pickle error when attempting to start a worker Process: the "
                f"{context.get_start_method()!r} start method pickles what each worker "
                "needs (dataset, collate_fn, worker_init_fn), and one of them cannot be "
                "pickled; the error that follows names it.",
                UserWarning,
                stacklevel=6,
            )
        raise _explain_start_failure(exc, config, context) from exc
    child_end.close()
    worker.pid = process.pid
    return worker


def _explain_start_failure(exc: Exception, config: WorkerConfig, context: Any) -> Exception:
    """Name what could not be sent to a worker process (spawn and forkserver pickle it)."""
    method = context.get_start_method()
    for name in ("dataset", "collate_fn", "worker_init_fn"):
        value = getattr(config, name)
        try:
            pickle.dumps(value)
        except Exception as why:
            message = (
                f"DataLoader could not start worker processes with the {method!r} start method: "
                f"{name} ({type(value).__qualname__}) cannot be pickled ({why}). Define it at "
                "module level (not a lambda or a local function), use "
                "multiprocessing_context='fork', or use worker_type='thread'."
            )
            try:
                return type(exc)(message)
            except Exception:
                return RuntimeError(message)
    return exc


_thread_groups: weakref.WeakSet[WorkerGroup[ThreadHandle]] = weakref.WeakSet()
# Every thread worker started, while it runs: also those of an iterator already dropped, which
# were asked to stop and may still be in their last fetch.
_thread_workers: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


@atexit.register
def _join_thread_workers_at_exit() -> None:
    """Let thread workers, and the reads of their pools, finish their current fetch before the
    interpreter finalizes: a daemon thread inside a torch operation that let go of the GIL takes
    it back while the interpreter finalizes, unwinds through torch's C++ frames and aborts the
    process ("terminate called without an active exception"). Also those of a loader dropped
    already (a ``break`` out of the loop). At most ``_JOIN_THREADS_AT_EXIT`` in all."""
    deadline = time.monotonic() + _JOIN_THREADS_AT_EXIT
    here = threading.current_thread()
    with _deaf_to_interrupts(interpreter_exiting()):
        for group in list(_thread_groups):
            group.stopping.set()
            _ask_to_stop([worker for worker in group.workers if worker.thread.is_alive()])
        for thread in list(_thread_workers):
            if thread.is_alive() and thread is not here:
                thread.join(max(0.0, deadline - time.monotonic()))
        wait_for_reads(deadline)


def start_threads(
    group: WorkerGroup[ThreadHandle], configs: list[WorkerConfig], plan: EpochPlan
) -> None:
    group.stop_workers = _stop_threads
    _thread_groups.add(group)
    pool = plan.buffer_pool
    settle()  # this thread's intra-op count, before the workers change the default for a moment
    for config in configs:
        inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        activity = Activity()
        thread = threading.Thread(
            target=thread_worker_main,
            args=(config, inbox, group.outbox, pool),
            kwargs={"stopping": group.stopping, "activity": activity},
            name=f"ferry-worker-{config.worker_id}",
            daemon=True,
        )
        group.workers.append(ThreadHandle(config.worker_id, thread, inbox, activity))
        _thread_workers.add(thread)
        thread.start()
