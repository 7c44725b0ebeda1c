"""However the training loop ends (break, the iterator dropped, an exception, Ctrl-C), every
worker is gone within two seconds; when the main process is killed, its workers exit by
themselves. A reaped process disappears from /proc; a zombie counts as still there."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ferry
from _support import datasets as ds
from _support.processes import FAST, Kind, descendants, exited, ferry_threads, poll, reaped

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

GONE = 2.0
"""Seconds within which every worker must be gone once the loop is left."""

TESTS = Path(__file__).resolve().parents[1]


class Workers:
    """The workers a loop started, found while it runs: processes below this one, or ferry's
    worker threads."""

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self.processes_before = descendants()
        self.threads_before = ferry_threads()
        self.pids: set[int] = set()
        self.threads: set[threading.Thread] = set()

    def record(self) -> None:
        self.pids |= descendants() - self.processes_before
        self.threads |= ferry_threads() - self.threads_before
        assert self.pids or self.threads, "no worker found"

    def gone(self) -> bool:
        return all(reaped(p) for p in self.pids) and not any(t.is_alive() for t in self.threads)

    def assert_gone_within(self, seconds: float, since: float) -> None:
        assert poll(self.gone, seconds - (time.monotonic() - since)), (
            f"still there {time.monotonic() - since:.2f} s later: "
            f"{sorted(p for p in self.pids if not reaped(p))} "
            f"{sorted(t.name for t in self.threads if t.is_alive())}"
        )


def busy_loader(kind: Kind, **kwargs: Any) -> ferry.DataLoader[Any]:
    """Workers that are mid-fetch (0.05 s a sample) with more queued, when the loop ends."""
    return ferry.DataLoader(ds.Slow(200, 0.05), num_workers=2, **kind.kwargs, **kwargs)


def loop_with_break(loader: Any, workers: Workers) -> None:
    for position, _ in enumerate(loader):
        workers.record()
        if position == 2:
            break


def loop_dropping_iterator(loader: Any, workers: Workers) -> None:
    iterator = iter(loader)
    next(iterator)
    workers.record()
    del iterator


def loop_raising(loader: Any, workers: Workers) -> None:
    for position, _ in enumerate(loader):
        workers.record()
        if position == 1:
            raise ValueError("the training step failed")


def loop_interrupted(loader: Any, workers: Workers) -> None:
    for position, _ in enumerate(loader):
        workers.record()
        if position == 1:
            raise KeyboardInterrupt


LOOPS: dict[str, tuple[Callable[[Any, Workers], None], type[BaseException] | None]] = {
    "break": (loop_with_break, None),
    "del": (loop_dropping_iterator, None),
    "exception": (loop_raising, ValueError),
    "keyboard-interrupt": (loop_interrupted, KeyboardInterrupt),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
@pytest.mark.parametrize("how", list(LOOPS))
def test_workers_gone_when_the_loop_ends(kind: Kind, how: str) -> None:
    loop, raises = LOOPS[how]
    workers = Workers(kind)
    if raises is None:
        loop(busy_loader(kind), workers)
    else:
        with pytest.raises(raises):
            loop(busy_loader(kind), workers)
    workers.assert_gone_within(GONE, time.monotonic())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["spawn"], indirect=True)
def test_workers_gone_after_break_spawn(kind: Kind) -> None:
    workers = Workers(kind)
    loop_with_break(busy_loader(kind), workers)
    workers.assert_gone_within(GONE, time.monotonic())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_workers_gone_after_real_ctrl_c(kind: Kind) -> None:
    """SIGINT arrives while the loop waits for a batch: KeyboardInterrupt in the loop, and the
    workers go."""
    workers = Workers(kind)
    loader = ferry.DataLoader(ds.Slow(100, 0.3), num_workers=2, **kind.kwargs)
    timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT))

    def train() -> None:
        for position, _ in enumerate(loader):
            workers.record()
            if position == 1:
                timer.start()

    with pytest.raises(KeyboardInterrupt):
        train()
    timer.join()
    workers.assert_gone_within(GONE, time.monotonic())


@pytest.mark.timeout(60)
def test_workers_ignore_sigint() -> None:
    """Ctrl-C in a terminal reaches every process of the group; workers leave it to the main
    process, which may catch it and go on."""
    loader = ferry.DataLoader(ds.Slow(12, 0.02), num_workers=2, multiprocessing_context="fork")
    iterator = iter(loader)
    got = [next(iterator).tolist()]
    for pid in [w.pid for w in iterator._workers]:
        os.kill(pid, signal.SIGINT)
    got.extend(b.tolist() for b in iterator)
    assert got == [[i] for i in range(12)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_ignore_sigint_while_they_start(method: str) -> None:
    """A Ctrl-C that reaches a worker before its entry function runs (still in multiprocessing's
    start-up: under spawn, the interpreter's) is dropped too; it used to kill the worker, and the
    loader then raised WorkerDied."""
    loader = ferry.DataLoader(ds.Indices(8), num_workers=2, multiprocessing_context=method)
    iterator = iter(loader)
    for pid in [w.pid for w in iterator._workers]:
        os.kill(pid, signal.SIGINT)
    assert [b.tolist() for b in iterator] == [[i] for i in range(8)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_workers_gone_when_stuck_sending_large_batches(kind: Kind) -> None:
    """Batches of 4 MB of bytes (pickled through the pipe, no shared memory) fill the pipe: the
    workers are blocked writing when the loop breaks, and must still go."""
    workers = Workers(kind)
    loader = ferry.DataLoader(ds.BigBytes(40, 1 << 21), batch_size=2, num_workers=2, **kind.kwargs)
    for _ in loader:
        workers.record()
        break
    workers.assert_gone_within(GONE, time.monotonic())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_persistent_workers_gone_when_the_loader_is_dropped(kind: Kind) -> None:
    """Persistent workers live as long as their loader: dropping the loader stops them at
    once (as in torch), without waiting for a garbage collection pass."""
    workers = Workers(kind)
    loader = ferry.DataLoader(
        ds.Indices(10), batch_size=2, num_workers=2, persistent_workers=True, **kind.kwargs
    )
    for _ in range(2):
        for _ in loader:
            workers.record()
    gc.disable()
    try:
        del loader
        workers.assert_gone_within(GONE, time.monotonic())
    finally:
        gc.enable()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_epoch_end_stops_workers(kind: Kind) -> None:
    """Non-persistent workers stop when the epoch ends, even while the iterator is still held."""
    workers = Workers(kind)
    iterator = iter(ferry.DataLoader(ds.Indices(6), num_workers=2, **kind.kwargs))
    for _ in iterator:
        workers.record()
    workers.assert_gone_within(GONE, time.monotonic())
    assert list(iterator) == []


@pytest.mark.timeout(60)
def test_thread_workers_stop_after_their_current_fetch() -> None:
    """Thread workers cannot be interrupted, but once told to stop they finish only the fetch
    they are in: batches queued for them are not made (that would be work for nothing, and
    keep the threads alive long after the loop)."""
    marks = torch.zeros(10, dtype=torch.uint8)
    flag = torch.zeros(1, dtype=torch.uint8)
    loader = ferry.DataLoader(
        ds.Gate(marks, flag, open_below=1), num_workers=2, prefetch_factor=2, worker_type="thread"
    )
    workers = Workers(Kind("thread"))
    for _ in loader:
        workers.record()
        # Worker 1 is in index 1, worker 0 in index 2; indices 3 and 4 wait in their queues.
        assert poll(lambda: bool(marks[:3].all()), 5.0)
        break
    flag[0] = 1
    workers.assert_gone_within(GONE, time.monotonic())
    assert marks.nonzero().flatten().tolist() == [0, 1, 2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_two_iterators_of_one_loader_at_once(kind: Kind) -> None:
    """As in torch, each iterator has its own workers; neither disturbs the other, and both
    sets of workers go."""
    workers = Workers(kind)
    loader = ferry.DataLoader(ds.Indices(9), batch_size=2, num_workers=2, **kind.kwargs)
    pairs = []
    for a, b in zip(loader, loader, strict=True):
        workers.record()
        pairs.append((a.tolist(), b.tolist()))
    assert pairs == [
        ([0, 1], [0, 1]),
        ([2, 3], [2, 3]),
        ([4, 5], [4, 5]),
        ([6, 7], [6, 7]),
        ([8], [8]),
    ]
    if not kind.threads:
        assert len(workers.pids) == 4
    workers.assert_gone_within(GONE, time.monotonic())


@pytest.mark.timeout(60)
def test_forked_child_does_not_stop_the_parents_workers() -> None:
    """A process forked from the training process (a user's own multiprocessing) inherits the
    iterator; dropping it there must not stop the parent's workers."""
    loader = ferry.DataLoader(ds.Indices(8), num_workers=2, multiprocessing_context="fork")
    iterator = iter(loader)
    got = [next(iterator).tolist()]
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        try:
            del iterator
            gc.collect()
        finally:
            os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    got.extend(b.tolist() for b in iterator)
    assert got == [[i] for i in range(8)]


# -- the main process killed ----------------------------------------------------------------------


def orphan_script(method: str) -> str:
    return f"""
import json, os, sys, time
import ferry
from _support import datasets as ds

if __name__ == "__main__":
    # Worker 0 gets index 0 then 2 (blocks); worker 1 gets index 1 and then has nothing to do.
    loader = ferry.DataLoader(
        ds.Blocking(3, block_from=2), num_workers=2, multiprocessing_context={method!r}
    )
    iterator = iter(loader)
    assert next(iterator).tolist() == [0]
    assert next(iterator).tolist() == [1]
    print(json.dumps([w.pid for w in iterator._workers]), flush=True)
    time.sleep(120)
"""


@pytest.fixture
def orphan_main(
    tmp_path: Path,
) -> Iterator[Callable[[str], tuple[subprocess.Popen[str], list[int]]]]:
    started: list[subprocess.Popen[str]] = []
    worker_pids: list[int] = []

    def start(method: str) -> tuple[subprocess.Popen[str], list[int]]:
        script = tmp_path / "orphan_main.py"
        script.write_text(orphan_script(method))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        }
        process = subprocess.Popen(
            [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env
        )
        started.append(process)
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line, f"the main process ended early with code {process.wait()}"
        worker_pids.extend(json.loads(line))
        return process, worker_pids

    yield start
    for process in started:
        process.kill()
        process.wait()
        if process.stdout is not None:  # (else a ResourceWarning: unclosed file)
            process.stdout.close()
    for pid in worker_pids:
        if not exited(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_exit_when_the_main_process_is_killed(
    method: str, orphan_main: Callable[[str], tuple[subprocess.Popen[str], list[int]]]
) -> None:
    main, pids = orphan_main(method)
    assert len(pids) == 2
    assert not any(exited(p) for p in pids)
    main.kill()
    main.wait()
    killed = time.monotonic()
    # Reparented workers may stay zombies if the new parent does not collect them: exited.
    assert poll(lambda: all(exited(p) for p in pids), 5.0), [p for p in pids if not exited(p)]
    assert time.monotonic() - killed < 5.0


TORCH_AT_EXIT = """
import sys, time, torch, ferry

class InTorch(torch.utils.data.Dataset):
    # Sample 1 spends {seconds} s in torch operations, which let go of the GIL while they run.
    def __len__(self):
        return 4

    def __getitem__(self, index):
        if index == 1:
            a, end = torch.randn(600, 600), time.monotonic() + {seconds}
            while time.monotonic() < end:
                a = (a @ a).clamp_(-1, 1)
        return index

loader = ferry.DataLoader(
    InTorch(), num_workers=1, worker_type="thread", timeout={timeout},
    persistent_workers={persistent},
)
{ending}
"""

ENDINGS = {
    # the program ends with the worker's error, raised from the loop
    "error": "for batch in loader:\n    pass",
    # the program leaves the loop and ends on its own
    "break": "for batch in loader:\n    break\ndel batch\nprint('done', flush=True)",
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("ending", "persistent"),
    [("break", False), ("break", True), ("error", False)],
    ids=["break-fresh", "break-persistent", "error-fresh"],
)
def test_a_thread_worker_inside_torch_at_exit_does_not_abort_the_process(
    ending: str, persistent: bool, tmp_path: Path
) -> None:
    """The program ends while a thread worker is inside torch operations that let go of the
    GIL: a daemon thread that takes the GIL back while the interpreter finalizes unwinds
    through torch's C++ frames, and the process aborts ("terminate called without an active
    exception", SIGABRT). The exit waits for the fetch (at most 5 s), whether or not the
    loader that started the worker is still held: the process ends with its own status."""
    script = tmp_path / "torch_at_exit.py"
    script.write_text(
        TORCH_AT_EXIT.format(
            seconds=2,
            persistent=persistent,
            ending=ENDINGS[ending],
            # (the error: the loader's timeout, at sample 1; the first batch comes in time even on
            # a loaded machine where no timeout is set)
            timeout=0.3 if ending == "error" else 0,
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=40
    )
    assert "terminate called" not in done.stderr
    if ending == "error":
        assert done.returncode == 1, done.stderr
        assert "WorkerTimeout" in done.stderr
    else:
        assert done.returncode == 0, done.stderr
        assert done.stdout == "done\n"
