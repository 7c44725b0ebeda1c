"""File descriptors: holding batches costs none, running out is explained, nothing is left.

* Under ``ulimit -n 100`` a loader whose every batch is kept delivers them all, with either
  sharing strategy, and the main process's descriptor count does not grow with the batches held
  (torch's DataLoader runs out in the same setup: the scenario is real).
* A worker out of descriptors fails only the batches it could not share (RuntimeError "Too many
  open files ..." naming the worker); it lives on and later batches arrive.
* The main process out of descriptors ends the iterator with that error (not WorkerDied), and
  the next ``next()`` raises StopIteration; the workers are stopped cleanly.
* ``torch.multiprocessing.set_sharing_strategy("file_system")``: slabs are named files in
  /dev/shm, removed as soon as the main process maps them, and never left behind: not after the
  loader is gone, not after the main process is killed with SIGKILL.
* A full epoch leaves the descriptor count as it was, with either strategy.

Scenarios that lower the hard limit, or kill the main process, run in a subprocess.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import json
import os
import re
import resource
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ferry
from _support import datasets as ds
from _support.processes import exited, open_fds, poll, shared_mapping_of
from ferry._engine.transport import shm
from ferry._engine.transport.slabfile import DescriptorLimitReached
from ferry.errors import WorkerDied

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.skipif(not shm.SLABS_SUPPORTED, reason="no memfd_create on this platform"),
]

STRATEGIES = ("file_descriptor", "file_system")
FORK = {"multiprocessing_context": "fork"}
TESTS = Path(__file__).resolve().parents[1]
SHM = "/dev/shm"


@contextlib.contextmanager
def sharing(strategy: str) -> Iterator[None]:
    """torch's sharing strategy set to ``strategy`` inside the block, put back afterwards."""
    before = torch.multiprocessing.get_sharing_strategy()  # type: ignore[no-untyped-call]
    torch.multiprocessing.set_sharing_strategy(strategy)  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(before)  # type: ignore[no-untyped-call]


@pytest.fixture(params=STRATEGIES)
def strategy(request: pytest.FixtureRequest) -> Iterator[str]:
    """torch's sharing strategy for the test, put back afterwards."""
    with sharing(request.param):
        yield request.param


def names_of(pid: int) -> list[str]:
    """Slab files made for main process ``pid`` that are still in /dev/shm."""
    return sorted(glob.glob(os.path.join(SHM, f"ferry-{pid}-*")))


def run_script(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


def check_guidance(message: str) -> None:
    """The error says what happened and what to do."""
    assert message.startswith("Too many open files"), message
    for words in ("RLIMIT_NOFILE", "ulimit -n", "set_sharing_strategy('file_system')", "slab"):
        assert words in message, (words, message)


# -- holding every batch under ulimit -n 100 ----------------------------------------------------

HOLD_EVERY_BATCH = """
    import glob, json, os, resource, sys
    import torch

    class Full:
        def __len__(self):
            return 600

        def __getitem__(self, index):
            return torch.full((256,), index)

    def fds():
        return len(os.listdir("/proc/self/fd"))

    if __name__ == "__main__":
        library, strategy = sys.argv[1], sys.argv[2]
        resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))
        torch.multiprocessing.set_sharing_strategy(strategy)
        if library == "torch":
            from torch.utils.data import DataLoader
        else:
            from ferry import DataLoader
        loader = DataLoader(Full(), batch_size=2, num_workers=2, multiprocessing_context="fork")
        held, report = [], {"error": None}
        try:
            for batch in loader:
                held.append(batch)
                if len(held) == 20:
                    report["fds_at_20"] = fds()
                if len(held) == 300:
                    report["fds_at_300"] = fds()
                    report["names_at_300"] = glob.glob(f"/dev/shm/ferry-{os.getpid()}-*")
        except Exception as exc:
            report["error"] = [type(exc).__name__, str(exc)]
        report["batches"] = len(held)
        report["correct"] = all(
            torch.equal(batch, torch.stack([torch.full((256,), 2 * k + j) for j in (0, 1)]))
            for k, batch in enumerate(held)
        )
        report["names_at_end"] = glob.glob(f"/dev/shm/ferry-{os.getpid()}-*")
        print(json.dumps(report))
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sharing_strategy", STRATEGIES)
def test_holding_every_batch_under_a_low_descriptor_limit(sharing_strategy: str) -> None:
    result = run_script(HOLD_EVERY_BATCH, "ferry", sharing_strategy)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["error"] is None, report["error"]
    assert report["batches"] == 300
    assert report["correct"]
    # 300 batches held cost no more descriptors than 20 did.
    assert report["fds_at_300"] <= report["fds_at_20"], report
    assert report["fds_at_300"] < 50, report
    assert report["names_at_300"] == [], report
    assert report["names_at_end"] == [], report


@pytest.mark.timeout(90)
def test_torch_runs_out_holding_every_batch() -> None:
    """The same setup with torch's DataLoader (default strategy) runs out of descriptors: the
    scenario above is one torch cannot do."""
    result = run_script(HOLD_EVERY_BATCH, "torch", "file_descriptor")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["error"] is not None, report
    kind, message = report["error"]
    assert kind == "RuntimeError", report["error"]
    assert "Too many open files" in message, message
    assert report["batches"] < 300


# -- a worker out of descriptors ----------------------------------------------------------------

HOARD: list[Any] = []
"""Descriptors :func:`hoard_descriptors` keeps open (in the worker process that ran it)."""


def hoard_descriptors(worker_id: int) -> None:
    """A worker_init_fn that uses up the worker's descriptors (its soft limit lowered first,
    so that this is quick whatever ``ulimit -n`` the tests run under)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = len(os.listdir("/proc/self/fd")) + 32
    if soft == resource.RLIM_INFINITY or soft > low:
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    with contextlib.suppress(OSError):
        while True:
            HOARD.append(open(os.devnull))  # noqa: SIM115 (kept open on purpose)


class ReleasesAt:
    """Map-style: ``torch.full((4,), index)``; fetching ``release`` closes :data:`HOARD`."""

    def __init__(self, n: int, release: int) -> None:
        self.n = n
        self.release = release

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.release:
            while HOARD:
                HOARD.pop().close()
        return torch.full((4,), index)


@pytest.mark.timeout(60)
def test_worker_out_of_descriptors_fails_only_those_batches(strategy: str) -> None:
    loader = ferry.DataLoader(
        ReleasesAt(8, release=4),
        batch_size=1,
        num_workers=1,
        worker_init_fn=hoard_descriptors,
        **FORK,
    )
    iterator = iter(loader)
    worker = iterator._workers[0]
    for index in range(4):
        with pytest.raises(RuntimeError, match="Too many open files") as caught:
            next(iterator)
        error = caught.value
        assert isinstance(error, DescriptorLimitReached)
        check_guidance(str(error))
        assert "worker" in str(error), str(error)
        assert re.search(r"limit \d+", str(error)), str(error)
        text = notes(error)
        assert re.search(rf"worker (process )?0 \(pid {worker.pid}\)", text), text
        assert f"[{index}]" in text, text
        assert worker.is_alive()
    # Index 4 closes the hoard: from there on, the worker shares its batches again.
    assert [b.tolist() for b in iterator] == [[[i] * 4] for i in range(4, 8)]
    worker.join(5)
    assert worker.exitcode == 0
    assert names_of(os.getpid()) == []


# -- the main process out of descriptors ----------------------------------------------------------


class Full:
    """Map-style: ``torch.full((256,), index)``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((256,), index)


@contextlib.contextmanager
def out_of_descriptors() -> Iterator[int]:
    """This process has no descriptor left (its soft limit lowered, then filled up with
    /dev/null); gives the limit. Everything is given back on leaving, whatever happened."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hoard = []
    try:
        limit = min(soft, open_fds() + 32)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        with contextlib.suppress(OSError):
            while True:
                hoard.append(open(os.devnull))  # noqa: SIM115 (kept open on purpose)
        yield limit
    finally:
        for file in hoard:
            file.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.timeout(60)
def test_main_process_out_of_descriptors_ends_the_iterator(strategy: str) -> None:
    loader = ferry.DataLoader(Full(40), batch_size=2, num_workers=2, **FORK)
    iterator = iter(loader)
    errors = []
    with out_of_descriptors() as limit:
        for _ in range(2):
            try:
                next(iterator)
            except Exception as exc:  # checked below, once descriptors are back
                errors.append(exc)
    assert len(errors) == 2, errors
    first, second = errors
    assert not isinstance(first, WorkerDied), first
    assert isinstance(first, RuntimeError)
    assert isinstance(first, DescriptorLimitReached)
    check_guidance(str(first))
    assert "main process" in str(first), str(first)
    assert f"limit {limit}" in str(first), str(first)
    # The iterator is over (also with descriptors back): StopIteration, not the error again.
    assert type(second) is StopIteration
    with pytest.raises(StopIteration):
        next(iterator)
    # The workers were stopped, not killed.
    for worker in iterator._workers:
        worker.join(5)
    assert [(w.is_alive(), w.exitcode) for w in iterator._workers] == [(False, 0)] * 2
    assert poll(lambda: names_of(os.getpid()) == [], 5.0), names_of(os.getpid())


# -- file_system: names in /dev/shm ---------------------------------------------------------------


def mapped_file(tensor: torch.Tensor) -> str:
    """The file this process maps ``tensor``'s memory from."""
    mapping = shared_mapping_of(tensor.data_ptr())
    assert mapping is not None
    return mapping[1]


@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm")
def test_named_slabs_are_removed_once_mapped() -> None:
    """With ``file_system`` (read when the workers start) the batches live in named /dev/shm
    files, whose names are removed as soon as the main process has mapped them; nothing is
    left after the loader is gone."""
    loader = ferry.DataLoader(Full(64), batch_size=4, num_workers=2, **FORK)
    with sharing("file_system"):
        iterator = iter(loader)
    # The strategy is back to what it was: the running workers keep the one they started with.
    held = []
    for batch in iterator:
        held.append(batch)
        path = mapped_file(batch)
        # A named file of this process's loader, already unlinked.
        assert path.startswith(f"{SHM}/ferry-{os.getpid()}-"), path
        assert path.endswith("(deleted)"), path
    assert len(held) == 16
    assert names_of(os.getpid()) == []  # held batches keep no name
    for k, batch in enumerate(held):
        assert torch.equal(batch, torch.stack([Full(64)[4 * k + j] for j in range(4)]))
    del iterator, held, batch
    assert names_of(os.getpid()) == []
    # Under the default strategy the same loader's slabs have no name at all.
    batch = next(iter(loader))
    assert not mapped_file(batch).startswith(SHM), mapped_file(batch)


def made_names(pid: int, worker: int) -> bool:
    return any(f"-{worker}-" in name for name in names_of(pid))


@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm")
@pytest.mark.parametrize("how", ["dropped", "worker killed"])
def test_unread_named_slabs_are_removed(how: str) -> None:
    """Named slabs the main process never opened are removed when the iterator is dropped: by
    each worker as it exits, and by the main process for a worker that died (SIGKILL) and
    could not."""
    with sharing("file_system"):
        iterator = iter(
            ferry.DataLoader(ds.Blocks(64, (1 << 14,)), batch_size=4, num_workers=2, **FORK)
        )
    pids = [worker.pid for worker in iterator._workers]
    assert poll(lambda: all(made_names(os.getpid(), pid) for pid in pids), 10.0), names_of(
        os.getpid()
    )
    if how == "worker killed":
        os.kill(pids[1], signal.SIGKILL)
        assert poll(lambda: exited(pids[1]), 5.0)
        assert made_names(os.getpid(), pids[1])  # left by the dead worker
    del iterator
    gc.collect()
    assert poll(lambda: names_of(os.getpid()) == [], 5.0), names_of(os.getpid())


KILLED_MAIN = """
    import glob, json, multiprocessing, os, signal, sys, time
    import torch
    import ferry

    sys.path.insert(0, sys.argv[2])
    from _support.datasets import Blocks  # importable: forkserver workers unpickle it

    if __name__ == "__main__":
        multiprocessing.set_forkserver_preload(["torch", "ferry", "_support.datasets"])
        torch.multiprocessing.set_sharing_strategy("file_system")
        iterator = iter(ferry.DataLoader(
            Blocks(64, (1 << 16,)), batch_size=4, num_workers=2,
            multiprocessing_context=sys.argv[1],
        ))
        pids = [worker.pid for worker in iterator._workers]
        pattern = f"/dev/shm/ferry-{os.getpid()}-*"
        # Not reading: the workers make named slabs that this process never opens.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            names = glob.glob(pattern)
            if all(any(f"-{pid}-" in name for name in names) for pid in pids):
                break
            time.sleep(0.05)
        time.sleep(0.2)
        print(json.dumps({"pid": os.getpid(), "workers": pids, "names": glob.glob(pattern)}))
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm")
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_sigkill_of_the_main_process_leaves_no_name(method: str) -> None:
    result = run_script(KILLED_MAIN, method, str(TESTS))
    assert result.returncode == -signal.SIGKILL, (result.returncode, result.stderr)
    report = json.loads(result.stdout)
    pid, workers = report["pid"], report["workers"]
    try:
        # The scenario: each worker had made slabs the main process never mapped.
        for worker in workers:
            assert any(f"ferry-{pid}-{worker}-" in name for name in report["names"]), report

        def clean() -> bool:
            return not names_of(pid) and all(exited(worker) for worker in workers)

        assert poll(clean, 5.0, interval=0.05), (
            names_of(pid),
            [worker for worker in workers if not exited(worker)],
        )
    finally:
        for worker in workers:  # the workers of the killed process, if the test failed
            if not exited(worker):
                with contextlib.suppress(OSError):
                    os.kill(worker, signal.SIGKILL)
        for name in names_of(pid):
            with contextlib.suppress(OSError):
                os.unlink(name)


# -- no descriptor leak ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_epochs_leave_no_descriptor(strategy: str) -> None:
    def epoch() -> list[torch.Tensor]:
        loader = ferry.DataLoader(Full(48), batch_size=4, num_workers=2, **FORK)
        return list(loader)

    epoch()  # one-time set-up (imports, caches) is not a leak
    fds = open_fds()
    for _ in range(3):
        held = epoch()
        assert len(held) == 12
        assert torch.equal(held[-1][-1], torch.full((256,), 47))
    del held
    assert poll(lambda: open_fds() <= fds, 2.0), (open_fds(), fds, os.listdir("/proc/self/fd"))
    assert names_of(os.getpid()) == []
