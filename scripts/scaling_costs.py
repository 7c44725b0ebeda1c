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
    python3 scripts/scaling_costs.py --workload jpeg --gpu --workers 8 15 --epochs 3   # GPU host
    python3 scripts/scaling_costs.py --workload jpeg --gpu --workers 15 --samples 30720 \
        --loader torch ferry ferry-balanced --epochs 2      # long epochs, balance_workers=True
    python3 scripts/scaling_costs.py --workload jpeg --gpu --workers 15 --epochs 3 \
        --nudge-ms 50   # workers swapping CPUs as they run (scripts/cpu_speeds.py says why)
    python3 scripts/scaling_costs.py --workload jpeg --gpu --workers 15 --epochs 3 \
        --loader ferry ferry-unmoved ferry-rotate   # move_workers: default, False, pinned

``--workload jpeg`` runs the scaling mode's Pillow pipeline (batch 128) instead of the image
pool; ``--gpu`` the scaling mode's GPU feed (``pin_memory=True``, ``prefetch_factor=4``, each
batch ``.to("cuda", non_blocking=True)`` and normalized there). Every row also reports what the
workers spend inside ``__getitem__`` (wall and CPU, per batch, timed in the dataset), so that
"workers CPU" splits into the dataset's work and everything else (collate, transport, engine),
and the workers' busy share (time in ``__getitem__`` over the epoch's wall time times the worker
count: 100% is a loader that never lets a worker wait); and the main process's CPU by thread
(the main thread, then the others: pin thread, feeders), and the main thread's wait in ``next()``.

The machine has 2 cores: with 4 and 8 workers they are oversubscribed, so read the counts
(faults, switches, threads, CPU per batch), not the rates.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import os
import pstats
import resource
import signal
import subprocess
import threading
import time
from multiprocessing.sharedctypes import RawArray
from typing import Any

from cpu_speeds import Nudger  # (scripts/ is on the path of a script run from it)

from ferry.bench.scaling import _gpu_step as gpu_step  # (the scaling mode's GPU feed)
from ferry.bench.workloads import ImagePool

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


class Timed:
    """``dataset`` with each ``__getitem__`` timed (wall and this thread's CPU), summed per
    worker id in an array shared by inheritance (fork), so both loaders' workers report; and
    each index's worker, start and end (``time.perf_counter``, one clock for all processes) in
    ``marks``, the epoch's timeline."""

    def __init__(self, dataset: Any, totals: Any, info: Any) -> None:
        self.dataset, self.totals, self.info = dataset, totals, info
        self.marks = RawArray("d", 3 * len(dataset))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        sample = self.dataset[index]
        info = self.info()
        worker = info.id if info is not None else 0
        slot = 3 * worker
        end = time.perf_counter()
        self.marks[3 * index : 3 * index + 3] = [worker, wall, end]
        self.totals[slot] += end - wall
        self.totals[slot + 1] += time.thread_time() - cpu
        self.totals[slot + 2] += 1
        return sample


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


def _threads() -> dict[int, float]:
    """CPU seconds of each thread of this process, by thread id."""
    found: dict[int, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as file:
                found[int(tid)] = int(file.read().split()[0]) / 1e9
        except (OSError, ValueError):
            pass
    return found


def _main() -> tuple[float, int, int, int]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_minflt, usage.ru_nvcsw, usage.ru_nivcsw


def _dataset(workload: str, samples: int, totals: Any, name: str) -> Any:
    if workload == "jpeg":
        from ferry.bench.workloads import JpegCrops, _prepare_photos

        dataset: Any = JpegCrops(_prepare_photos(samples, False), samples)
    else:
        import numpy as np

        pool = np.random.default_rng(0).integers(0, 256, (64, *_SHAPE), dtype="uint8")
        dataset = ImagePool(pool, samples)
    if name == "torch":
        from torch.utils.data import get_worker_info
    else:
        from ferry import get_worker_info
    return Timed(dataset, totals, get_worker_info)


def _loader(args: argparse.Namespace, name: str, workers: int, totals: Any) -> Any:
    import torch

    options: dict[str, Any] = {
        "batch_size": args.batch,
        "shuffle": True,
        "num_workers": workers,
        "pin_memory": args.pin or args.gpu,
        "generator": torch.Generator().manual_seed(0),
    }
    if workers:
        options["persistent_workers"] = True
        if args.gpu:
            options["prefetch_factor"] = 4
    dataset = _dataset(args.workload, args.samples, totals, name)
    if name == "torch":
        from torch.utils.data import DataLoader

        return DataLoader(dataset, **options)
    import ferry

    if name == "ferry-thread":
        options["worker_type"] = "thread"
    if name == "ferry-balanced":
        options["balance_workers"] = True
    if name == "ferry-unmoved":
        options["move_workers"] = False
    if name == "ferry-rotate":  # (pinned rotation: see ferry._engine.crew.placement's MODE)
        options["move_workers"] = True
    return ferry.DataLoader(dataset, **options)


def _stage_of(filename: str) -> str:
    base = os.path.basename(filename)
    for stage, files in _STAGES.items():
        if base in files or filename in files:
            return stage
    return "other"


def _timeline(marks: Any, workers: int, began: float, ended: float) -> dict[str, float]:
    """Where the workers' idle time of one epoch lies, in ms (means over the workers): before
    their first sample, between samples (collate, hand-off, waiting for a task or a slab), and
    after their last one (the others still working, then the last batches' hand-off and step)."""
    per: dict[int, list[tuple[float, float]]] = {}
    for i in range(0, len(marks), 3):
        per.setdefault(int(marks[i]), []).append((marks[i + 1], marks[i + 2]))
    first, gaps, big, last, speeds, counts = [], [], [], [], [], []
    for spans in per.values():
        spans.sort()
        speeds.append(len(spans) / max(sum(b - a for a, b in spans), 1e-9))
        counts.append(len(spans))
        first.append(spans[0][0] - began)
        between = [b[0] - a[1] for a, b in itertools.pairwise(spans)]
        gaps.append(sum(between))
        big.append(sum(g for g in between if g > 0.002))
        last.append(spans[-1][1])
    count = max(len(per), 1)
    return {
        "epoch": (ended - began) * 1e3,
        "to first sample": sum(first) / count * 1e3,
        "to first sample, max": max(first) * 1e3,
        "between samples": sum(gaps) / count * 1e3,
        "of which gaps > 2 ms": sum(big) / count * 1e3,
        "after last sample": sum(ended - t for t in last) / count * 1e3,
        "last worker done to epoch end": (ended - max(last)) * 1e3,
        "workers seen": float(len(per)),
        "fastest/slowest worker (samples per busy s)": max(speeds) / min(speeds),
        "most/fewest samples a worker": max(counts) / min(counts),
    }


def _epoch(loader: Any, step: Any) -> tuple[int, float, float, bool]:
    """One epoch: batches, seconds waited in ``next()``, seconds in the step, pinned or not."""
    batches, waited, stepped, pinned, out = 0, 0.0, 0.0, True, None
    it = iter(loader)
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        t1 = time.perf_counter()
        waited += t1 - t0
        batches += 1
        if step is not None:
            pinned = pinned and batch.is_pinned()
            out = step(batch)
            stepped += time.perf_counter() - t1
    if step is not None:
        import torch

        torch.cuda.synchronize()
    del out
    return batches, waited, stepped, pinned


def measure(args: argparse.Namespace, name: str, workers: int) -> dict[str, float]:
    totals = RawArray("d", 3 * max(workers, 1))
    from ferry._engine.crew import placement

    placement.MODE = "rotate" if name == "ferry-rotate" else "swap"
    if args.move_ms:
        placement.PERIOD_S = args.move_ms / 1000
    loader = _loader(args, name, workers, totals)
    step = gpu_step() if args.gpu else None
    _epoch(loader, step)  # warm-up: workers started, slabs made, the device's context
    pids = _children()
    profile = cProfile.Profile(time.thread_time) if args.profile else None
    main0, tree0, threads0 = _main(), _tree(pids), _threads()
    for i in range(len(totals)):
        totals[i] = 0.0
    batches, waited, stepped, pinned = 0, 0.0, 0.0, True
    walls, lines = [], []
    if profile is not None:
        profile.enable()
    nudges = 0
    for _ in range(args.epochs):
        start = time.perf_counter()
        if args.nudge_ms:
            with Nudger(_children, args.nudge_ms / 1000) as nudger:
                b, w, s, p = _epoch(loader, step)
            nudges += nudger.moves
        else:
            b, w, s, p = _epoch(loader, step)
        walls.append(time.perf_counter() - start)
        idle = _timeline(loader.dataset.marks, workers, start, start + walls[-1])
        lines.append(", ".join(f"{k} {v:,.1f}" for k, v in idle.items()))
        batches, waited, stepped, pinned = batches + b, waited + w, stepped + s, pinned and p
    if profile is not None:
        profile.disable()
    wall = sum(walls)
    main1, tree1, threads1 = _main(), _tree(pids), _threads()
    main_tid = threading.get_native_id()
    others = sorted(
        (threads1[t] - threads0.get(t, 0.0) for t in threads1 if t != main_tid), reverse=True
    )
    in_wall = sum(totals[i] for i in range(0, len(totals), 3))
    in_cpu = sum(totals[i] for i in range(1, len(totals), 3))
    samples = sum(totals[i] for i in range(2, len(totals), 3))
    row = {
        "batches/s": batches / wall,
        "samples/s": samples / wall,
        "epoch ms": sorted(walls)[len(walls) // 2] * 1e3,
        "main CPU us": (main1[0] - main0[0]) / batches * 1e6,
        "main thread CPU us": (threads1[main_tid] - threads0[main_tid]) / batches * 1e6,
        "other threads CPU us": sum(others) / batches * 1e6,
        "busiest other thread CPU us": (others[0] if others else 0.0) / batches * 1e6,
        "next() wait us": waited / batches * 1e6,
        "step us": stepped / batches * 1e6,
        "main faults": (main1[1] - main0[1]) / batches,
        "main vol sw": (main1[2] - main0[2]) / batches,
        "main invol sw": (main1[3] - main0[3]) / batches,
        "main threads": float(len(threads1)),
        "workers CPU us": (tree1[0] - tree0[0]) / batches * 1e6,
        "in-dataset CPU us": in_cpu / batches * 1e6,
        "in-dataset wall us": in_wall / batches * 1e6,
        "outside-dataset workers CPU us": (tree1[0] - tree0[0] - in_cpu) / batches * 1e6,
        "workers busy %": 100 * in_wall / (wall * max(workers, 1)),
        "workers faults": (tree1[1] - tree0[1]) / batches,
        "workers vol sw": (tree1[2] - tree0[2]) / batches,
        "workers invol sw": (tree1[3] - tree0[3]) / batches,
    }
    if step is not None:
        row["pinned"] = float(pinned)
    if args.nudge_ms:
        row["nudges"] = float(nudges)
    for number, line in enumerate(lines):
        print(f"  {name} x{workers} epoch {number + 1} timeline (ms): {line}", flush=True)
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
    parser.add_argument("--workload", choices=("uint8", "jpeg"), default="uint8")
    parser.add_argument(
        "--samples",
        type=int,
        default=None,
        help="default: 4096 (uint8), "
        "512 a worker (jpeg: 4 batches of 128 each, as the scaling mode)",
    )
    parser.add_argument("--batch", type=int, default=None, help="default 64 (uint8), 128 (jpeg)")
    parser.add_argument("--epochs", type=int, default=1, help="measured epochs per row")
    parser.add_argument("--gpu", action="store_true", help="the scaling mode's GPU feed")
    parser.add_argument("--pin", action="store_true", help="pin_memory=True")
    parser.add_argument("--profile", action="store_true", help="the main thread's stages")
    parser.add_argument("--strace", action="store_true", help="system calls per batch")
    parser.add_argument(
        "--nudge-ms",
        type=float,
        default=0.0,
        help="during measured epochs, every this many ms move each worker process to the CPU "
        "of the next one, then set it free (scripts/cpu_speeds.py says why)",
    )
    parser.add_argument(
        "--move-ms",
        type=float,
        default=0.0,
        help="ferry's move_workers period in ms (default: placement.PERIOD_S, 50 ms)",
    )
    args = parser.parse_args()
    if args.batch is None:
        args.batch = 128 if args.workload == "jpeg" else 64
    if args.strace:
        given = args.samples
        for workers in args.workers:
            args.samples = given or _default_samples(args, workers)
            for name in args.loader:
                strace_epoch(args, name, workers)
        return
    given = args.samples
    for workers in args.workers:
        args.samples = given or _default_samples(args, workers)
        print(
            f"{args.workload}, batch {args.batch}, {args.samples} samples, persistent workers"
            f"{', GPU feed' if args.gpu else ''}; {args.epochs} measured epoch(s)",
            flush=True,
        )
        for name in args.loader:
            row = measure(args, name, workers)
            print(
                f"{name} x{workers}: " + ", ".join(f"{k.strip()} {v:,.1f}" for k, v in row.items()),
                flush=True,
            )


def _default_samples(args: argparse.Namespace, workers: int) -> int:
    """4,096 images from the pool; for jpeg, 4 batches a worker as the scaling mode has it."""
    return 4096 if args.workload == "uint8" else 4 * args.batch * max(workers, 1)


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
    loader = _loader(args, name, workers, RawArray("d", 3 * max(workers, 1)))
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
