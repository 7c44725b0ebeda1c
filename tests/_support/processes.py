"""Worker kinds, the process tree, polling, cleanup: for every test that starts workers.

Worker processes are found from ``/proc`` (no psutil): :func:`descendants` lists every process
below this one, zombies included, except multiprocessing's own long-lived helpers (the
forkserver and the resource tracker), whose children (forkserver-started workers) are listed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

FAST = ("fork", "thread")
"""Worker kinds that start in milliseconds: the broad matrix runs on these."""
PROCESSES = ("fork", "forkserver")
"""Process workers forked with the main process's memory, and ones that unpickle their
arguments in a process of their own (a forkserver's child). A spawned worker runs the same
code as the latter behind a start of its own interpreter (3 s of CPU here, to import torch):
the tests whose point is spawn itself (its slow start, its import of the main module, a
Ctrl-C or a kill while it starts, torch's order with it) name it; a matrix over kinds does
not repeat it."""
ALL = ("fork", "spawn", "forkserver", "thread")

_HELPERS = (
    "multiprocessing.forkserver import main",
    "multiprocessing.resource_tracker import main",
)


@dataclasses.dataclass(frozen=True)
class Kind:
    """One way of running workers: a process start method, or ``"thread"``."""

    name: str

    @property
    def threads(self) -> bool:
        return self.name == "thread"

    @property
    def kwargs(self) -> dict[str, Any]:
        """The DataLoader keyword arguments that select this kind of worker."""
        if self.threads:
            return {"worker_type": "thread"}
        return {"multiprocessing_context": self.name}

    def __str__(self) -> str:
        return self.name


def poll(condition: Callable[[], bool], timeout: float, interval: float = 0.005) -> bool:
    """Whether ``condition()`` became true within ``timeout`` seconds (checked until then)."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


# -- the process tree ---------------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of ``pid``, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            data = file.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[1]), fields[0].decode()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _is_helper(pid: int, parent: int) -> bool:
    command = _cmdline(pid)
    return any(m in command and m not in _cmdline(parent) for m in _HELPERS)


def descendants(root: int | None = None) -> set[int]:
    """Every process below ``root`` (default: this one), zombies included, but not
    multiprocessing's forkserver and resource tracker themselves."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = collections.defaultdict(list)
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None:
                children[stat[0]].append(int(name))
    found: set[int] = set()
    stack = [root]
    while stack:
        parent = stack.pop()
        for child in children.get(parent, ()):
            stack.append(child)
            if not _is_helper(child, parent):
                found.add(child)
    return found


def reaped(pid: int) -> bool:
    """The process is gone from the process table (exited and collected by its parent)."""
    return _stat(pid) is None


def exited(pid: int) -> bool:
    """The process has exited (a zombie nobody collected yet counts as exited)."""
    stat = _stat(pid)
    return stat is None or stat[1] in "ZX"


def kill_all(pids: Iterable[int]) -> None:
    """SIGKILL ``pids`` and collect those that are this process's children."""
    pids = list(pids)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.waitpid(pid, 0)


def ferry_threads() -> set[threading.Thread]:
    """Live thread workers, pin threads and CPU movers of ferry loaders in this process."""
    return {
        t
        for t in threading.enumerate()
        if t.name.startswith("ferry-worker-") or t.name in ("ferry-pin", "ferry-move")
    }


def worker_pids(iterator: Any) -> list[int]:
    """The pids of a process-worker iterator's workers, by worker id."""
    return [worker.pid for worker in iterator._workers]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def shared_mapping_of(address: int) -> tuple[str, str] | None:
    """(permissions, path) of this process's memory mapping holding ``address``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= address < end:
                return parts[1], parts[5].strip() if len(parts) > 5 else ""
    return None
