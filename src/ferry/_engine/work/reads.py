"""Per-sample reads of a map-style dataset, in parallel when they wait.

A torch-style worker reads the samples of its batch one after another, so when a sample costs
milliseconds of waiting (an object store, a network file system) and microseconds of CPU, the
loader's concurrency is the number of batches in flight, and the first batch arrives after
``batch_size x latency``. :class:`SampleReads` reads the samples of a batch at once on a pool of
threads shared by every worker thread of a loader, when measurement says they wait:

* Each read is timed twice: wall time and the CPU time of the thread that ran it
  (``time.thread_time``; on the pool, plus the time it waited for a CPU). Their ratio is how
  many reads one core could keep in flight: about 1 for work that holds the GIL (decoding in
  Python), hundreds for a read that sleeps on I/O. A process worker's reads at once, which
  ``num_workers="auto"`` judges, are judged by their median read, not by their sum: reads that
  compute wait for one another (the GIL), which their summed times would count as waiting
  (:meth:`SampleReads._verdict`).
* ``width``, how many samples of one batch are read at once, follows that ratio: 1 (one after
  another, as torch does, and with no pool) until the reads are measured to wait at least
  :data:`PARALLEL_FROM` times their CPU, then ``ceil(ratio)``, at most the batch and the pool.
  It is decided again after every batch from a moving average, so it adapts within an epoch
  (a long first epoch does not run at the rate of one read at a time).
* The loader's first read is watched while it runs (a pool thread reads the reading thread's
  CPU time from ``/proc``): once it has taken :data:`PEEK` seconds and :data:`PARALLEL_FROM`
  times the CPU it used, the rest of its batch begins at once, without waiting for it to end,
  so the first batch of reads that wait arrives after about one read, not two.
* Whatever the width, a batch is the same: its samples in key order, collated once; a read that
  raises raises the error of the first failing key in key order (reads not yet started are
  cancelled), and with ``on_error="skip"`` every failing key is reported, in order.

Thread workers share one (they share the dataset already, so reading it from more threads asks
nothing new of it); under ``num_workers="auto"`` each process worker has its own, whose threads
wait on that worker's reads; other process workers and ``num_workers=0`` read as torch does. A
read on a pool thread sees the :func:`~ferry.get_worker_info` of the worker that asked for it.
"""

from __future__ import annotations

import _thread
import math
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from time import perf_counter, thread_time
from types import FrameType
from typing import Any

from ferry._core.alloc import expect_batch
from ferry._core.info import WorkerInfo, set_thread_worker_info, thread_worker_info
from ferry._core.intra_op import one_intra_op_thread, settle

__all__ = [
    "PARALLEL_FROM",
    "PEEK",
    "POOL_LIMIT",
    "Failed",
    "SampleReads",
    "busy_of",
    "cpu_and_queued",
    "reads_serving",
    "wait_for_reads",
]

# Reads run in parallel once they wait at least this many times their CPU time.
PARALLEL_FROM = 4.0
# At most this many reads in flight for one loader (the pool's threads).
POOL_LIMIT = 64
# Weight of the latest batch in the moving averages of wall and CPU time per read.
SMOOTHING = 0.3
# The loader's first read is judged while it runs once it has taken this long (seconds).
PEEK = 0.0005
# Reads at once whose busy seconds fill this share of their span or more kept their process's
# GIL busy: thread workers, one GIL for all, would not read them faster (see _verdict).
GIL_FILLED = 0.9

_SERVING: dict[int, tuple[int, Any, FrameType]] = {}
"""The reads running on pool threads now: the pool thread's id -> (the id of the thread that
asked for the read, its key, the pool's frame that calls the dataset). A stall report shows a
waiting worker's reads through it."""
os.register_at_fork(after_in_child=_SERVING.clear)  # (those threads are not in the child)


def wait_for_reads(deadline: float) -> None:
    """Wait until no read runs on this process's pool threads, or ``deadline`` (a
    ``time.monotonic()``): at interpreter exit, a daemon thread inside a torch operation that let
    go of the GIL aborts the process when it takes the GIL back (see crew/group.py)."""
    while _SERVING and time.monotonic() < deadline:
        time.sleep(0.005)


def reads_serving(thread_id: int) -> list[tuple[Any, traceback.StackSummary]]:
    """The reads pool threads run now for thread ``thread_id``: each one's key and stack,
    from the dataset's call down (the pool's own frames left out)."""
    current = sys._current_frames()
    found = []
    try:
        for reader, (owner, key, base) in list(_SERVING.items()):
            frame = current.get(reader)
            if owner != thread_id or frame is None:
                continue
            chain = []
            while frame is not None and frame is not base:
                chain.append(frame)
                frame = frame.f_back
            if frame is base:  # (else the read ended meanwhile)
                found.append(
                    (key, traceback.StackSummary.extract((f, f.f_lineno) for f in reversed(chain)))
                )
        return found
    finally:
        # The frames hold this one, which holds them: a cycle that would keep every frame of
        # every thread, and their locals (a worker's dataset), until the next collection.
        del current


def busy_of(thread: threading.Thread | None = None) -> float:
    """Seconds ``thread`` (this thread: None) ran on a CPU plus seconds it was ready to run
    but waited for one (``/proc/.../schedstat``), so that on a machine with more runnable
    threads than CPUs the time a thread waited for a CPU does not pass for a read that waits;
    its CPU time alone where there is no such file; -1.0 where neither can be read.

    The CPU part comes from the thread's CPU clock, not from ``schedstat``: the kernel brings
    that figure up to date only at a scheduler tick or switch, so for a thread on a CPU it lags
    by up to a tick (milliseconds). Stale at the start of a read, it made a read that slept
    look busy for a while (the first batch's reads began up to 3 ms late); stale at a look
    while a read computes, it would make the read look as if it waited."""
    cpu, queued = cpu_and_queued(thread)
    return cpu + queued if cpu >= 0 else cpu


def cpu_and_queued(thread: threading.Thread | None = None) -> tuple[float, float]:
    """The two parts of :func:`busy_of`, apart: ``thread``'s seconds on a CPU, and its seconds
    waiting for one (0.0 where there is no ``schedstat``); ``(-1.0, 0.0)`` where neither can be
    read. A first read's watcher counts the wait as :func:`_counted` does."""
    own = thread is None or thread.ident == threading.get_ident()
    native = threading.get_native_id() if own or thread is None else thread.native_id
    cpu = -1.0
    try:
        if own:
            cpu = thread_time()
        elif thread is not None and thread.ident is not None:
            cpu = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError):  # (no per-thread CPU clocks on this system)
        pass
    try:
        with open(f"/proc/self/task/{native}/schedstat", "rb") as schedstat:
            ran, queued, _ = schedstat.read().split()
    except (OSError, ValueError):
        return cpu, 0.0
    return (cpu if cpu >= 0 else int(ran) / 1e9), int(queued) / 1e9


class _SchedStatFile:
    """A thread's ``schedstat`` file, open until this object goes (with its thread's locals)."""

    __slots__ = ("fd", "pid")

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)

    def __del__(self) -> None:
        os.close(self.fd)


class _OwnSchedStat(threading.local):
    """Each thread's ``schedstat``, kept open while the thread lives (a ``pread`` of it takes
    about 3 us, where opening it takes 20): for the reads a pool thread times, one by one."""

    file: _SchedStatFile | None = None

    def queued(self) -> float:
        """Seconds this thread waited for a CPU so far (0.0 where that cannot be read)."""
        try:
            if self.file is None or self.file.pid != os.getpid():  # (or a forked child's copy)
                self.file = None
                self.file = _SchedStatFile()
            return int(os.pread(self.file.fd, 64, 0).split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return 0.0


_own_schedstat = _OwnSchedStat()


class Failed:
    """A read that raised (``read(..., collect=True)``): ``error`` is what it raised."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Pool:
    """A pool of daemon threads (``ferry-read-N``), started as reads need them, up to
    ``limit``. Daemon threads, unlike ``concurrent.futures``' pool: a read that never returns
    must not keep the interpreter from exiting.

    ``Thread.start()`` waits until the new thread runs, so 31 reads submitted at once would
    begin one start apart (about 8 ms for the last with two worker threads submitting). So
    threads start threads: the one who submits starts one if none is starting, and each new
    thread starts up to two more while tasks wait, before it takes one; as a tree they all begin
    within a few ms.

    ``detached`` (a worker process's own pool): threads of the ``_thread`` module, which start
    without waiting for the new thread to run, each submit starting one while tasks wait. In a
    freshly forked worker, on a machine whose CPUs are busy with the other workers starting,
    each wait for a new thread to be scheduled cost up to milliseconds, and the first batch
    waits for its last read to begin. They are not in ``threading.enumerate()``, and are not
    joined: they end with the process (which is why only a worker process uses them; a read
    that calls ``threading.current_thread()`` leaves a dummy entry in ``threading`` until
    Python 3.13, which in the main process would look like a thread that leaked)."""

    def __init__(self, limit: int, detached: bool = False) -> None:
        self._limit = limit
        self._detached = detached
        self._tasks: queue.SimpleQueue[tuple[Future[Any], Callable[[Any], Any], Any] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._started = 0  # threads started (detached ones included)
        # Threads free or starting, less the tasks waiting for one (negative: tasks wait).
        self._spare = 0
        self._starting = 0  # threads started that have not begun to run yet
        self._shut = False

    @property
    def size(self) -> int:
        """Threads started so far."""
        return self._started

    def submit(self, fn: Callable[[Any], Any], arg: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._tasks.put((future, fn, arg))
        with self._lock:
            self._spare -= 1
            start = self._detached or self._starting == 0
            thread = self._new_thread() if start else None
        if thread is not None:
            thread.start()
        return future

    def warm(self) -> None:
        """Start one thread now, to wait for the first task (see SampleReads.warm)."""
        with self._lock:
            thread = None if self._started else self._new_thread(needed=False)
        if thread is not None:
            thread.start()

    def _new_thread(self, needed: bool = True) -> threading.Thread | _Detached | None:
        """A thread for a waiting task, if one waits (or not ``needed``) and the limit allows
        (lock held)."""
        if (needed and self._spare >= 0) or self._shut or self._started >= self._limit:
            return None
        self._started += 1
        self._spare += 1
        self._starting += 1
        if self._detached:
            return _Detached(self._run)
        settle()
        thread = threading.Thread(
            target=self._run, name=f"ferry-read-{len(self._threads)}", daemon=True
        )
        self._threads.append(thread)
        return thread

    def _run(self) -> None:
        if not self._detached:  # (a worker process's default is one thread already)
            one_intra_op_thread()  # many reads at once: each on one thread, as in a process
        with self._lock:
            self._starting -= 1
            more = [t for t in (self._new_thread(), self._new_thread()) if t is not None]
        for thread in more:
            thread.start()
        while (task := self._tasks.get()) is not None:
            future, fn, arg = task
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(arg))
                except BaseException as exc:
                    future.set_exception(exc)
            with self._lock:
                self._spare += 1

    def shutdown(self) -> list[threading.Thread]:
        """Ask every thread to stop once the reads queued before are done; returns those that
        can be joined (not detached ones)."""
        with self._lock:
            self._shut = True
            count, threads = self._started, list(self._threads)
        for _ in range(count):
            self._tasks.put(None)
        return threads


class _Detached:
    """A thread of the ``_thread`` module, started without waiting for it to run."""

    __slots__ = ("_target",)

    def __init__(self, target: Callable[[], None]) -> None:
        self._target = target

    def start(self) -> None:
        _thread.start_new_thread(self._target, ())


Timed = tuple[float, float, float]
"""One read's wall seconds, busy seconds (:func:`_counted`) and CPU seconds."""


def _filled(times: list[Timed], span: float) -> float:
    """The share of ``span`` seconds that reads begun at once, ``times``, kept busy, summed
    (1.0: one CPU, or the GIL, busy all along)."""
    return sum(t[1] for t in times) / span if span > 0 else 0.0


def _counted(cpu: float, waited: float) -> float:
    """A read's busy seconds as a process worker's reads count them: its CPU seconds, and the
    time it waited for a CPU up to as much again. A read that computes on a machine with
    more runnable threads than CPUs waits for one in proportion to its CPU time (load 4 on 2
    CPUs: about as long again), which must not pass for a read that waits; a read that sleeps
    waits for a CPU once, as it wakes, for as long as the machine is busy, whatever its CPU
    time, which must not hide its sleep (a 20 ms read and 50 us of CPU, on a loaded machine,
    woke to wait for a CPU for milliseconds)."""
    return cpu + min(max(waited, 0.0), cpu)


class _Clocks:
    """The clocks reads are timed by: wall, the reading thread's CPU, a thread's busy seconds
    and, apart, its seconds on a CPU and waiting for one (``split``, as a first read's watcher
    reads them), and the calling thread's seconds waiting for a CPU so far. Stand-in clocks
    (tests) give CPU seconds for busy ones and no wait."""

    __slots__ = ("busy", "cpu", "queued", "split", "wall")

    def __init__(
        self,
        wall: Callable[[], float],
        cpu: Callable[[], float],
        busy: Callable[[threading.Thread], float] | None,
    ) -> None:
        real = cpu is thread_time
        self.wall, self.cpu = wall, cpu
        self.busy = busy or (busy_of if real else lambda _: cpu())
        self.queued: Callable[[], float] = _own_schedstat.queued if real else float
        stand_in = self.busy
        self.split: Callable[[threading.Thread], tuple[float, float]] = (
            cpu_and_queued if busy is None and real else lambda thread: (stand_in(thread), 0.0)
        )


Launched = tuple[list[Future[Any]], list[Timed], float]
"""Reads :meth:`SampleReads._launch` began: their futures in key order, the list their times
go into as they end, and when they were begun (wall clock)."""


class _FirstRead:
    """A read read alone (the loader's first, or the probe after it: ``again``), as a watcher
    sees it: when it began (wall seconds, and the reading thread's seconds on a CPU and
    waiting for one; None: not yet), and the reads of the rest of its batch once they were
    begun (``over``: the read ended, nothing more is begun; ``took``: its wall and busy
    seconds, where they could be read)."""

    def __init__(self, thread: threading.Thread, again: bool) -> None:
        self.lock = threading.Lock()
        self.thread = thread
        self.again = again
        self.began: tuple[float, float, float] | None = None
        self.info = thread_worker_info()  # (made on the reading thread)
        self.owner = threading.get_ident()
        self.over = False
        self.took: tuple[float, float] | None = None  # (wall, busy seconds, once it ended)
        self.said: bool | None = None  # what its watcher told of it ("waits"; None: nothing)
        self.rest: Launched | None = None

    def busy_since(self, cpu: float, queued: float) -> float:
        """The read's busy seconds from its beginning to a look that read the thread's
        ``cpu`` and ``queued`` seconds, a wait for a CPU counted as a read's is
        (:func:`_counted`): a read that slept waits for a CPU as it wakes, and on a loaded
        machine as it begins, for as long as the machine is busy, which must not pass for
        computing (its watcher's word "computes" starts the workers held back for it)."""
        assert self.began is not None
        return _counted(cpu - self.began[1], queued - self.began[2])


class SampleReads:
    """Reads ``dataset[key]`` for the keys of a batch, one after another or at once (see the
    module docstring). Thread-safe: every worker thread of a loader shares one."""

    def __init__(
        self,
        limit: int = POOL_LIMIT,
        *,
        clock: Callable[[], float] = perf_counter,
        cpu_clock: Callable[[], float] = thread_time,
        measured: tuple[float, float] | None = None,
        busy: Callable[[threading.Thread], float] | None = None,
        detached: bool = False,
        alone: bool = False,
    ) -> None:
        self.limit = limit
        self._detached = detached  # (a worker process's own: see _Pool)
        # A process worker's own reads (num_workers="auto"), over a dataset written for one
        # thread, and judged: nothing begins while a first read runs, and a loader's first
        # read that waited is followed by a probe (see _first); reads at once are judged by
        # their median (_verdict). Thread workers' reads begin the rest while the first read
        # runs (the first batch arrives after about one read) and keep their width.
        self._alone = alone
        self._clocks = _Clocks(clock, cpu_clock, busy)
        self._lock = threading.Lock()
        self._pool: _Pool | None = None
        self._closed = False
        self._last = threading.local()  # (per calling thread: see last_parallel)
        # Moving averages of one read's wall and CPU seconds (None: nothing measured yet).
        self.wall: float | None = None
        self.cpu: float | None = None
        self.width = 1
        self.peak_width = 1  # the most reads of one batch run at once (for the statistics)
        # CPU seconds every read took so far, on every thread: num_workers="auto" weighs thread
        # workers' reads against the GIL with it. (Additions from several threads may race and
        # lose one now and then: an estimate. Not their waits for a CPU: reading those is a
        # system call that lets go of the GIL, and the wait to take it back, counted in a
        # read's wall time, made cheap reads look as if they waited.)
        self.cpu_seconds = 0.0
        # 0: no first read yet; 1: one was read (the next is a probe); 2: the final word on
        # the first look was told (the first read's taken whole, or the probe's; a late
        # watcher's is not sent after it)
        self._stage = 0
        # Told once, from the first read's watcher, whether that read waits (True: the rest of
        # its batch was begun at once, unless it had ended) or computes (False); a read that
        # ended before the watcher could look is judged by what it took.
        self.on_first_look: Callable[[bool], None] | None = None
        if measured is not None:  # (one read's wall and CPU seconds, measured elsewhere)
            self._measured(*measured)

    @property
    def ratio(self) -> float:
        """Measured wall time over CPU time of a read (0 before any read)."""
        if self.wall is None or self.cpu is None:
            return 0.0
        return self.wall / max(self.cpu, 1e-7)

    def read(self, dataset: Any, keys: Sequence[Any], collect: bool = False) -> list[Any]:
        """``[dataset[k] for k in keys]``, timed, at the current width. With ``collect``, a
        read that raises gives a :class:`Failed` in its place (``StopIteration`` still ends the
        epoch); else the first failing key's error is raised."""
        self._last.parallel = None
        if self.wall is None and (len(keys) > 1 or (self._alone and keys)):
            # Nothing measured yet: the first read, watched, says whether the rest should run
            # at once (the first batch of a loader that waits arrives after about one read).
            return self._first(dataset, keys, collect)
        if min(self.width, len(keys)) <= 1:
            return self._serial(dataset, keys, collect)
        width = min(self.width, len(keys))
        launched = self._launch(dataset, keys, width, thread_worker_info(), threading.get_ident())
        return self._gather(launched, collect=collect, expect=True)

    def _first(self, dataset: Any, keys: Sequence[Any], collect: bool, size: int = 0) -> list[Any]:
        """Read ``keys[0]`` here, alone. While it runs a pool thread watches it
        (:meth:`_watch`): if it waits, the watcher begins the rest of the batch at once. Else
        they follow as it measured. ``size``: the batch's (``keys`` may be its tail).

        ``alone`` reads (a process worker's own, over a dataset written for one thread, which
        ``num_workers="auto"`` judges) begin nothing while the first read runs: it may be
        opening what the others need (a file, a handle). Where the loader's first read
        waited, the next one is read alone too, a probe that the first read's one-off work
        no longer colours, and only if it waits as well are the rest read at once."""
        size = size or len(keys)
        thread = threading.current_thread()
        with self._lock:
            first = _FirstRead(thread, again=self._stage > 0)
            self._stage = max(self._stage, 1)
        if not (self._alone and first.again):  # (alone, a probe: nothing to watch it for)
            self._executor().submit(self._watch, (first, dataset, keys[1:]))
        # (from here: the watcher's start, which may take a while on a busy machine, is not
        # part of the read it judges)
        began = (self._clocks.wall(), *self._clocks.split(thread))
        with first.lock:
            first.began = began
        try:
            head, wall, cpu = self._timed(dataset, keys[:1], collect)
        except BaseException:
            with first.lock:
                first.over = True
                if first.rest is not None:
                    for future in first.rest[0]:
                        future.cancel()
            raise
        took = seen = None
        if began[1] >= 0:
            cpu_now, queued_now = self._clocks.split(thread)
            took = (wall, cpu_now + queued_now - began[1] - began[2])
            seen = (wall, first.busy_since(cpu_now, queued_now))
        with first.lock:
            first.over = True
            first.took = seen
            rest = first.rest
        busy = _counted(cpu, took[1] - cpu) if took is not None and self._alone else cpu
        if rest is None:  # not begun while it ran: the rest as it measured
            self._measured(wall, busy, anew=first.again and self._alone)
            if self._alone and self.width == 1 and (first.again or first.said is not False):
                # It computes, taken whole (a file opened, then computing), or it is the
                # probe and computes (the first read waited on what only a first read
                # does): the workers held back for a look that said "waits" are needed.
                self._tell_first_look(False, final=True)
            if self._alone and self.width > 1 and not first.again:
                return head + self._after_first(dataset, keys[1:], collect, size)
            if not (self._alone and self.width > 1 and len(keys) > 2):
                return head + self.read(dataset, keys[1:], collect)
            rest = self._launch(dataset, keys[1:], size, first.info, first.owner)
        if not isinstance(head[0], Failed):
            expect_batch(head[0], size)  # (the batch's memory, while the rest are read)
        return head + self._gather(rest, collect=collect, also=(wall, busy, cpu))

    def _after_first(
        self, dataset: Any, keys: Sequence[Any], collect: bool, size: int
    ) -> list[Any]:
        """The rest of a batch whose first read, the loader's, waited (``alone`` reads): the
        next read alone too (a probe), then the others as it says. What they took is what
        :meth:`last_parallel` gives for the batch, the first read left out: it may have waited
        on what only a first read does (count 0 where it was the batch's only read)."""
        thread = threading.current_thread()
        start, busy = self._clocks.wall(), self._clocks.busy(thread)
        if len(keys) > 1:
            results = self._first(dataset, keys, collect, size)
        else:
            results = self._serial(dataset, keys, collect)
        if self._last.parallel is None:  # (read one after another, here)
            took = self._clocks.wall() - start, self._clocks.busy(thread) - busy
            self._last.parallel = (*took, len(keys))
        return results

    def _watch(self, job: tuple[_FirstRead, Any, Sequence[Any]]) -> None:
        """On a pool thread: look at a first read now and then while it runs; once it has
        taken PEEK seconds and PARALLEL_FROM times its busy seconds (its waits for a CPU
        counted as a read's are: :meth:`_FirstRead.busy_since`), begin the rest (not for
        ``alone`` reads). What the first look that could judge the loader's first read saw
        goes to ``on_first_look``."""
        first, dataset, rest = job
        wall = 0.0
        told = first.again  # (a later probe: the first look was told already)
        while True:
            # Often at first, then less: a read that computes for seconds is not slowed.
            time.sleep(min(max(PEEK, wall / 10), 0.05))
            with first.lock:
                if first.over or (first.began is not None and first.began[1] < 0):
                    # It ended before a look could judge it (on a busy machine this thread
                    # may not run for milliseconds): judged by what it took. Or there is no
                    # way to read another thread's CPU time here.
                    took = first.took
                    waits = took is not None and took[0] >= max(PEEK, PARALLEL_FROM * took[1])
                    break
                if first.began is None:
                    continue
                wall = self._clocks.wall() - first.began[0]
                busy = first.busy_since(*self._clocks.split(first.thread))
                if wall >= PEEK and wall >= PARALLEL_FROM * busy:
                    if not self._alone:
                        first.rest = self._launch(
                            dataset, rest, len(rest) + 1, first.info, first.owner
                        )
                    waits = True
                    break
            if wall >= PEEK and not told:  # it computes, for now
                told = True
                self._tell_first_look(False, first)
        if not told:
            self._tell_first_look(waits, first)

    def _tell_first_look(
        self, waits: bool, first: _FirstRead | None = None, final: bool = False
    ) -> None:
        """Say what the first look saw (of ``first``, by its watcher; ``final``: the word of
        a first read or a probe as a whole, which a watcher, late on a busy machine, must not
        contradict after it)."""
        with self._lock:
            if self._stage == 2:
                return
            if final:
                self._stage = 2
            if first is not None:
                first.said = waits
        if self.on_first_look is not None:
            self.on_first_look(waits)

    def _serial(self, dataset: Any, keys: Sequence[Any], collect: bool) -> list[Any]:
        """The reads one after another on this thread, measured into the averages."""
        results, wall, cpu = self._timed(dataset, keys, collect)
        if keys:
            self._measured(wall, cpu)
        return results

    def _timed(
        self, dataset: Any, keys: Sequence[Any], collect: bool
    ) -> tuple[list[Any], float, float]:
        """The reads one after another on this thread, and their mean wall and CPU seconds."""
        clock, cpu_clock = self._clocks.wall, self._clocks.cpu
        start, cpu_start = clock(), cpu_clock()
        results: list[Any] = []
        for key in keys:
            if collect:
                try:
                    results.append(dataset[key])
                except StopIteration:
                    raise
                except Exception as exc:
                    results.append(Failed(exc))
            else:
                results.append(dataset[key])
        count = max(len(keys), 1)
        cpu = cpu_clock() - cpu_start
        self.cpu_seconds += cpu
        return results, (clock() - start) / count, cpu / count

    def _launch(
        self,
        dataset: Any,
        keys: Sequence[Any],
        at_once: int,
        info: WorkerInfo | None,
        owner: int,
    ) -> Launched:
        """Begin every read of ``keys`` on the pool (at most ``limit`` run at once; ``at_once``
        reads of this batch are in flight, for the statistics), each seeing ``info`` as its
        worker's and counted as serving thread ``owner`` (the worker that asked for them)."""
        pool = self._executor()
        self.peak_width = max(self.peak_width, min(at_once, self.limit))
        clock, cpu_clock = self._clocks.wall, self._clocks.cpu
        queued = self._clocks.queued if self._alone else float  # (see _verdict)
        times: list[Timed] = []

        def one(key: Any) -> Any:
            set_thread_worker_info(info)
            me = threading.get_ident()
            _SERVING[me] = (owner, key, sys._getframe())
            start, cpu_start, queued_start = clock(), cpu_clock(), queued()
            try:
                return dataset[key]
            finally:
                cpu = cpu_clock() - cpu_start
                times.append((clock() - start, _counted(cpu, queued() - queued_start), cpu))
                self.cpu_seconds += cpu
                del _SERVING[me]

        began = clock()
        return [pool.submit(one, key) for key in keys], times, began

    def _gather(
        self,
        launched: Launched,
        *,
        collect: bool,
        also: Timed | None = None,
        expect: bool = False,
    ) -> list[Any]:
        """The results of reads :meth:`_launch` began, in key order (see :meth:`read`), then
        what they say of one read's wall and CPU seconds into the averages (:meth:`_verdict`;
        with ``also``, one more read's, the first read that began them). With
        ``expect``, the first result tells the collate allocator what the batch will need
        while the others are read (:func:`~ferry._core.alloc.expect_batch`)."""
        futures, times, began = launched
        results: list[Any] = []
        try:
            for future in futures:
                if not collect:
                    results.append(future.result())
                else:
                    try:
                        results.append(future.result())
                    except StopIteration:
                        raise
                    except Exception as exc:
                        results.append(Failed(exc))
                if expect and len(results) == 1 and not isinstance(results[0], Failed):
                    expect_batch(results[0], len(futures))
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        measured = [*times, also] if also is not None else times
        if measured:
            # (the fill matters only to a process worker's own reads: see _verdict)
            filled = _filled(times, self._clocks.wall() - began) if self._alone else 0.0
            self._last.parallel = self._verdict(measured, filled)
        return results

    def _verdict(self, measured: list[Timed], filled: float = 0.0) -> tuple[float, float, int]:
        """What reads run at once, ``measured``, say of one read: its wall and CPU seconds into
        the averages, and their sums and count returned for :meth:`last_parallel`.

        Thread workers' reads: their sums (a mean read). A process worker's (``alone``: the
        judge of ``num_workers="auto"`` reads them, and a wrong "they wait" moves computing
        work to threads, one CPU for all) by their median read, with its busy seconds
        (:func:`_counted`: a wait for a CPU is not a wait). Reads at once wait for one another
        where they compute: for the GIL, or for a CPU on a machine with fewer CPUs than
        reads, and their summed times count that as waiting (255 reads of 1 ms of Python at
        once: 15x their CPU, summed), where most of them, run whole, take about their busy
        time. Where the median read waited less than :data:`PARALLEL_FROM` times that, they
        compute, and the averages start again from this batch. (A dataset whose reads mostly
        compute and sometimes wait, a cache that mostly hits, then stays in processes:
        reading it as torch does is the safe side.)

        Reads as long as the GIL's switch interval (5 ms) or longer are cut short by it, so
        that each waits for the others even at the median (eight reads of 4 ms of Python at
        once: 7x). ``filled``, the share of their span the reads' busy seconds fill
        (:func:`_filled`), catches them: at :data:`GIL_FILLED` or more, the reads kept this
        process's GIL busy, and thread workers, one GIL for all, could not read faster than
        this one process does; they are reported as computing (the averages, and so this
        worker's own width, stay as measured)."""
        count = len(measured)
        wall = sum(t[0] for t in measured)
        if not self._alone:
            cpu = sum(t[2] for t in measured)
            self._measured(wall / count, cpu / count)
            return wall, cpu, count
        busy = sum(t[1] for t in measured)
        # (the lower median of an even count: the probe's, of a probe and one read, is not it)
        median = sorted(t[0] / max(t[1], 1e-7) for t in measured)[(count - 1) // 2]
        computes = median < PARALLEL_FROM
        if computes:  # one read took about the median's share
            wall = min(wall, median * busy)
        self._measured(wall / count, busy / count, anew=computes)
        if not computes and filled >= GIL_FILLED:  # (the averages stay as measured)
            return min(wall, busy), busy, count
        return wall, busy, count

    def last_parallel(self) -> tuple[float, float, int] | None:
        """Of this thread's last :meth:`read`, when its reads ran on the pool: their wall and
        CPU seconds, summed, and how many there were (a batch read at once takes about one
        read's time, so its own wall time says little of how long its reads wait), as
        :meth:`_verdict` judged them. For the batch of a process worker's first read that
        waited, what the reads after it took, however they ran (see :meth:`_after_first`).
        None when every read ran on this thread."""
        return getattr(self._last, "parallel", None)

    def _measured(self, wall: float, cpu: float, anew: bool = False) -> None:
        """One batch's mean wall and CPU seconds per read: update the averages and the width
        (``anew``: they replace the averages)."""
        with self._lock:
            if anew or self.wall is None or self.cpu is None:
                self.wall, self.cpu = wall, cpu
            else:
                self.wall += SMOOTHING * (wall - self.wall)
                self.cpu += SMOOTHING * (cpu - self.cpu)
            ratio = self.ratio
            self.width = 1 if ratio < PARALLEL_FROM else min(self.limit, math.ceil(ratio))

    def warm(self) -> None:
        """Start the pool's first thread now, as the workers start: it watches the loader's
        first read. Started in the first batch instead, the wait for it to run (milliseconds on
        a loaded machine) counted as waiting in that batch's time, which ``num_workers="auto"``
        judges (a CPU-bound dataset could pass for reads that wait)."""
        if self.wall is None:
            self._executor().warm()

    def _executor(self) -> _Pool:
        with self._lock:
            if self._closed:
                raise RuntimeError("the loader's reads were shut down")
            if self._pool is None:
                self._pool = _Pool(self.limit, self._detached)
            return self._pool

    def close(self, timeout: float = 5.0) -> None:
        """Stop the pool's threads: reads in flight finish, none start after; waits up to
        ``timeout`` seconds for them (a read that hangs is left to its daemon thread)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is None:
            return
        deadline = perf_counter() + timeout
        here = threading.current_thread()  # (a finalizer may close the pool on one of its own)
        for thread in pool.shutdown():
            # (one being started now leaves at its first task)
            if thread.ident is not None and thread is not here:
                thread.join(max(deadline - perf_counter(), 0.0))
