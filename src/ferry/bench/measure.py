"""What one benchmark run measures and how: CPU, memory, the memcpy bound, batch contents.

Choices, and why:

- **CPU** is the process CPU time of the main process (``time.process_time()``: every thread,
  so thread workers and pin-memory threads count) plus the user+system time of its descendant
  processes, read from ``/proc/<pid>/stat`` at the two ends of the steady-state window (first
  batch in hand, last batch in hand) while the workers are still alive. A worker reaped inside
  the window is counted through ``RUSAGE_CHILDREN`` instead. ``RUSAGE_CHILDREN`` alone would
  see workers only once reaped, after the window, start-up and shutdown included. Without
  ``/proc`` (not Linux) only ``RUSAGE_CHILDREN`` counts children, which the metadata says.
- **Peak memory** is the largest sum of the resident set sizes of the main process and its
  descendants (``/proc/<pid>/statm``), sampled every 10 ms by a background thread for the whole
  run, plus one sample at each end of the window. ``ru_maxrss`` cannot be reset between runs
  and does not sum live children, so it is the fallback only without ``/proc``. Forked workers'
  RSS includes pages they share copy-on-write with the main process, so process-worker rows
  overstate the true total; both loaders are counted the same way.
- **The memcpy bound**: one memcpy of as many bytes as a batch's tensors hold, between
  preallocated tensors (see :func:`memcpy_batches_per_s`): the least work any loader must do to
  hand over a batch it did not make in place.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from ferry._cli import batch_leaves
from ferry._core.memory import proc_stat
from ferry._core.rng import tensor_bytes

__all__ = [
    "HAVE_PROC",
    "CpuSnapshot",
    "MemorySampler",
    "RunTimeout",
    "batch_digest",
    "check_keys",
    "deadline",
    "descendants",
    "memcpy_batches_per_s",
    "rss_bytes",
]

HAVE_PROC = os.path.exists(f"/proc/{os.getpid()}/statm")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_SAMPLE_EVERY_S = 0.01
_SHUTDOWN_GRACE_S = 30.0


def _read(path: str) -> str | None:
    """The text of a /proc file, or None when the process has gone meanwhile."""
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return None


def descendants(pid: int | None = None, depth: int | None = None) -> list[int]:
    """The live descendant processes of ``pid`` (default: this one), children of every thread;
    ``depth=1`` gives the direct children only."""
    if not HAVE_PROC:
        return []
    found: list[int] = []
    todo = [(os.getpid() if pid is None else pid, 0)]
    while todo:
        parent, level = todo.pop()
        if depth is not None and level >= depth:
            continue
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in threads:
            children = _read(f"/proc/{parent}/task/{tid}/children") or ""
            for child in map(int, children.split()):
                found.append(child)
                todo.append((child, level + 1))
    return found


def _proc_cpu_seconds(pid: int) -> float:
    fields = proc_stat(pid)
    if not fields:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime (field 14) and stime (15)


def _reaped_children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds used so far by this process (all threads), by each live descendant, and by
    the children already reaped (``RUSAGE_CHILDREN``, their whole lives)."""

    own: float
    live: dict[int, float]
    direct: frozenset[int]
    reaped: float

    @classmethod
    def now(cls) -> CpuSnapshot:
        """Read the clocks now."""
        direct = frozenset(descendants(depth=1))
        live = {pid: _proc_cpu_seconds(pid) for pid in descendants()}
        return cls(time.process_time(), live, direct, _reaped_children_cpu_seconds())

    def until(self, later: CpuSnapshot) -> float:
        """CPU seconds used between this snapshot and ``later``.

        Workers started in between count from zero. A direct child that was reaped in between
        (a loader that joins its workers at the end of the epoch) is counted through
        ``RUSAGE_CHILDREN``, less what it had used before this snapshot.
        """
        spent = later.own - self.own + later.reaped - self.reaped
        for pid, seconds in later.live.items():
            spent += seconds - self.live.get(pid, 0.0)
        for pid in self.direct - later.live.keys():
            spent -= self.live.get(pid, 0.0)
        return max(spent, later.own - self.own)


def rss_bytes() -> int:
    """Resident set size of this process plus its live descendants, in bytes."""
    if not HAVE_PROC:
        scale = 1 if sys.platform == "darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    total = 0
    for pid in [os.getpid(), *descendants()]:
        text = _read(f"/proc/{pid}/statm")
        if text is not None:
            total += int(text.split()[1]) * _PAGE
    return total


class MemorySampler:
    """A daemon thread that samples :func:`rss_bytes` every 10 ms and keeps the peak.

    Example::

        >>> with MemorySampler() as memory:
        ...     run_the_loader()
        >>> memory.peak
    """

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ferry-bench-memory", daemon=True)

    def sample(self) -> None:
        """Take one sample now (also called at the ends of the timed window)."""
        self.peak = max(self.peak, rss_bytes())

    def _loop(self) -> None:
        while not self._stop.wait(_SAMPLE_EVERY_S):
            self.sample()

    def __enter__(self) -> MemorySampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


class RunTimeout(Exception):
    """A run took longer than its time limit (likely a hang in the loader under test)."""


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`RunTimeout` in the main thread after ``seconds``, so a hung loader fails
    its row instead of the whole benchmark. A no-op off the main thread or without SIGALRM."""
    usable = (
        seconds > 0
        and hasattr(signal, "SIGALRM")
        and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield
        return

    def expire(signum: int, frame: FrameType | None) -> None:
        # Fire again if the loader's shutdown, run while this exception unwinds, hangs too.
        signal.setitimer(signal.ITIMER_REAL, _SHUTDOWN_GRACE_S)
        raise RunTimeout(f"the run took longer than {seconds:g} s (--timeout)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def batch_digest(batch: Any) -> str:
    """A hash of a batch's structure, dtypes, shapes and values.

    Equal digests from torch and ferry for the same seed mean the loader under test gave the
    same first batch: a fast loader that returns the wrong data must not look good.
    """
    digest = hashlib.blake2b(digest_size=16)
    for leaf in batch_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            digest.update(f"tensor {leaf.dtype} {tuple(leaf.shape)}".encode())
            digest.update(
                tensor_bytes(leaf.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
            )
        elif hasattr(leaf, "dtype") and hasattr(leaf, "tobytes"):  # a numpy array
            digest.update(f"array {leaf.dtype} {leaf.shape}".encode())
            digest.update(leaf.tobytes())
        else:
            digest.update(f"{type(leaf).__name__} {leaf!r}".encode())
    return digest.hexdigest()


def memcpy_batches_per_s(nbytes: int, trials: int = 5, trial_s: float = 0.01) -> float:
    """Copies per second of one memcpy of ``nbytes`` between preallocated uint8 tensors.

    The copy is libc's ``memmove`` on the tensors' storage rather than ``dst.copy_(src)``:
    torch's copy runs on its intra-op thread pool, whose wake-up stalls (several ms on small
    VMs) made the bound swing a hundredfold between rows; one memcpy on one core is the
    stable physical figure. The result is the best of ``trials`` short trials: a bound is the
    fastest the machine can do.
    """
    size = max(nbytes, 1)
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.empty_like(src)
    source, target = src.data_ptr(), dst.data_ptr()
    ctypes.memmove(target, source, size)  # fault the pages in before timing
    best = 0.0
    for _ in range(trials):
        copies, elapsed, start = 0, 0.0, time.perf_counter()
        while elapsed < trial_s or copies < 3:
            ctypes.memmove(target, source, size)
            copies += 1
            elapsed = time.perf_counter() - start
        best = max(best, copies / elapsed)
    return best


def check_keys(seen: Iterable[int], samples: int, *, whole_epoch: bool) -> None:
    """Raise ``ValueError`` unless every index in ``seen`` is in ``range(samples)`` and came
    once; over a whole epoch, unless every index of the range came.

    A loader that drops, repeats or invents samples must not get a figure: it would look fast.
    """
    counts: dict[int, int] = {}
    for key in seen:
        counts[key] = counts.get(key, 0) + 1
    repeated = sorted(key for key, count in counts.items() if count > 1)
    foreign = sorted(key for key in counts if not 0 <= key < samples)
    missing = samples - (len(counts) - len(foreign)) if whole_epoch else 0
    problems = []
    if repeated:
        problems.append(f"{len(repeated)} indices came more than once (first {repeated[0]})")
    if foreign:
        problems.append(f"{len(foreign)} indices outside range({samples}) (first {foreign[0]})")
    if missing:
        first = next(key for key in range(samples) if key not in counts)
        problems.append(f"{missing} of {samples} indices never came (first {first})")
    if problems:
        raise ValueError("; ".join(problems))
