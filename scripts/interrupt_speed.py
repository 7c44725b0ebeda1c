"""How fast Ctrl-C ends a training process whose workers are mid-fetch, torch beside ferry.

Each run starts a fresh interpreter (its own session, so its process group is its own) that
iterates a map-style dataset whose every sample takes ``--seconds`` (a ``time.sleep`` or a CPU
busy loop), batch size 1, two workers. Once the first batch is in, both workers are inside a
fetch; after ``--delay`` seconds the script sends SIGINT to the main process, or to the whole
process group as a terminal's Ctrl-C does, and times how long the process takes to exit. The
median over ``--reps`` runs is printed, per setting.

Each run is also checked for what it should leave behind, which is nothing: worker processes
still alive when the main process exited (this script is their subreaper, so it sees them and
kills them afterwards), names in ``/dev/shm`` made by the process or its workers (run it with
``--strategy file_system`` for those), and an exit other than Python's own for an uncaught
KeyboardInterrupt (killed by SIGINT, a ``KeyboardInterrupt`` traceback on stderr).

    .venv/bin/python scripts/interrupt_speed.py --reps 5
    .venv/bin/python scripts/interrupt_speed.py --reps 5 --strategy file_system --where body

``--src DIR`` imports ferry from ``DIR`` (a worktree's ``src``), for an A/B of two commits.
``--pin`` sets ``pin_memory=True``; without an accelerator, ferry's pin thread copies each
batch instead (as in ``scripts/pin_standin.py``) and torch's pins nothing.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

_CHILD = """
import json, multiprocessing, os, sys, time
import torch

lib, workers, work, strategy, seconds, where, options = sys.argv[1:8]
seconds = float(seconds)
if lib == "torch":
    from torch.utils.data import DataLoader
else:
    from ferry import DataLoader
    if "pin" in options:  # a stand-in copy where no accelerator is (see pin_standin.py)
        import ferry.loader, ferry._engine.transport.pin as pin
        ferry.loader.accelerator_available = lambda: True
        pin._pin_tensor = lambda tensor, device: tensor.clone()
if strategy:
    torch.multiprocessing.set_sharing_strategy(strategy)


class Slow:
    def __len__(self):
        return 100

    def __getitem__(self, index):
        if work == "busy":
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(seconds)
        return torch.full((1024,), index)


if __name__ == "__main__":
    kwargs = {"num_workers": 0 if workers == "none" else 2}
    if workers == "thread":
        kwargs["worker_type"] = "thread"
    if "persistent" in options and workers != "none":
        kwargs["persistent_workers"] = True
    if "pin" in options:
        kwargs["pin_memory"] = True
    for position, batch in enumerate(DataLoader(Slow(), batch_size=1, **kwargs)):
        if position == 0:
            pids = [child.pid for child in multiprocessing.active_children()]
            print(json.dumps(pids), flush=True)
            if where == "body":  # Ctrl-C in the training step, not while waiting for a batch
                time.sleep(60)
"""

# Python's exit for an uncaught KeyboardInterrupt: it re-raises SIGINT on itself.
_KEYBOARD_INTERRUPT_EXIT = -signal.SIGINT
_PR_SET_CHILD_SUBREAPER = 36


@dataclass
class Result:
    seconds: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def become_subreaper() -> None:
    """Orphaned workers become this process's children, so their end can be seen and reaped."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit("cannot become a child subreaper (prctl)")


def alive(pid: int) -> bool:
    """Whether ``pid`` (a child of this script by now, or of its child) is still running;
    reaps it if it has ended."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not ours (yet): look it up
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    return done == 0


def shm_names(pids: list[int]) -> list[str]:
    """Names in /dev/shm that carry one of ``pids`` (ferry's ``ferry-<main>-<worker>-*``,
    torch's ``torch_<pid>_*``)."""
    wanted = {str(pid) for pid in pids}
    names = []
    for name in os.listdir("/dev/shm"):
        parts = name.replace("_", "-").split("-")
        if wanted.intersection(parts):
            names.append(name)
    return names


def one_run(
    script: str, lib: str, setting: tuple[str, str, str], args: argparse.Namespace
) -> tuple[float, list[str]]:
    """Seconds from SIGINT to the process's exit, and what went wrong."""
    workers, work, target = setting
    options = ",".join(o for o in ("persistent", "pin") if getattr(args, o))
    argv = [lib, workers, work, args.strategy, str(args.seconds), args.where, options]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(args.src)} if args.src else None
    process = subprocess.Popen(
        [sys.executable, script, *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    problems: list[str] = []
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line:
            _, err = process.communicate(timeout=30)
            return float("nan"), [f"no first batch: {err.strip()[-300:]}"]
        pids: list[int] = json.loads(line)
        time.sleep(args.delay)
        start = time.perf_counter()
        if target == "group":
            os.killpg(process.pid, signal.SIGINT)
        else:
            os.kill(process.pid, signal.SIGINT)
        _, err = process.communicate(timeout=30)
        took = time.perf_counter() - start
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return float("nan"), ["did not exit within 30 s"]
    left = [pid for pid in pids if alive(pid)]
    if left:
        problems.append(f"{len(left)} worker(s) alive at exit")
        deadline = time.monotonic() + 3.0
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = [pid for pid in left if alive(pid)]
        for pid in left:
            problems.append(f"worker {pid} still alive 3 s later (killed)")
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    names = shm_names([process.pid, *pids])
    if names:
        problems.append(f"/dev/shm names left: {names[:3]}")
        for name in names:
            os.unlink(os.path.join("/dev/shm", name))
    if process.returncode != _KEYBOARD_INTERRUPT_EXIT:
        problems.append(f"exit status {process.returncode}")
    if "KeyboardInterrupt" not in err:
        problems.append(f"no KeyboardInterrupt on stderr: {err.strip()[-300:]!r}")
    return took, problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0, help="per sample")
    parser.add_argument("--delay", type=float, default=0.3, help="after the first batch")
    parser.add_argument("--strategy", default="", help="torch sharing strategy")
    parser.add_argument("--where", choices=["next", "body"], default="next")
    parser.add_argument("--workers", default="process,thread,none")
    parser.add_argument("--work", default="sleep,busy")
    parser.add_argument("--target", default="main,group")
    parser.add_argument("--libs", default="torch,ferry")
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--pin", action="store_true")
    parser.add_argument("--src", default="", help="import ferry from here")
    args = parser.parse_args()
    become_subreaper()
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as file:
        file.write(_CHILD)
    results: dict[tuple[str, str, str, str], Result] = {}
    settings = list(
        itertools.product(args.workers.split(","), args.work.split(","), args.target.split(","))
    )
    try:
        # Runs alternate between settings and libraries, so a slow spell hits them all.
        for _ in range(args.reps):
            for setting, lib in itertools.product(settings, args.libs.split(",")):
                if lib == "torch" and setting[0] == "thread":
                    continue  # torch has no thread workers
                took, problems = one_run(file.name, lib, setting, args)
                result = results.setdefault((*setting, lib), Result())
                result.seconds.append(took)
                result.problems.extend(problems)
    finally:
        os.unlink(file.name)
    print(f"SIGINT -> exit, median of {args.reps} (s); {vars(args)}")
    print(f"{'workers':8} {'work':6} {'SIGINT to':10} {'torch':>7} {'ferry':>7}  left behind")
    for workers, work, target in settings:
        cells, notes = [], []
        for lib in ("torch", "ferry"):
            got = results.get((workers, work, target, lib))
            if got is None:
                cells.append(f"{'-':>7}")
                continue
            cells.append(f"{statistics.median(got.seconds):7.3f}")
            if got.problems:
                notes.append(f"{lib}: {sorted(set(got.problems))}")
        print(f"{workers:8} {work:6} {target:10} {' '.join(cells)}  {'; '.join(notes) or 'none'}")


if __name__ == "__main__":
    main()
