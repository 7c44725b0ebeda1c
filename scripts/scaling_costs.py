"""What each batch costs, per component, as the worker count grows: ferry beside torch.

One loader with persistent workers, a warm-up epoch, then one measured epoch; for each loader
and worker count it prints, per batch:

* the main process's CPU time (all its threads), minor page faults and context switches
  (voluntary: a thread went to sleep, so another wake-up will follow), and its thread count;
* the workers' CPU time (making the batch included: the same ``__getitem__`` for both
  loaders, each its own collate), page faults and context switches, summed over the workers;
* with ``--profile``, the main thread's CPU time by stage (cProfile, own time of the
  functions of each stage's modules, so the figures are inflated alike for both loaders:
  compare the shares, not the microseconds).

``--strace`` attaches ``strace -c`` to the main process and to the workers (every thread) for
one steady epoch instead, and prints the system calls per batch of each side (strace slows
everything; the counts stay).

    .venv/bin/python scripts/scaling_costs.py                       # 1, 2, 4, 8 workers
    .venv/bin/python scripts/scaling_costs.py --workers 8 --profile
    .venv/bin/python scripts/scaling_costs.py --workers 2 --loader ferry --strace

The machine has 2 cores: with 4 and 8 workers they are oversubscribed, so read the counts
(faults, switches, threads, CPU per batch), not the rates.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import signal
import subprocess
import time
from typing import Any

_SHAPE = (3, 224, 224)

# Which stage a function of the main thread belongs to, by the file it is defined in.
_STAGES = {
    "receive": ("channels.py", "connection.py", "queues.py", "selectors.py", "queue.py"),
    "map": ("slabfile.py", "reductions.py", "reduction.py", "storage.py"),
    "decode": ("slabmaps.py", "~"),  # "~": builtins (pickle loads, torch.frombuffer, ...)
    "pin": ("pin.py", "pin_memory.py"),
    "deliver": (
        "pool.py",
        "iterator.py",
        "schedule.py",
        "track.py",
        "cursor.py",
        "dataloader.py",
        "loader.py",
        "incidents.py",
        "switch.py",
        "keys.py",
    ),
    "sampler": ("samplers.py", "sampler.py", "_batching.py", "_sampler_keys.py"),
    "statistics": ("stats.py",),
    "threading": ("threading.py",),
}


class ImagePool:
    """Sample ``i`` is a view of one of a few preallocated uint8 images."""

    def __init__(self, pool: Any, length: int) -> None:
        self.pool, self.length = pool, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.pool[index % len(self.pool)]


def _children() -> list[int]:
    pids: list[int] = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as file:
                pids += [int(p) for p in file.read().split()]
        except OSError:
            pass
    return pids


def _tree(pids: list[int]) -> tuple[float, int, int, int]:
    """CPU seconds, minor faults, voluntary and involuntary switches of ``pids``, summed."""
    cpu_ns = faults = vol = invol = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as file:
                faults += int(file.read().rsplit(")", 1)[1].split()[7])
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/schedstat") as file:
                    cpu_ns += int(file.read().split()[0])
                with open(f"/proc/{pid}/task/{tid}/status") as file:
                    for line in file:
                        if line.startswith("voluntary_ctxt_switches"):
                            vol += int(line.split()[1])
                        elif line.startswith("nonvoluntary_ctxt_switches"):
                            invol += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            pass
    return cpu_ns / 1e9, faults, vol, invol


def _main() -> tuple[float, int, int, int]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_minflt, usage.ru_nvcsw, usage.ru_nivcsw


def _loader(name: str, workers: int, samples: int, batch: int, pin: bool) -> Any:
    import numpy as np
    import torch

    pool = np.random.default_rng(0).integers(0, 256, (64, *_SHAPE), dtype="uint8")
    options: dict[str, Any] = {
        "batch_size": batch,
        "shuffle": True,
        "num_workers": workers,
        "pin_memory": pin,
        "generator": torch.Generator().manual_seed(0),
    }
    if workers:
        options["persistent_workers"] = True
    dataset: Any = ImagePool(pool, samples)
    if name == "torch":
        from torch.utils.data import DataLoader

        return DataLoader(dataset, **options)
    import ferry

    if name == "ferry-thread":
        options["worker_type"] = "thread"
    return ferry.DataLoader(dataset, **options)


def _stage_of(filename: str) -> str:
    base = os.path.basename(filename)
    for stage, files in _STAGES.items():
        if base in files or filename in files:
            return stage
    return "other"


def measure(args: argparse.Namespace, name: str, workers: int) -> dict[str, float]:
    loader = _loader(name, workers, args.samples, args.batch, args.pin)
    for _ in loader:  # warm-up: workers started, slabs made
        pass
    pids = _children()
    profile = cProfile.Profile(time.thread_time) if args.profile else None
    main0, tree0 = _main(), _tree(pids)
    batches = 0
    start = time.perf_counter()
    if profile is not None:
        profile.enable()
    for _ in loader:
        batches += 1
    if profile is not None:
        profile.disable()
    wall = time.perf_counter() - start
    main1, tree1 = _main(), _tree(pids)
    row = {
        "batches/s": batches / wall,
        "main CPU us": (main1[0] - main0[0]) / batches * 1e6,
        "main faults": (main1[1] - main0[1]) / batches,
        "main vol sw": (main1[2] - main0[2]) / batches,
        "main threads": float(len(os.listdir("/proc/self/task"))),
        "workers CPU us": (tree1[0] - tree0[0]) / batches * 1e6,
        "workers faults": (tree1[1] - tree0[1]) / batches,
        "workers vol sw": (tree1[2] - tree0[2]) / batches,
    }
    if profile is not None:
        stages: dict[str, float] = {}
        for (filename, _, _), stat in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
            stage = _stage_of(filename)
            stages[stage] = stages.get(stage, 0.0) + stat[2]
        for stage, seconds in sorted(stages.items(), key=lambda kv: -kv[1]):
            row[f"  {stage} us"] = seconds / batches * 1e6
    del loader
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loader", nargs="+", default=["torch", "ferry"])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--pin", action="store_true", help="pin_memory=True")
    parser.add_argument("--profile", action="store_true", help="the main thread's stages")
    parser.add_argument("--strace", action="store_true", help="system calls per batch")
    args = parser.parse_args()
    if args.strace:
        for workers in args.workers:
            for name in args.loader:
                strace_epoch(args, name, workers)
        return
    print(f"uint8 3x224x224, batch {args.batch}, {args.samples} samples, persistent workers")
    for workers in args.workers:
        for name in args.loader:
            row = measure(args, name, workers)
            print(
                f"{name} x{workers}: " + ", ".join(f"{k.strip()} {v:,.1f}" for k, v in row.items())
            )


def _attach(pids: list[int], out: str) -> subprocess.Popen[bytes]:
    """``strace -c`` attached to every thread of ``pids`` (counts only), writing to ``out``."""
    command = ["strace", "-c", "-f", "-o", out]
    for pid in pids:
        command += ["-p", str(pid)]
    return subprocess.Popen(command, stderr=subprocess.DEVNULL)


def _calls(out: str, batches: int) -> dict[str, float]:
    """System calls per batch from a ``strace -c`` summary, the frequent ones."""
    found: dict[str, float] = {}
    with open(out) as file:
        for line in file:
            parts = line.split()
            if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
                calls = int(parts[3])
                if calls / batches >= 0.1:
                    found[parts[-1]] = calls / batches
    return found


def strace_epoch(args: argparse.Namespace, name: str, workers: int) -> None:
    """The system calls of one steady epoch (after a warm-up), main process and workers apart."""
    loader = _loader(name, workers, args.samples, args.batch, args.pin)
    for _ in loader:
        pass
    pids = _children()  # (before a tracer is one of them)
    tracers = [
        _attach([os.getpid()], f"/tmp/scaling_strace_main_{name}_{workers}.txt"),
        _attach(pids, f"/tmp/scaling_strace_workers_{name}_{workers}.txt"),
    ]
    time.sleep(2.0)  # (attached by then)
    batches = 0
    for _ in loader:
        batches += 1
    for tracer in tracers:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(30)
    for side in ("main", "workers"):
        calls = _calls(f"/tmp/scaling_strace_{side}_{name}_{workers}.txt", batches)
        shown = ", ".join(f"{k} {v:.1f}" for k, v in sorted(calls.items(), key=lambda kv: -kv[1]))
        print(f"{name} x{workers}, {side}: system calls per batch: {shown}")
    del loader


if __name__ == "__main__":
    main()
