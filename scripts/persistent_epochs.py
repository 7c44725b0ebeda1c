"""Steady-state epochs with persistent workers: time, CPU and page faults per epoch, both sides.

The persistent-workers regression's row: uint8 3x224x224 images from a preallocated pool, batch
64, 2 process workers, 2,048 samples an epoch, ``persistent_workers=True``, shuffled. For each
epoch it prints the wall time, the main process's CPU time (all its threads) and minor page faults,
and the workers' CPU time (``/proc/<pid>/task/*/schedstat``, ns) and minor faults
(``/proc/<pid>/stat``), summed. CPU time and fault counts hardly move with other load on the
machine; wall time does, so compare wall time only in interleaved A/B runs (``--src``, below).

    .venv/bin/python scripts/persistent_epochs.py                  # ferry, this tree
    .venv/bin/python scripts/persistent_epochs.py --loader torch
    # A/B: alternate two source trees, fresh interpreter each, medians of epochs 1-5
    git worktree add /tmp/base 885e56a
    .venv/bin/python scripts/persistent_epochs.py --src /tmp/base/src src --rounds 8

The script imports nothing of ferry's but the DataLoader, so it runs against old trees too.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

_SHAPE = (3, 224, 224)


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


def _worker_counters(pids: list[int]) -> tuple[float, int]:
    """CPU seconds (every thread) and minor faults of processes ``pids``, summed."""
    cpu_ns, faults = 0, 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as file:
                faults += int(file.read().rsplit(")", 1)[1].split()[7])
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/schedstat") as file:
                    cpu_ns += int(file.read().split()[0])
        except (OSError, IndexError, ValueError):
            pass
    return cpu_ns / 1e9, faults


def _main_counters() -> tuple[float, int]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_minflt


def run(
    loader_name: str, epochs: int, workers: int, batch: int, samples: int
) -> list[dict[str, float]]:
    import numpy as np
    import torch

    loader_class: Any
    if loader_name == "torch":
        from torch.utils.data import DataLoader as loader_class
    else:
        from ferry import DataLoader as loader_class
    pool = np.random.default_rng(0).integers(0, 256, (256, *_SHAPE), dtype="uint8")
    loader = loader_class(
        ImagePool(pool, samples),
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(0),
    )
    rows: list[dict[str, float]] = []
    pids: list[int] = []
    for _ in range(epochs):
        main_cpu, main_faults = _main_counters()
        work_cpu, work_faults = _worker_counters(pids)
        start = time.perf_counter()
        for _batch in loader:
            pass
        wall = time.perf_counter() - start
        pids = pids or _children()
        main_cpu2, main_faults2 = _main_counters()
        work_cpu2, work_faults2 = _worker_counters(pids)
        rows.append(
            {
                "ms": wall * 1e3,
                "main_cpu_ms": (main_cpu2 - main_cpu) * 1e3,
                "main_faults": main_faults2 - main_faults,
                "workers_cpu_ms": (work_cpu2 - work_cpu) * 1e3,
                "workers_faults": work_faults2 - work_faults,
            }
        )
    del loader
    return rows


def _ab(args: argparse.Namespace) -> None:
    keys = ("ms", "main_cpu_ms", "main_faults", "workers_cpu_ms", "workers_faults")
    got: dict[str, dict[str, list[float]]] = {src: {k: [] for k in keys} for src in args.src}
    for round_ in range(args.rounds):
        # Each tree goes first in turn (the first of a round was favoured: ab_throughput.py).
        shift = round_ % len(args.src)
        for src in args.src[shift:] + args.src[:shift]:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
            out = subprocess.run(
                [
                    *(sys.executable, __file__, "--json", "--loader", args.loader),
                    *("--epochs", str(args.epochs), "--workers", str(args.workers)),
                ],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            )
            rows = json.loads(out.stdout)[1:]  # epoch 0 starts the workers
            for key in keys:
                got[src][key].append(statistics.median(row[key] for row in rows))
    last = args.epochs - 1
    print(f"medians over {args.rounds} alternating rounds of each run's median of epochs 1-{last}")
    print(f"{'src':<28}" + "".join(f"{k:>16}" for k in keys))
    for src in args.src:
        print(f"{src:<28}" + "".join(f"{statistics.median(got[src][k]):>16,.1f}" for k in keys))
    # Paired: each round's epoch time against the first tree's in the same round (what the
    # machine's drift over the run cannot move), median and quartiles.
    first = got[args.src[0]]["ms"]
    for src in args.src[1:]:
        ratios = [b / a for a, b in zip(first, got[src]["ms"], strict=True)]
        low, mid, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        print(f"{src} / {args.src[0]}: epoch time x{mid:.3f} (quartiles {low:.3f}-{high:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loader", choices=("ferry", "torch"), default="ferry")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--src", nargs="+", help="A/B: source trees to alternate (PYTHONPATH)")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    if args.src:
        _ab(args)
        return
    rows = run(args.loader, args.epochs, args.workers, args.batch, args.samples)
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{args.loader}, {args.workers} persistent workers, batch {args.batch}, ", end="")
    print(f"{args.samples} samples")
    heads = ("main CPU ms", "main faults", "workers CPU ms", "workers faults")
    print(f"{'epoch':>5} {'ms':>8} " + " ".join(f"{h:>15}" for h in heads))
    for i, row in enumerate(rows):
        print(
            f"{i:>5} {row['ms']:>8.1f} {row['main_cpu_ms']:>15.1f} {row['main_faults']:>15,.0f} "
            f"{row['workers_cpu_ms']:>15.1f} {row['workers_faults']:>15,.0f}"
        )


if __name__ == "__main__":
    main()
