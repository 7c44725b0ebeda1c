"""How much memory a worker process has made its own during an epoch: copy-on-write, measured.

A forked worker starts by sharing every page of the main process. Reading a Python object
writes to it (its reference count; a container's GC header when the collector runs), so a
worker that reads the items of a large list of ``str`` or ``dict`` copies every page they sit
on: each worker ends up with a private copy of the dataset, and the process tree grows by the
dataset's size per worker. This is the best known DataLoader memory problem, and it is silent:
the memory looks like a leak.

What is measured: the worker's proportional share of anonymous memory (``Pss_Anon`` in
``/proc/<pid>/smaps_rollup``). A page the worker still shares with the main process and the
other workers counts a fraction; a page it copied counts whole. Shared-memory slabs (the
batches on their way) are not anonymous memory and do not count. Where ``Pss_Anon`` is missing
(kernels before 5.x), the private pages (``Private_Clean`` + ``Private_Dirty``) stand in.

Reading ``smaps_rollup`` walks the process's page tables (about 2.5 ms for a 500 MB process on
the dev machine), so a worker reads it after the first batch of each epoch (the baseline: the
worker's working set is in place) and then at most four times a second, and never for more than 1%
of its time; the figure travels with the batch (``Done.memory``). The main process keeps the
first and latest figure of each worker (``ferry.stats``), which is what ``stats()``, the
doctor and ``num_workers="auto"`` read.
"""

from __future__ import annotations

import _thread
import threading
import time
from collections.abc import Callable

__all__ = [
    "COPY_ON_WRITE",
    "COST_SHARE",
    "AsideSampler",
    "MemorySampler",
    "anon_bytes",
    "available_memory",
    "growth_verdict",
    "proc_kb",
    "resident_anon_bytes",
]

# Workers whose memory grew this much on average during an epoch (after their first batch):
# more than a working set of decoded samples, the signature of copy-on-write.
COPY_ON_WRITE = 64 << 20
# Read at most four times a second ...
INTERVAL_S = 0.25
# ... and never for more than 1 / this of the worker's time.
COST_SHARE = 100

_ROLLUP = "/proc/self/smaps_rollup"


def proc_kb(path: str, *names: str) -> dict[str, int]:
    """The fields ``names`` of a ``/proc`` file whose values are in kB (``meminfo``,
    ``status``, ``smaps_rollup``), in bytes; a field the file lacks is left out, and nothing
    is there when the file cannot be read (not Linux, or the process has exited)."""
    fields: dict[str, int] = {}
    try:
        with open(path, encoding="ascii") as file:
            for line in file:
                name, _, rest = line.partition(":")
                if name in names:
                    fields[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return fields


def anon_bytes(path: str = _ROLLUP) -> int:
    """This process's share of anonymous memory in bytes (see the module docstring); -1 where
    ``/proc`` does not say."""
    fields = proc_kb(path, "Pss_Anon", "Private_Clean", "Private_Dirty")
    if "Pss_Anon" in fields:
        return fields["Pss_Anon"]
    if "Private_Clean" in fields and "Private_Dirty" in fields:
        return fields["Private_Clean"] + fields["Private_Dirty"]
    return -1


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (``MemAvailable``), if known:
    what slabs are checked against before they are committed (more would wake the OOM killer
    instead of failing cleanly), and what ``num_workers="auto"`` budgets."""
    return proc_kb("/proc/meminfo", "MemAvailable").get("MemAvailable")


class MemorySampler:
    """When a worker reads its memory: after the first batch of an epoch, then at most four
    times a second and within 1% of its time. :meth:`after_batch` reads when a read is due and
    returns the figure, or -1 when it was not read (not due, or not available on this system);
    :meth:`finished` gives the figure of the last read once, for the next batch to carry."""

    def __init__(
        self,
        read: Callable[[], int] = anon_bytes,
        clock: Callable[[], float] = time.perf_counter,
        cost_clock: Callable[[], float] | None = None,
    ) -> None:
        self._read = read
        self._clock = clock
        self._cost_clock = clock if cost_clock is None else cost_clock  # what a read costs
        self._next = 0.0  # due at once
        # When the 1% share allows the next read (the cost part of ``_next``): a new epoch
        # does not buy another read sooner. Persistent workers of short epochs read at every
        # epoch's first batch otherwise: 5-7 ms of a 2-worker, 50 ms epoch (measured).
        self._allowed = 0.0
        self._available = True
        self._figure = -1  # the last read's figure, until :meth:`finished` takes it

    def restart(self) -> None:
        """A new epoch: its next batch is measured (its baseline), unless the last read was
        too recent for the 1% share (then the first batch due is)."""
        self._next = self._allowed

    def _due(self) -> float | None:
        """The clock's reading when a read is due now, else None."""
        if not self._available:
            return None
        now = self._clock()
        return now if now >= self._next else None

    def _measure(self, started: float) -> int:
        began = self._cost_clock()
        value = self._read()
        if value < 0:
            self._available = False
            return -1
        cost = self._cost_clock() - began
        self._allowed = started + cost * COST_SHARE
        self._next = max(started + INTERVAL_S, self._allowed)
        self._figure = value
        return value

    def after_batch(self) -> int:
        started = self._due()
        return -1 if started is None else self._measure(started)

    def finished(self) -> int:
        """The figure of the last read, once (-1: no read since the last call)."""
        figure, self._figure = self._figure, -1
        return figure


class AsideSampler(MemorySampler):
    """A :class:`MemorySampler` whose reads after an epoch's first run on a thread of their
    own, beside the worker's next batch: :meth:`after_batch` starts a read when one is due and
    none is running, and returns at once (-1); :meth:`finished` gives the figure once the read
    is over. The epoch's first read, its baseline, is made inline as before: read beside the
    next batch, it would count that batch's growth in the baseline (a worker that copies the
    dataset in its second batch would look as if it had not grown).

    The kernel walks the page tables while the reading thread has let go of the GIL, so where
    a CPU is free (a worker that waits on I/O, or a machine with more CPUs than busy workers)
    the read costs the worker's batches nothing; where none is, it costs what it cost inline.
    Measured inline on 2 cores, about 3 ms a read: 10-13 ms an epoch of each worker's time
    (``scripts/uneven_workers.py``). The thread starts at the first read, without waiting for
    it to run, and ends with the process (a worker process's, never joined). What a read
    costs, for the 1% share, is the reading thread's CPU time (the kernel's walk is charged to
    it), not its wall time, which waits for the GIL and the CPU beside the batch."""

    def __init__(
        self,
        read: Callable[[], int] = anon_bytes,
        clock: Callable[[], float] = time.perf_counter,
        cost_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        super().__init__(read, clock, cost_clock)
        self._wake = threading.Semaphore(0)
        self._running = False  # a read was asked for and has not finished
        self._thread = False
        self._baseline = True  # the epoch's first read is still to be made

    def restart(self) -> None:
        super().restart()
        self._baseline = True

    def after_batch(self) -> int:
        if self._running:
            return -1
        started = self._due()
        if started is None:
            return -1
        if self._baseline:
            self._baseline = False
            return self._measure(started)
        self._running = True
        if not self._thread:
            _thread.start_new_thread(self._serve, ())
            self._thread = True
        self._wake.release()
        return -1

    def finished(self) -> int:
        # While a read runs its thread may be writing the figure; none is waiting here then
        # (this end takes each figure before it asks for the next read).
        if self._running:
            return -1
        return super().finished()

    def _serve(self) -> None:
        while True:
            self._wake.acquire()
            try:
                self._measure(self._clock())
            except Exception:  # (a read that fails is a read not made, as inline)
                self._available = False
            finally:
                self._running = False


def resident_anon_bytes(path: str = "/proc/self/status") -> int:
    """This process's resident anonymous memory (``RssAnon``; -1: not known). Cheap, unlike
    ``smaps_rollup``: the kernel keeps the count."""
    return proc_kb(path, "RssAnon").get("RssAnon", -1)


def growth_verdict(
    growth: int,
    made: int,
    left: int,
    available: int | None,
    ceiling: int = -1,
    *,
    share: float = 0.5,
) -> str:
    """Whether process workers should give way to threads because of their memory growth
    (``num_workers="auto"``); returns why ("" when they stay).

    ``growth``: bytes the workers together grew by since their first batch, over ``made``
    batches since; ``left``: batches of the epoch still to be made; ``available``: the
    memory the system could still give when the epoch began (``MemAvailable``); ``ceiling``:
    the most they can copy (each worker all of the main process's anonymous memory at the
    start; -1: not known). The growth is projected linearly to the end of the epoch, at most
    to the ceiling (copy-on-write slows as fewer pages are left to copy: random reads touch
    most pages early); past ``share`` of what is available, the workers move to threads,
    which share the dataset instead of copying it.
    """
    if available is None or growth < COPY_ON_WRITE or made <= 0:
        return ""
    projected = growth + growth * left // made
    if ceiling >= 0:
        projected = max(growth, min(projected, ceiling))
    if projected <= share * available:
        return ""
    mib = 1 << 20
    return (
        f"memory: the process workers copied {growth // mib} MiB of the main process's pages "
        f"in {made} batches (copy-on-write of the dataset's Python objects), about "
        f"{projected // mib} MiB by the end of the epoch, more than {share:.0%} of the "
        f"{available // mib} MiB available"
    )
