"""Per-sample reads of a map-style dataset, in parallel when they wait.

A torch-style worker reads the samples of its batch one after another, so when a sample costs
milliseconds of waiting (an object store, a network file system) and microseconds of CPU, the
loader's concurrency is the number of batches in flight, and the first batch arrives after
``batch_size x latency``. :class:`SampleReads` reads the samples of a batch at once on a pool of
threads shared by every worker thread of a loader, when measurement says they wait:

* Each read is timed twice: wall time and the CPU time of the thread that ran it
  (``time.thread_time``). Their ratio is how many reads one core could keep in flight: about 1
  for work that holds the GIL (decoding in Python), hundreds for a read that sleeps on I/O.
* ``width``, how many samples of one batch are read at once, follows that ratio: 1 (one after
  another, as torch does, and with no pool) until the reads are measured to wait at least
  :data:`PARALLEL_FROM` times their CPU, then ``ceil(ratio)``, at most the batch and the pool.
  It is decided again after every batch from a moving average, so it adapts within an epoch
  (a long first epoch does not run at the rate of one read at a time).
* Whatever the width, a batch is the same: its samples in key order, collated once; a read that
  raises raises the error of the first failing key in key order (reads not yet started are
  cancelled), and with ``on_error="skip"`` every failing key is reported, in order.

Only thread workers use it (they share the dataset already, so reading it from more threads
asks nothing new of it); process workers and ``num_workers=0`` read as torch does.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from time import perf_counter, thread_time
from typing import Any

__all__ = ["PARALLEL_FROM", "POOL_LIMIT", "Failed", "SampleReads", "WaitJudge"]

# Reads run in parallel once they wait at least this many times their CPU time.
PARALLEL_FROM = 4.0
# At most this many reads in flight for one loader (the pool's threads).
POOL_LIMIT = 64
# Weight of the latest batch in the moving averages of wall and CPU time per read.
SMOOTHING = 0.3


class Failed:
    """A read that raised (``read(..., collect=True)``): ``error`` is what it raised."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Pool:
    """A pool of daemon threads (``ferry-read-N``), started as reads need them, up to
    ``limit``. Daemon threads, unlike ``concurrent.futures``' pool: a read that never returns
    must not keep the interpreter from exiting."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._tasks: queue.SimpleQueue[tuple[Future[Any], Callable[[Any], Any], Any] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0

    def submit(self, fn: Callable[[Any], Any], arg: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._idle == 0 and len(self._threads) < self._limit:
                thread = threading.Thread(
                    target=self._run, name=f"ferry-read-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                self._idle += 1
                thread.start()
            self._idle -= 1  # (the task takes an idle thread, or waits for one)
        self._tasks.put((future, fn, arg))
        return future

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, fn, arg = task
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(arg))
                except BaseException as exc:
                    future.set_exception(exc)
            with self._lock:
                self._idle += 1

    def shutdown(self) -> list[threading.Thread]:
        """Ask every thread to stop once the reads queued before are done; returns them."""
        with self._lock:
            threads = list(self._threads)
        for _ in threads:
            self._tasks.put(None)
        return threads


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
    ) -> None:
        self.limit = limit
        self._clock, self._cpu_clock = clock, cpu_clock
        self._lock = threading.Lock()
        self._pool: _Pool | None = None
        self._closed = False
        # Moving averages of one read's wall and CPU seconds (None: nothing measured yet).
        self.wall: float | None = None
        self.cpu: float | None = None
        self.width = 1
        self.peak_width = 1  # the most reads of one batch run at once (for the statistics)
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
        if self.wall is None and len(keys) > 1:
            # Nothing measured yet: one read alone says whether the rest should run at once
            # (the first batch of a loader that waits arrives after about two reads, not 32).
            return self._serial(dataset, keys[:1], collect) + self.read(dataset, keys[1:], collect)
        if min(self.width, len(keys)) <= 1:
            return self._serial(dataset, keys, collect)
        return self._parallel(dataset, keys, collect)

    def _serial(self, dataset: Any, keys: Sequence[Any], collect: bool) -> list[Any]:
        clock, cpu_clock = self._clock, self._cpu_clock
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
        if keys:
            self._measured((clock() - start) / len(keys), (cpu_clock() - cpu_start) / len(keys))
        return results

    def _parallel(self, dataset: Any, keys: Sequence[Any], collect: bool) -> list[Any]:
        pool = self._executor()
        self.peak_width = max(self.peak_width, min(self.width, len(keys)))
        clock, cpu_clock = self._clock, self._cpu_clock
        times: list[tuple[float, float]] = []

        def one(key: Any) -> Any:
            start, cpu_start = clock(), cpu_clock()
            try:
                return dataset[key]
            finally:
                times.append((clock() - start, cpu_clock() - cpu_start))  # (atomic append)

        futures: list[Future[Any]] = [pool.submit(one, key) for key in keys]
        results: list[Any] = []
        try:
            for future in futures:
                if not collect:
                    results.append(future.result())
                    continue
                try:
                    results.append(future.result())
                except StopIteration:
                    raise
                except Exception as exc:
                    results.append(Failed(exc))
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        if times:
            self._measured(
                sum(t[0] for t in times) / len(times), sum(t[1] for t in times) / len(times)
            )
        return results

    def _measured(self, wall: float, cpu: float) -> None:
        """One batch's mean wall and CPU seconds per read: update the averages and the width."""
        with self._lock:
            if self.wall is None or self.cpu is None:
                self.wall, self.cpu = wall, cpu
            else:
                self.wall += SMOOTHING * (wall - self.wall)
                self.cpu += SMOOTHING * (cpu - self.cpu)
            ratio = self.ratio
            self.width = 1 if ratio < PARALLEL_FROM else min(self.limit, math.ceil(ratio))

    def _executor(self) -> _Pool:
        with self._lock:
            if self._closed:
                raise RuntimeError("the loader's reads were shut down")
            if self._pool is None:
                self._pool = _Pool(self.limit)
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
        for thread in pool.shutdown():
            thread.join(max(deadline - perf_counter(), 0.0))


class WaitJudge:
    """Whether process workers wait on their reads (``num_workers="auto"``): from the first
    ``batches`` batches they make, their wall seconds (fetch and collate) against the CPU
    seconds their thread used. Decides once; :meth:`add` returns why they should become
    thread workers, or "" (not yet, or they stay)."""

    def __init__(self, batches: int) -> None:
        self.batches = max(batches, 1)
        self.wall = self.cpu = 0.0
        self.seen = self.reads = 0
        self.decided = False

    def per_read(self) -> tuple[float, float] | None:
        """One read's mean wall and CPU seconds over the batches judged (None: none yet)."""
        if not self.reads:
            return None
        return self.wall / self.reads, self.cpu / self.reads

    def add(self, wall: float, cpu: float, reads: int = 1) -> str:
        """A batch of ``reads`` samples took ``wall`` seconds and ``cpu`` CPU seconds."""
        if self.decided:
            return ""
        self.wall += wall
        self.cpu += cpu
        self.reads += reads
        self.seen += 1
        if self.seen < self.batches:
            return ""
        self.decided = True
        ratio = self.wall / max(self.cpu, 1e-7)
        if ratio < PARALLEL_FROM:
            return ""
        return (
            f"worker_type='thread' from batch {self.seen} of the first epoch on: the process "
            f"workers' batches took {ratio:.0f}x the CPU time they used (their reads wait), and "
            "thread workers read the samples of a batch at once"
        )
