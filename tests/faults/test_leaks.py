"""A hundred iterators made and dropped leave nothing behind: no process, thread, file
descriptor or /dev/shm entry."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import ferry
from _support import datasets as ds
from _support.processes import FAST, Kind, descendants, open_fds, poll

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# 25 of each way to leave an iterator. The counts after them must be those before, so a leak of
# one item in any way shows after its first cycle; a leak that only a rare race makes is what
# the no_leftovers fixture looks for after each of the suite's thousands of worker tests.
CYCLES = 100
TESTS = Path(__file__).resolve().parents[1]


def one_cycle(kind: Kind, number: int) -> None:
    """Make an iterator and leave it in one of four ways."""
    loader = ferry.DataLoader(ds.Indices(6), batch_size=2, num_workers=1, **kind.kwargs)
    way = number % 4
    if way == 0:
        assert len(list(loader)) == 3
    elif way == 1:
        iterator = iter(loader)
        next(iterator)
        del iterator
    elif way == 2:
        iterator = iter(loader)
        del iterator
    else:
        for _ in loader:
            break


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def ours(entries: set[str], pids: set[int]) -> set[str]:
    """Entries that name one of the processes involved: ferry's names begin with the main
    process's pid (``ferry-{pid}-{worker pid}-...``), others' (torch's) carry theirs. /dev/shm
    is shared with every other process of the machine, ferry's in the other pytest-xdist
    process included."""
    names = {str(pid) for pid in pids}
    return {e for e in entries if names & set(re.findall(r"\d+", e))}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_create_and_destroy_iterators(kind: Kind) -> None:
    one_cycle(kind, 0)  # one-time set-up (imports, caches) is not a leak
    processes = descendants()
    threads = threading.active_count()
    fds = open_fds()
    shm = shm_entries()
    seen = {os.getpid()}
    for number in range(CYCLES):
        one_cycle(kind, number)
        if number % 25 == 0:
            seen |= descendants()
    assert poll(lambda: not (descendants() - processes), 2.0), descendants() - processes
    assert poll(lambda: threading.active_count() <= threads, 2.0), threading.enumerate()
    assert poll(lambda: open_fds() <= fds, 2.0), (open_fds(), fds, os.listdir("/proc/self/fd"))
    assert not ours(shm_entries() - shm, seen)


@pytest.mark.timeout(60)
def test_tensor_dataset_epoch_leaves_no_thread_or_descriptor() -> None:
    """In a fresh interpreter: epochs over a TensorDataset with process workers leave the main
    process with the threads and descriptors it had (the loader starts no helper of its own
    that outlives it)."""
    script = textwrap.dedent(
        """
        import json, os, threading
        import torch
        import ferry

        if __name__ == "__main__":
            dataset = ferry.TensorDataset(torch.arange(40.0), torch.arange(40))
            before = (threading.active_count(), len(os.listdir("/proc/self/fd")))
            for _ in range(2):
                loader = ferry.DataLoader(
                    dataset, batch_size=4, shuffle=True, num_workers=2,
                    multiprocessing_context="fork",
                )
                assert len(list(loader)) == 10
            del loader
            print(json.dumps({
                "before": before,
                "after": (threading.active_count(), len(os.listdir("/proc/self/fd"))),
                "threads": [t.name for t in threading.enumerate()],
            }))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=50, check=False
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["after"] == report["before"], report
