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
the dev machine; a forked worker walks the tables it inherited too, so its read grows with the
main process: 7.5 ms under a process that imported torch, 17 ms under one that also imported
Lightning, transformers and datasets), so a worker reads it at most four times a second, and
never for more than 1% of its time; the figure travels with the batch (``Done.memory``). The
main process keeps the first and latest figure of each worker (``ferry.stats``), which is what
``stats()``, the doctor and ``num_workers="auto"`` read.

A page becomes resident, or a copy of its own, only through a page fault, and the kernel counts
a process's faults for nothing (``getrusage``, ``/proc/<pid>/stat``). So a read that is due is
skipped while the process has taken fewer than :data:`QUIET_FAULTS` faults since the last one:
the last figure stands, at no cost. A worker in its steady state (its batches made in slabs it
reuses) faults a few pages a batch and is read every :data:`STALE_S` at most; copy-on-write,
which faults a page at each copy, is read as before. On 2 cores the reads were about 2% of a
sleeping workload's rate (``scripts/uneven_workers.py``, docs/design/scaling.md).

The first figure (the baseline the growth is counted from) follows the same rule: after its
first batch (its working set in place) a worker only notes its fault count, and reads once it
has taken :data:`QUIET_FAULTS` faults since, or :data:`STALE_S` after. Until then it cannot
have grown by more than a megabyte, so a worker whose epoch ends first (a short epoch, a
validation pass) is never read: every such epoch used to pay one read per worker for a
baseline no second figure followed (13 ms of CPU in each 70 ms epoch of 2 workers under a
process that imported torch, 41 ms in each 120 ms one under Lightning and transformers: the
difference between slower than torch's loader and faster; BENCHMARKS.md, fourteenth session).
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = [
    "COPY_ON_WRITE",
    "COST_SHARE",
    "MemorySampler",
    "anon_bytes",
    "available_memory",
    "fault_count",
    "growth_verdict",
    "proc_kb",
    "proc_stat",
    "process_faults",
    "resident_anon_bytes",
    "unchanged_since",
]

# Workers whose memory grew this much on average during an epoch (after their first batch):
# more than a working set of decoded samples, the signature of copy-on-write.
COPY_ON_WRITE = 64 << 20
# Read at most four times a second ...
INTERVAL_S = 0.25
# ... and never for more than 1 / this of the worker's time.
COST_SHARE = 100
# A due read is skipped while the process took fewer page faults than this since the last
# read (the figure can have grown by no more than as many pages: 1 MiB of 4 KiB pages) ...
QUIET_FAULTS = 256
# ... unless the last read is this old: a fault can map a 2 MiB huge page, and the kernel's
# khugepaged fills huge pages without faults of the process's own.
STALE_S = 10.0

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


def fault_count() -> int:
    """The page faults this process has taken, minor and major, all its threads together
    (-1: not known here)."""
    try:
        from resource import RUSAGE_SELF, getrusage
    except ImportError:  # (not Unix: no counts, so every read that is due is made)
        return -1
    usage = getrusage(RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def proc_stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command's name (which may hold spaces and
    parentheses): the state first, so field ``n`` of proc(5) is at ``n - 3``. Empty when the
    file cannot be read (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as file:
            return file.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def process_faults(pid: int) -> int:
    """:func:`fault_count` of process ``pid``, from its ``/proc/<pid>/stat`` (-1: not known,
    or the process is gone)."""
    fields = proc_stat(pid)
    try:
        return int(fields[7]) + int(fields[9])  # minflt (field 10) and majflt (12)
    except (ValueError, IndexError):
        return -1


def unchanged_since(faults_then: int, faults_now: int) -> bool:
    """Whether a process's anonymous memory cannot have grown by more than
    :data:`QUIET_FAULTS` pages between two fault counts (False when either is not known)."""
    return faults_then >= 0 and 0 <= faults_now - faults_then < QUIET_FAULTS


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (``MemAvailable``), if known:
    what slabs are checked against before they are committed (more would wake the OOM killer
    instead of failing cleanly), and what ``num_workers="auto"`` budgets."""
    return proc_kb("/proc/meminfo", "MemAvailable").get("MemAvailable")


class MemorySampler:
    """When a worker reads its memory: once it faulted pages in since its first batch (the
    first figure) or since the last read, at most four times a second and within 1% of its
    time (see the module docstring). :meth:`after_batch` returns the figure (the last one read,
    when nothing could have changed it), or -1 when none is due (or the system has none);
    ``faults`` is the process's fault count when that figure was read."""

    def __init__(
        self,
        read: Callable[[], int] = anon_bytes,
        clock: Callable[[], float] = time.perf_counter,
        faults: Callable[[], int] = fault_count,
    ) -> None:
        self._read = read
        self._clock = clock
        self._faults = faults
        self.value = -1  # the last figure read
        self.faults = -1  # the fault count as it was read
        self._read_at = 0.0
        self._next = 0.0  # due at once
        # When the 1% share allows the next read (the cost part of ``_next``): a new epoch
        # does not buy another read sooner. Persistent workers of short epochs read at every
        # epoch's first batch otherwise: 5-7 ms of a 2-worker, 50 ms epoch (measured).
        self._allowed = 0.0
        self._available = True
        # Before the first figure: when the first batch was made, and the fault count then.
        self._first_batch: tuple[float, int] | None = None

    def restart(self) -> None:
        """A new epoch (persistent workers): a measure is due at its next batch (its
        baseline), unless the last read was too recent for the 1% share (then at the first
        batch where one is); where no page was faulted in since, the figure that stands is it."""
        self._next = self._allowed

    def after_batch(self) -> int:
        if not self._available:
            return -1
        started = self._clock()
        if started < self._next:
            return -1
        if self.value < 0 and self._not_grown_yet(started):
            return -1
        if (
            self.value >= 0
            and started - self._read_at < STALE_S
            and unchanged_since(self.faults, self._faults())
        ):
            self._next = max(started + INTERVAL_S, self._allowed)
            return self.value
        value = self._read()
        if value < 0:
            self._available = False
            return -1
        cost = self._clock() - started
        self._allowed = started + cost * COST_SHARE
        self._next = max(started + INTERVAL_S, self._allowed)
        # (counted after the read: what reading it faulted in is not the worker's growth)
        self.value, self.faults, self._read_at = value, self._faults(), started
        return value

    def _not_grown_yet(self, now: float) -> bool:
        """No figure yet: whether the worker can have grown by no more than
        :data:`QUIET_FAULTS` pages since its first batch (whose fault count this notes), and
        its first batch is less than :data:`STALE_S` old: then the first read waits. Where
        faults are not counted, the first batch is read at once."""
        faults = self._faults()
        if faults < 0:
            return False
        if self._first_batch is None:
            self._first_batch = (now, faults)
            return True
        at, then = self._first_batch
        return now - at < STALE_S and unchanged_since(then, faults)


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

    ``growth``: bytes the workers together grew by since their first measure, over ``made``
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
