"""Worker side: one module-level entry point per worker kind, one loop shared by both.

A worker receives one frozen, picklable :class:`WorkerConfig`, seeds itself, runs the user's
``worker_init_fn``, then answers :class:`~ferry._engine.transport.messages.Fetch` messages with
batches made by the same fetch path the main process uses (:mod:`ferry._engine.work.fetch`).

Process workers ignore SIGINT (Ctrl-C is the main process's to handle) and watch their parent:
a reader thread drains the connection so the main process never blocks sending, and exits the
worker at once if the parent is gone (the connection closes, or the parent pid changes).
"""

from __future__ import annotations

import _thread
import contextlib
import dataclasses
import os
import pickle
import queue
import random
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch

from ferry._core.alloc import Allocator
from ferry._core.info import WorkerInfo, set_process_worker_info, set_thread_worker_info
from ferry._core.intra_op import one_intra_op_thread
from ferry._core.memory import MemorySampler
from ferry._core.ranks import inherit_rank_world, process_group_rank_world
from ferry._core.rng import seed_torch
from ferry._engine.position.cursor import WorkerCursor
from ferry._engine.position.keeper import PositionKeeper, WorkerReport
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
    StackRequest,
    Stop,
)
from ferry._engine.transport.shm import SLABS_SUPPORTED, SlabAllocator, encode_batch
from ferry._engine.transport.slabfile import remove_names, send_fd
from ferry._engine.work.fetch import (
    DROPPED,
    IterableFetcher,
    Made,
    MapFetcher,
    make_batch,
    make_fetcher,
)
from ferry._engine.work.reads import SampleReads, reads_serving

if TYPE_CHECKING:
    from ferry._engine.plan import EpochPlan

__all__ = ["WorkerConfig", "process_worker_main", "thread_worker_main"]

# How often a process worker checks that its parent is still alive.
PARENT_CHECK_INTERVAL = 0.25


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs, sent once when it starts."""

    worker_id: int
    num_workers: int
    base_seed: int
    dataset: Any
    iterable: bool
    auto_collation: bool
    collate_fn: Callable[[Any], Any]
    drop_last: bool
    worker_init_fn: Callable[[int], None] | None
    parent_pid: int
    # The main process's (rank, world size) in torch.distributed, for ferry.distributed.shard:
    # a spawned worker is not in the process group itself.
    rank_world: tuple[int, int] | None = None
    # Where this worker's first epoch starts (None: fresh), how often it takes the user's
    # states, and whether it reports its process's random generators (process workers do;
    # thread workers share the main process's).
    resume: WorkerCursor | None = None
    snapshot_every: int = 1
    track_rng: bool = False
    # Slabs travel by name (torch's sharing strategy is "file_system"), not by descriptor.
    named_slabs: bool = False
    # on_error="skip": samples that raise are dropped and reported, not raised.
    skip: bool = False
    # Keys a map-style dataset fetched since its snapshot in ``resume``, fetched again (results
    # dropped) after loading it, and whether the worker says what its user states are when an
    # epoch begins (with Ready: a map-style dataset with a state of its own, process workers).
    replay: tuple[Any, ...] = ()
    report_start: bool = False
    # Thread workers of a map-style dataset: the loader's shared per-sample reads (reads.py).
    reads: Any = None
    # Process workers under num_workers="auto": per-sample reads of the worker's own, at most
    # this many at once (0: one after another, as torch).
    read_limit: int = 0
    # Process workers that are moved round the CPUs: where each counts the samples it makes
    # (placement.Tally), for the mover.
    tally: Any = None

    @classmethod
    def of_plan(cls, plan: EpochPlan, worker_id: int, base_seed: int, **rest: Any) -> WorkerConfig:
        """Worker ``worker_id``'s configuration: what it takes from the loader's plan, the
        main process's pid and rank, and ``rest`` (its start, and what its kind implies)."""
        return cls(
            worker_id=worker_id,
            num_workers=plan.num_workers,
            base_seed=base_seed,
            dataset=plan.dataset,
            iterable=plan.iterable_style,
            auto_collation=plan.auto_collation,
            collate_fn=plan.collate_fn,
            drop_last=plan.drop_last,
            worker_init_fn=plan.worker_init_fn,
            parent_pid=os.getpid(),
            rank_world=process_group_rank_world(),
            snapshot_every=plan.snapshot_every,
            skip=plan.failures.skip,
            **rest,
        )

    @property
    def seed(self) -> int:
        return self.base_seed + self.worker_id

    def info(self, method: str = "multiprocessing") -> WorkerInfo:
        return WorkerInfo(
            self.worker_id, self.num_workers, self.seed, self.dataset, worker_method=method
        )

    def fetcher(self) -> MapFetcher | IterableFetcher:
        """A fresh fetcher (for iterable datasets: a fresh stream) over this worker's dataset."""
        return make_fetcher(
            self.dataset,
            self.iterable,
            self.auto_collation,
            self.collate_fn,
            self.drop_last,
            skip_as=self.worker_id if self.skip else None,
            reads=self.reads if self.reads is not None else _own_reads(self.read_limit),
            count=(self.tally.counts, self.worker_id) if self.tally is not None else None,
        )


_PROCESS_READS: list[SampleReads] = []  # a process worker's own reads, made once


def _own_reads(limit: int) -> SampleReads | None:
    """The per-sample reads of this worker process (``read_limit``), one for its lifetime."""
    if not limit:
        return None
    if not _PROCESS_READS:
        reads = SampleReads(limit, detached=True, alone=True)
        reads.warm()
        _PROCESS_READS.append(reads)
    return _PROCESS_READS[0]


def seed_process(config: WorkerConfig) -> None:
    """Seed the worker's global generators as torch seeds its workers.

    torch and Python's ``random`` get ``base_seed + worker_id``; numpy's global generator gets
    four words that numpy's ``SeedSequence`` mixes from ``(worker_id, base_seed)``, which is
    the state torch gives it too, so numpy-based augmentations draw what they draw under torch.
    No two workers of a loader, nor two epochs, share a random stream.
    """
    random.seed(config.seed)
    seed_torch(config.seed)
    try:
        import numpy as np
    except ImportError:
        return
    low, high = config.base_seed & 0xFFFFFFFF, config.base_seed >> 32
    words = np.random.SeedSequence([config.worker_id, low, high, 0]).generate_state(4)
    np.random.seed(words)


class Activity:
    """What a worker is doing, for stall reports: the task it is fetching and since when."""

    __slots__ = ("since", "task")

    def __init__(self) -> None:
        self.task: int | None = None
        self.since = time.monotonic()

    def stack(self, worker_id: int, thread_id: int | None) -> Stack:
        """This worker's :class:`Stack`: its activity and the stack of thread ``thread_id``,
        then those of the pool threads reading samples for it (a worker whose reads run at
        once waits in the pool's futures; the user's code is on those threads)."""
        frame = sys._current_frames().get(thread_id) if thread_id is not None else None
        frames = traceback.extract_stack(frame) if frame is not None else []
        # From the fetch down: what led to the worker loop (process start-up) is not news.
        loop = [i for i, f in enumerate(frames) if f.name == run_worker_loop.__name__]
        shown = frames[loop[-1] + 1 :] if loop else frames
        text = "".join(traceback.format_list(shown)) if shown else "(no stack)\n"
        for key, stack in reads_serving(thread_id) if thread_id is not None else []:
            text += f"its read of index {key!r} on the read pool (most recent call last):\n"
            text += "".join(stack.format())
        return Stack(worker_id, self.task, self.since, text)


def failure(
    task: int | None, worker_id: int, exc: BaseException, stage: str = "", sending: bool = False
) -> Failed:
    """Describe an exception raised by user code so the main process can raise it again."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    blob: bytes | None = None
    # The exception itself; else its class, which the main process calls with the message, as
    # torch rebuilds every worker exception (some pickle but cannot be rebuilt: each is tried).
    for sent in (exc, type(exc)):
        try:
            blob = pickle.dumps(sent)
            pickle.loads(blob)
            break
        except Exception:
            blob = None
    name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    return Failed(task, worker_id, os.getpid(), name, str(exc), text, blob, stage, sending)


class WorkerEnd:
    """The worker's end of its transport, one kind each: what it sends, the memory its
    batches are made in, and what the main process gives back. The loop
    (:func:`run_worker_loop`) is the same for every kind; only its end differs."""

    def __init__(self, send: Callable[[Any], None], allocator: Allocator | None) -> None:
        self.send = send
        self.allocator = allocator  # where batches are made (None: ordinary memory)

    def begin(self, freed: tuple[int, ...]) -> None:
        """A task begins; ``freed``: what the main process gave back since the last one."""

    def resume(self, freed: tuple[int, ...]) -> None:
        """A new epoch begins (persistent workers)."""
        self.begin(freed)

    def abandon(self) -> None:
        """The task's batch will not be sent (it failed, or every sample was dropped)."""

    def pack(self, task: int, made: Made, report: WorkerReport | None) -> Any:
        """Batch ``task`` made ready to send (an error here is the batch's: the task fails);
        here, as it is (a thread's batch is the main process's object)."""
        timing, batch = made.timing(), made.batch
        return Done(task, batch, (), report, timing, made.outcome, cpu=made.cpu_s)

    def ship(self, packed: Any) -> None:
        """Send what :meth:`pack` made (nothing of the user's runs here)."""
        self.send(packed)


class SlabEnd(WorkerEnd):
    """A process worker's end: batches are made in shared-memory slabs (``slabs``), which the
    main process maps (announced with ``announce``, a descriptor following where they have no
    name), and the process's memory is measured after each batch (``memory``)."""

    def __init__(
        self,
        send: Callable[[Any], None],
        slabs: SlabAllocator,
        announce: Callable[[NewSlab, int | None], None],
        memory: MemorySampler,
    ) -> None:
        super().__init__(send, slabs)
        self.slabs = slabs
        self.announce = announce
        self.memory = memory
        self.held = -1  # this process's memory, measured after the last batch went

    def begin(self, freed: tuple[int, ...]) -> None:
        self.slabs.begin(freed)

    def resume(self, freed: tuple[int, ...]) -> None:
        self.slabs.begin(freed)
        self.memory.restart()

    def abandon(self) -> None:
        self.slabs.abandon()

    def pack(self, task: int, made: Made, report: WorkerReport | None) -> Any:
        encoding = perf_counter()
        payload, used = encode_batch(made.batch, self.slabs)
        made.batch = None  # (its tensors would keep the slabs mapped here once retired)
        nbytes = len(payload) + sum(slab.used for slab in used)
        timing = made.timing(perf_counter() - encoding, nbytes)
        return task, payload, used, report, timing, made.outcome, made.cpu_s, made.parallel

    def ship(self, packed: Any) -> None:
        task, payload, used, report, timing, outcome, cpu, reads = packed
        slabs = self.slabs
        for slab in used:
            if not slab.announced:
                self.announce(slabs.announcement(slab), slab.fd)
                slab.shared()
                slab.announced = True
        ids = tuple(s.id for s in used)
        done = Done(
            task,
            payload,
            ids,
            report,
            timing,
            outcome,
            cpu=cpu,
            reads=reads,
            memory=self.held,
            memory_faults=self.memory.faults,  # (when ``held`` was read)
        )
        self.send(done)
        slabs.handed_off(used)
        # Measured once the batch is on its way (a read of smaps_rollup takes milliseconds):
        # the figure goes with the next batch.
        self.held = self.memory.after_batch()


class PickleEnd(WorkerEnd):
    """A process worker's end where shared-memory slabs are not supported (no
    ``memfd_create``: macOS): batches are pickled whole through its pipe. Its memory is not
    measured: those systems have no ``smaps_rollup`` either."""

    def __init__(self, send: Callable[[Any], None]) -> None:
        super().__init__(send, None)


def run_worker_loop(
    config: WorkerConfig,
    *,
    receive: Callable[[], Any],
    end: WorkerEnd,
    stopping: threading.Event,
    activity: Activity,
) -> None:
    """Answer tasks until :class:`Stop`, or until ``stopping`` is set (checked before each
    fetch, so tasks queued behind a stop request are not fetched). Shared by process and
    thread workers, which differ only in their ``end``."""
    send = end.send
    stage = "in worker_init_fn"
    keeper = PositionKeeper(config.dataset, config.snapshot_every, config.track_rng)
    # A worker whose set-up raised stays up and fails each of its tasks with that error, so
    # the error reaches the user at the worker's first batch, where torch raises it too.
    broken: Failed | None = None
    try:
        if config.worker_init_fn is not None:
            config.worker_init_fn(config.worker_id)
        stage = "opening its dataset stream" if config.iterable else "setting up its fetcher"
        fetcher = keeper.open(config.fetcher, config.resume, config.replay)
    except Exception as exc:
        broken = failure(None, config.worker_id, exc, stage)
    own_reads = getattr(fetcher, "reads", None) if broken is None and config.read_limit else None
    if isinstance(own_reads, SampleReads) and own_reads.on_first_look is None:
        # (the main process may hold the other workers back until it knows: HeldWorkers)
        own_reads.on_first_look = lambda waits: send(FirstLook(waits))
    states = keeper.states(fetcher) if config.report_start and broken is None else None
    send(Ready(config.worker_id, os.getpid(), states))
    while True:
        message = receive()
        if isinstance(message, Stop):
            return
        if isinstance(message, Resume):
            end.resume(message.freed)
            if broken is None:
                fetcher = keeper.open(config.fetcher, None)
            if config.report_start:
                states = keeper.states(fetcher) if broken is None else None
                send(Ready(config.worker_id, os.getpid(), states))
            continue
        assert isinstance(message, Fetch)
        if stopping.is_set():
            return
        if broken is not None:
            send(dataclasses.replace(broken, task=message.task))
            continue
        end.begin(message.freed)
        activity.since, activity.task = time.monotonic(), message.task
        sending = False
        try:
            key = IndexTensor.unpack(message.key)
            made = make_batch(fetcher, key, end.allocator, config.skip)
            report = keeper.after_batch(fetcher) if keeper.reports else None
            if made.batch is DROPPED:  # every sample dropped: report them, and the position
                end.abandon()
                send(Done(message.task, None, (), report, made.timing(), made.outcome, empty=True))
                continue
            sending = True
            packed = end.pack(message.task, made, report)
        except Exception as exc:
            end.abandon()
            if config.iterable and isinstance(exc, StopIteration):
                send(Exhausted(message.task))
            else:
                # A map-style __getitem__ raising StopIteration travels like any error: raised
                # again in the main process, it ends the epoch there, as in torch.
                send(failure(message.task, config.worker_id, exc, sending=sending))
            continue
        finally:
            activity.task = None
        end.ship(packed)


def _watch_parent(
    conn: Connection,
    inbox: queue.SimpleQueue[Any],
    parent_pid: int,
    stopping: threading.Event,
    *,
    main_pid: int,
    answer_stack: Callable[[], None],
    retire: Callable[[tuple[int, ...]], None],
) -> None:
    """Reader thread of a process worker: drain the connection, and end the worker at once if
    the main process is gone (its end of the connection closed, or the worker was re-parented:
    ``parent_pid`` is the parent at start-up, the main process or a forkserver). Names of
    slab files this worker made for ``main_pid`` are removed first. A stall report's request,
    and ``Stop``, are answered here with a :class:`Stack`, since the worker's main thread may be
    the one that is stuck."""
    ready = _ready_within(conn)
    while True:
        try:
            if ready(PARENT_CHECK_INTERVAL):
                message = pickle.loads(conn.recv_bytes())
                if isinstance(message, StackRequest):
                    answer_stack()
                    continue
                if isinstance(message, Retire):  # at once, also while a batch is being made
                    retire(message.slabs)
                    continue
                if isinstance(message, Stop):
                    stopping.set()
                    # Answered at once with what the worker is doing: at interpreter exit the
                    # main process terminates a worker in the middle of a fetch (see group.py).
                    answer_stack()
                inbox.put(message)
                if isinstance(message, Stop):
                    return
        except (EOFError, OSError):
            _exit_orphaned(main_pid)
        if os.getppid() != parent_pid:
            _exit_orphaned(main_pid)


def _ready_within(conn: Connection) -> Callable[[float], bool]:
    """Whether ``conn`` has something to read within the seconds given: a poll object made
    once (``Connection.poll`` builds a selector at every call, a few microseconds a task), or
    ``Connection.poll`` where there is no ``poll()`` (Windows)."""
    if not hasattr(select, "poll"):
        return conn.poll
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    return lambda seconds: bool(poller.poll(seconds * 1000))


def _exit_orphaned(main_pid: int) -> None:
    remove_names(main_pid, os.getpid())
    os._exit(0)


_SIGINT = {signal.SIGINT}


@contextlib.contextmanager
def sigint_held() -> Iterator[None]:
    """SIGINT is held back from a worker process until it has set SIGINT aside.

    Ctrl-C reaches every process of the terminal's group, and a worker ignores it only once
    :func:`process_worker_main` runs: one still in multiprocessing's start-up (under spawn, in
    the interpreter's) would die of KeyboardInterrupt there. So SIGINT is blocked in the calling
    thread while the worker starts: a forked worker inherits the mask and unblocks it after it
    has set SIGINT aside. A spawned one starts with an empty mask, but keeps an ignored
    disposition across ``exec`` (and Python then installs no handler of its own): in the main
    thread, SIGINT is also ignored for that moment. Blocked signals are kept, not discarded, so
    a Ctrl-C meant for the main process in between is delivered when the block ends."""
    try:
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGINT)
    except (AttributeError, OSError, ValueError):  # a platform without per-thread masks
        yield
        return
    try:
        with sigint_ignored():
            yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """SIGINT ignored for the block, then its handler put back. Only the main thread (of the
    main interpreter) can set a handler: elsewhere this does nothing."""
    try:
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except (ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        if handler is not None:  # None: set outside Python, which cannot be put back
            signal.signal(signal.SIGINT, handler)


def process_worker_main(config: WorkerConfig, conn: Connection) -> None:
    """Entry point of a worker process (module-level so every start method can reach it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # blocked by sigint_held while this process started
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGINT)
    torch.set_num_threads(1)
    seed_process(config)
    set_process_worker_info(config.info())
    inherit_rank_world(config.rank_world)
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    stopping = threading.Event()
    activity = Activity()
    # The main thread and the reader thread (stall reports) both write to the connection.
    sending = threading.Lock()
    main_thread = threading.get_ident()

    def send(message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with sending:
            conn.send_bytes(data)

    def announce(slab: NewSlab, fd: int | None) -> None:
        # The descriptor follows its announcement on the socket, with nothing in between.
        data = pickle.dumps(slab, protocol=pickle.HIGHEST_PROTOCOL)
        with sending:
            conn.send_bytes(data)
            if fd is not None:
                send_fd(conn, fd)

    def answer_stack() -> None:
        send(activity.stack(config.worker_id, main_thread))

    slabs = SlabAllocator(config.parent_pid, config.named_slabs) if SLABS_SUPPORTED else None
    # The reader thread, started without waiting for it to run (as threading.Thread.start()
    # does: about 0.6 ms of a freshly forked worker's start, on the way to its first batch). It
    # is never joined: it ends with the process.
    _thread.start_new_thread(
        _watch_parent,
        (conn, inbox, os.getppid(), stopping),
        {
            "main_pid": config.parent_pid,
            "answer_stack": answer_stack,
            "retire": slabs.retire if slabs is not None else lambda slab_ids: None,
        },
    )

    end = SlabEnd(send, slabs, announce, MemorySampler()) if slabs is not None else PickleEnd(send)
    try:
        run_worker_loop(config, receive=inbox.get, end=end, stopping=stopping, activity=activity)
        send(Stop())  # leaving: the main process waits for the interpreter to finish
    except (BrokenPipeError, EOFError, ConnectionResetError):
        pass  # the main process went away mid-send; nothing is left to tell it
    finally:
        if slabs is not None:
            slabs.close()
        _let_go_of_the_dataset(config)


def _let_go_of_the_dataset(config: WorkerConfig) -> None:
    """A process worker's loop is over: ``get_worker_info()`` answers None from here on, and
    the worker holds its dataset no more. Where nothing else in the process holds it (a
    spawned or forkserver worker; a forked one shares the main process's references) it is
    finalized now, its ``__del__`` and finalizers run while the interpreter is whole, as in
    torch's workers since 2.14 (before, the process object's arguments kept it to the end)."""
    set_process_worker_info(None)
    object.__setattr__(config, "dataset", None)  # (frozen for the loop; the loop is over)


def thread_worker_main(
    config: WorkerConfig,
    inbox: queue.SimpleQueue[Any],
    outbox: queue.SimpleQueue[Any],
    allocator: Allocator,
    *,
    stopping: threading.Event,
    activity: Activity,
) -> None:
    """Entry point of a worker thread: same loop, objects passed as they are (the main thread
    reads ``activity``, and this thread's stack, itself for stall reports)."""
    one_intra_op_thread()  # as a process worker's torch.set_num_threads(1), for this thread
    set_thread_worker_info(config.info("thread"))
    worker_id = config.worker_id

    def send(message: Any) -> None:
        outbox.put((worker_id, message))

    end = WorkerEnd(send, allocator)
    try:
        run_worker_loop(config, receive=inbox.get, end=end, stopping=stopping, activity=activity)
    except BaseException as exc:  # a bug of ours: let the main thread see it rather than hang
        send(failure(None, worker_id, exc))
    finally:
        set_thread_worker_info(None)
