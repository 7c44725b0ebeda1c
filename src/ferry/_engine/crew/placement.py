"""Process workers moved round the CPUs they run on while an epoch runs: :class:`WorkerMover`.

Why. A loader that deals batches to its workers in turns (torch's round-robin, and ferry's, so
that each worker draws torch's random numbers for its batches) ends an epoch with its slowest
worker. Where the CPUs differ in speed, as the vCPUs of a cloud VM do, the slowest worker is the
one Linux left on the slowest CPU: a busy process is not moved while every CPU is busy. On the
16-vCPU GPU host the CPUs' rates spread 1.7x and half of that spread followed the CPU
(``scripts/cpu_speeds.py``); 15 processes making equal shares of the jpeg work ended at 85-88%
of their summed rates where placed by the scheduler, and at 92% where they traded CPUs every
50 ms (docs/design/scaling.md, "Workers moved round the CPUs").

How. Every ``PERIOD_S`` while an epoch of the loader runs, each worker is moved to the CPU the
next worker last ran on, and at once set free again (its affinity back to the CPUs it had): the
workers trade places among the CPUs the scheduler gave them, so over a few hundred ms each runs
on every one of them, at their mean speed. No CPU is given a worker it did not have, and the
scheduler keeps its say: it may move a worker on at once (another process wanting that CPU).
Workers trade places within their NUMA node only (a worker moved away from its memory's node
would be slower), and only those that computed since the last look (their CPU time in
/proc/PID/stat moved): an idle worker stays put, and while all idle (an epoch left unfinished,
a training step slower than the loader) the looks come less often, down to one a second. A
worker whose affinity someone else set (a ``worker_init_fn`` that pins it) is left where it was
put, and so is one that runs on a CPU set other than its loader's.

Where (:func:`should_move`): by default only where each worker can have a CPU of its own beside
the main process; where the workers outnumber the CPUs the scheduler moves them already.

What (:class:`_Evening`, ``MODE = "even"``, the default where the workers count their samples:
map-style, a sample at a time): trading places evens the workers'
speeds out only on average, and the epoch still ends with whichever worker the draw of CPUs
left behind. So each look also reads how many samples each worker has made (a counter in
memory the workers share with the main process, :class:`Tally`) and how fast each CPU made them
(the samples of the worker that stayed on it since the last look, smoothed over looks): the
workers furthest behind in the epoch go to the fastest CPUs, the ones ahead to the slowest.
Those behind catch up; near the end of the epoch the last workers run on the fastest CPUs,
including those that workers done with their share left free. Without counts (an iterable
dataset, ``__getitems__``, workers of a system without ``memfd_create`` that are not forked)
the order turns each look: the workers trade places as above.

``MODE = "swap"`` trades places only (for measurements). ``MODE = "rotate"`` (for
measurements; ``scripts/scaling_costs.py --loader ferry-rotate``) pins instead: worker ``i``
to the ``(i + tick)``-th allowed CPU, the whole assignment shifted one CPU each period, and set
free when the epoch ends. Faster on an idle host (96-97% of the summed rates in the same
measurement) and unsafe on a shared one: two loaders (two ranks on one host)
would pin their workers onto the same CPUs.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing import reduction
from pathlib import Path
from typing import Any

from ferry._core.memory import proc_stat
from ferry._engine.transport.messages import key_length
from ferry._validate import available_cpus

__all__ = ["MODE", "PERIOD_S", "Tally", "WorkerMover", "should_move"]

# How often the workers trade places (as measured: scripts/cpu_speeds.py's nudge period).
PERIOD_S = 0.05
# "even" (the default: those behind to the fastest CPUs, where the workers count their
# samples; else as "swap"), "swap" (trade places among the CPUs held, then set free) or
# "rotate" (pinned).
MODE = "even"
# How much a CPU's speed moves towards each new reading of it (smoothing over looks: a look
# sees a worker make ten or twenty samples of a few ms, whose costs differ).
SPEED_WEIGHT = 0.3


def should_move(option: bool | None, worker_type: str, num_workers: int) -> bool:
    """Whether a loader with these options moves its workers: never with ``False``, thread
    workers, fewer than 2 workers or CPUs, or where the system cannot set another process's
    CPUs (Linux only); with ``True`` otherwise; with ``None`` (ferry decides) only where each
    worker can have a CPU of its own beside the main process (more CPUs than workers). Where
    the workers outnumber the CPUs the scheduler shares the CPUs out among them and moves them
    already; moving them too only costs (2 workers on 2 CPUs: 2-10% fewer batches a second,
    the main thread's CPU a batch 3-10% up, in an A/B on the dev machine)."""
    if option is False or worker_type != "process" or num_workers < 2:
        return False
    cpus, affinity = available_cpus()  # (an affinity: Linux, which can set another's too)
    return affinity and cpus is not None and cpus >= 2 and (option is True or cpus > num_workers)


def _stat(pid: int) -> tuple[int, int]:
    """Process ``pid``'s last CPU and the CPU time it used, in clock ticks (fields 39, 14 and
    15 of /proc/PID/stat); OSError if it is gone."""
    fields = proc_stat(pid)
    if not fields:
        raise ProcessLookupError(f"process {pid} is gone")
    return int(fields[36]), int(fields[11]) + int(fields[12])


def numa_nodes(cpus: frozenset[int]) -> dict[int, int]:
    """Each of ``cpus``' NUMA node (all 0 where the system does not say)."""
    nodes = dict.fromkeys(cpus, 0)
    for node in Path("/sys/devices/system/node").glob("node[0-9]*"):
        try:
            listed = (node / "cpulist").read_text().strip()
        except OSError:
            continue
        for part in filter(None, listed.split(",")):
            first, _, last = part.partition("-")
            for cpu in range(int(first), int(last or first) + 1):
                if cpu in nodes:
                    nodes[cpu] = int(node.name[4:])
    return nodes


class Tally:
    """How many samples each of a loader's process workers has made: a counter a worker, in
    memory the main process shares with its workers (:meth:`new`). A worker adds to its own
    (``counts[worker_id]``); :class:`WorkerMover` reads them all.

    The memory is a ``memfd`` (no name, nothing in /dev/shm, gone with the last process that
    maps it): a forked worker inherits the mapping, and a spawned (or forkserver) one is given
    the descriptor as it starts, as multiprocessing passes descriptors (pickled during the
    start), and maps it. The main process closes its descriptor when the workers stop
    (:meth:`close`); the mapping stays while the workers run. Without ``memfd_create``
    (not Linux), anonymous shared memory, for forked workers only (a spawned one gets None).
    """

    def __init__(self, memory: mmap.mmap, fd: int = -1) -> None:
        self._size = len(memory)
        self.counts = memoryview(memory).cast("q")
        # Samples sent to each worker this epoch, in the main process (see WorkerMover).
        self.sent = [0] * len(self.counts)
        self._fd = fd
        self._closed = weakref.finalize(self, os.close, fd) if fd >= 0 else None

    @classmethod
    def new(cls, workers: int) -> Tally:
        """Counters for ``workers`` workers, all 0."""
        size = 8 * max(workers, 1)
        if not hasattr(os, "memfd_create"):
            return cls(mmap.mmap(-1, size))
        fd = os.memfd_create("ferry-tally", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            memory = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(memory, fd)

    def asked(self, worker_id: int, key: Any) -> None:
        """Worker ``worker_id`` was sent ``key``: its samples are owed (main process only)."""
        self.sent[worker_id] += key_length(key)

    def new_epoch(self) -> None:
        """An epoch begins: nothing is owed yet."""
        self.sent = [0] * len(self.sent)

    def close(self) -> None:
        """No more workers will start: the descriptor is closed (the counts stay mapped)."""
        if self._closed is not None:
            self._closed()

    def __reduce__(self) -> Any:
        if self._closed is None or not self._closed.alive:
            return type(None), ()  # (no descriptor to give: the worker counts nothing)
        return _attach, (reduction.DupFd(self._fd), self._size)


def _attach(fd: Any, size: int) -> Tally:
    """In a spawned worker: the tally whose descriptor ``fd`` the main process passed."""
    own = fd.detach()
    try:
        return Tally(mmap.mmap(own, size))
    finally:
        os.close(own)


class WorkerMover:
    """A thread of the main process that moves the workers ``pids()`` names round their CPUs,
    every ``period_s`` while :meth:`resume` has it run (an epoch), until :meth:`pause` or
    :meth:`close` (see the module docstring). ``progress()``: by pid, the samples each worker
    has made so far and those it was asked for since the epoch began (a :class:`Tally`'s),
    which the "even" mode needs. ``moves``: the
    periods in which workers moved."""

    def __init__(
        self,
        pids: Callable[[], list[int]],
        *,
        progress: Callable[[], dict[int, tuple[int, int]]] | None = None,
        mode: str | None = None,
        period_s: float | None = None,
    ) -> None:
        self._pids = pids
        self._mode = mode or MODE
        if self._mode == "even" and progress is None:
            self._mode = "swap"  # (nothing counts the workers' samples)
        self._evening = _Evening(progress or dict)
        self._period_s = period_s or PERIOD_S
        # The CPUs a worker nobody placed runs on: this process's, which a worker inherits.
        self._free = frozenset(os.sched_getaffinity(0))
        self._nodes = numa_nodes(self._free)
        if self._mode == "rotate" and len(set(self._nodes.values())) > 1:
            self._mode = "swap"  # (rotating over several nodes would move workers off theirs)
        self._rotation = _Rotation(sorted(self._free))
        self._placed_elsewhere: set[int] = set()  # workers someone else placed: left alone
        self._used: dict[int, int] = {}  # each worker's CPU time at the last look
        # Waits between looks: the period while the workers compute, longer while they idle
        # (an epoch left unfinished, a training step slower than the loader), up to 1 s.
        self._delay = self._period_s
        self.moves = 0
        self._active = False
        self._closed = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ferry-move", daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def resume(self) -> None:
        """Move the workers from now on (an epoch begins)."""
        if not self._closed and not self._active:
            self._active = True
            self._delay = self._period_s
            self._evening.begin()
            self._wake.set()

    def pause(self) -> None:
        """Stop moving them (the epoch ended): the thread sleeps until :meth:`resume`."""
        if self._active:
            self._active = False
            self._wake.set()

    def close(self) -> None:
        """End the thread (the workers stop); pinned workers are set free first."""
        self._closed = True
        self._active = False
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(1.0)

    def _run(self) -> None:
        while not self._closed:
            if not self._active:
                self._release()
                self._wake.wait()
                self._wake.clear()
                continue
            if self._wake.wait(self._delay):
                self._wake.clear()
                continue  # (paused or closed: looked at again above)
            try:
                if self._mode == "rotate":
                    busy = self._rotate()
                else:
                    busy = self._even() if self._mode == "even" else self._swap()
            except Exception:  # (never let placement break loading: it stops instead)
                self._closed = True
                break
            self._delay = self._period_s if busy else min(2 * self._delay, 1.0)
        self._release()

    def _ours(self, pid: int, *, pinned_to: int | None = None) -> bool:
        """Whether worker ``pid`` runs where its loader put it (its CPUs are the loader's, or
        the one CPU the mover pinned it to), so that the mover may move it."""
        if pid in self._placed_elsewhere:
            return False
        allowed = os.sched_getaffinity(pid)
        if allowed == self._free or (pinned_to is not None and allowed == {pinned_to}):
            return True
        self._placed_elsewhere.add(pid)
        return False

    def _look(self) -> tuple[dict[int, list[tuple[int, int, int]]], dict[int, set[int]]]:
        """The workers that computed since the last look, by NUMA node: each one's pid, the CPU
        it last ran on and the clock ticks it computed; and the CPUs the idle ones last ran
        on, by node (an idle worker stays put: moving it would give nothing)."""
        busy: dict[int, list[tuple[int, int, int]]] = {}
        idle: dict[int, set[int]] = {}
        used, self._used = self._used, {}
        for pid in self._pids():
            try:
                if not self._ours(pid):
                    continue
                cpu, self._used[pid] = _stat(pid)
            except (OSError, ValueError, IndexError):  # it has just ended
                continue
            node = self._nodes.get(cpu, 0)
            ran = self._used[pid] - used.get(pid, self._used[pid])
            if ran:
                busy.setdefault(node, []).append((pid, cpu, ran))
            else:
                idle.setdefault(node, set()).add(cpu)
        return busy, idle

    def _put(self, pid: int, cpu: int) -> bool:
        """Move worker ``pid`` to ``cpu`` and set it free there; whether it could be."""
        try:
            os.sched_setaffinity(pid, {cpu})
            os.sched_setaffinity(pid, self._free)
        except OSError:  # (it has just ended)
            return False
        return True

    def _swap(self) -> bool:
        """Each worker that computed since the last look to the CPU the next such one (of its
        NUMA node) last ran on, then free; whether any computed."""
        busy, _ = self._look()
        moved = False
        for placed in busy.values():
            cpus = [cpu for _, cpu, _ in placed]
            if len(set(cpus)) < 2:
                continue
            for (pid, _, _), cpu in zip(placed, cpus[1:] + cpus[:1], strict=True):
                moved |= self._put(pid, cpu)
        self.moves += moved
        return bool(busy)

    def _even(self) -> bool:
        """The workers that computed since the last look, those furthest behind in the epoch
        first, each to the fastest CPU left of its node's (theirs and those the idle workers
        left), then free; whether any computed (see :class:`_Evening`)."""
        busy, idle = self._look()
        evening = self._evening
        evening.read(busy)
        moved = False
        for node, placed in busy.items():
            for pid, cpu in evening.assign(placed, idle.get(node, set())):
                moved |= self._put(pid, cpu)
        self.moves += moved
        return bool(busy)

    def _rotate(self) -> bool:
        """Worker ``i`` pinned to CPU ``i + tick`` of the allowed ones."""
        rotation = self._rotation
        rotation.tick += 1
        pids = self._pids()
        if len(pids) < 2:
            return False
        for i, pid in enumerate(pids):
            cpu = rotation.cpus[(i + rotation.tick) % len(rotation.cpus)]
            with contextlib.suppress(OSError):
                if self._ours(pid, pinned_to=rotation.pinned.get(pid)):
                    os.sched_setaffinity(pid, {cpu})
                    rotation.pinned[pid] = cpu
        self.moves += 1
        return True

    def _release(self) -> None:
        """Set the workers the mover pinned free again (rotate)."""
        pinned = self._rotation.pinned
        for pid, cpu in pinned.items():
            with contextlib.suppress(OSError):
                if os.sched_getaffinity(pid) == {cpu}:
                    os.sched_setaffinity(pid, self._free)
        pinned.clear()


class _Rotation:
    """``MODE = "rotate"``'s state: the CPUs in turn, the turn, the CPU each worker was pinned
    to last."""

    __slots__ = ("cpus", "pinned", "tick")

    def __init__(self, cpus: list[int]) -> None:
        self.cpus = cpus
        self.pinned: dict[int, int] = {}
        self.tick = 0


class _Evening:
    """``MODE = "even"``'s state: how fast each CPU made samples (smoothed over looks), where
    each worker was put and what it had made at the last look, and what it had made when the
    epoch began.

    A CPU's speed is read from a worker that computed the whole time since the last look (its
    clock ticks say so) and was still on the CPU it was put on: the samples it made over the
    seconds between the looks. The workers' order: furthest behind first, the most samples
    asked of it this epoch and not made yet (with equal shares, torch's round-robin's, the
    fewest made since the epoch began); CPUs of equal (or unknown)
    speed in an order that turns each look, so that equal workers trade places as in the
    "swap" mode.
    """

    __slots__ = ("at", "began", "last", "owed", "progress", "put", "speeds", "turn")

    TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01

    def __init__(self, progress: Callable[[], dict[int, tuple[int, int]]]) -> None:
        self.progress = progress
        self.owed: dict[int, int] = {}  # samples asked of each worker this epoch, by pid
        self.speeds: dict[int, float] = {}  # samples a second, by CPU
        self.began: dict[int, int] = {}  # samples made when the epoch began, by pid
        self.last: dict[int, int] = {}  # samples made at the last look, by pid
        self.put: dict[int, int] = {}  # the CPU each worker was put on at the last look
        self.at = 0.0  # when the last look was
        self.turn = 0

    def begin(self) -> None:
        """An epoch begins: its counts start from the next look (speeds are kept)."""
        self.began.clear()
        self.last.clear()
        self.put.clear()

    def read(self, busy: dict[int, list[tuple[int, int, int]]]) -> None:
        """Take this look's counts; update the speed of each CPU a worker computed on all the
        while since the last look."""
        progress, now = self.progress(), time.monotonic()
        counts = {pid: made for pid, (made, _) in progress.items()}
        span = now - self.at
        for placed in busy.values():
            for pid, cpu, ran in placed:
                before = self.last.get(pid)
                if before is None or self.put.get(pid) != cpu or ran * self.TICK_S < 0.6 * span:
                    continue
                rate = max(0, counts.get(pid, before) - before) / span
                known = self.speeds.get(cpu)
                self.speeds[cpu] = rate if known is None else known + SPEED_WEIGHT * (rate - known)
        for pid, count in counts.items():
            self.began.setdefault(pid, count)
        self.last, self.at = counts, now
        self.owed = {pid: asked for pid, (_, asked) in progress.items()}
        self.turn += 1

    def assign(self, placed: list[tuple[int, int, int]], spare: set[int]) -> list[tuple[int, int]]:
        """Where the workers ``placed`` (of one node) go: each worker that should move, with
        its CPU. The CPUs: theirs, then ``spare`` (those idle workers left)."""
        behind = sorted(range(len(placed)), key=lambda i: (self._ahead(placed[i][0]), i))
        cpus = sorted({cpu for _, cpu, _ in placed} | spare)
        known = sorted(self.speeds[cpu] for cpu in cpus if cpu in self.speeds)
        neutral = known[len(known) // 2] if known else 0.0
        turn = self.turn
        fastest = sorted(
            range(len(cpus)),
            key=lambda j: (-self.speeds.get(cpus[j], neutral), (j + turn) % len(cpus)),
        )
        moves = []
        for rank, i in enumerate(behind):
            pid, cpu, _ = placed[i]
            to = cpus[fastest[rank]] if rank < len(fastest) else cpu  # (more workers than CPUs)
            self.put[pid] = to
            if to != cpu:
                moves.append((pid, to))
        return moves

    def _made(self, pid: int) -> int:
        """Samples worker ``pid`` made since the epoch began."""
        return self.last.get(pid, 0) - self.began.get(pid, 0)

    def _ahead(self, pid: int) -> int:
        """How far ahead worker ``pid`` is: samples made this epoch less those asked of it."""
        return self._made(pid) - self.owed.get(pid, 0)
