"""Copy-on-write growth of a dataset's Python objects in forked workers, side by side.

A map-style dataset holding millions of small Python objects in a list: every process worker
that reads them writes their reference counts, so each page holding them is copied once per
worker and the process tree's memory grows by about (workers x objects' size) over an epoch.
This script measures that growth for four loaders over the same items:

* ``torch``: ``torch.utils.data.DataLoader``, process workers (fork);
* ``ferry``: ``ferry.DataLoader``, process workers (fork);
* ``ferry-thread``: ``ferry.DataLoader(worker_type="thread")``: one process, nothing copied;
* ``ferry-shared``: ferry process workers over a :class:`ferry.SharedList` of the same items.

and two workloads: ``str`` (paths, 2 workers) and ``dict`` (``{"path", "label"}`` records,
4 workers). Each case runs in a fresh interpreter (one epoch, batch 64, shuffled) while a
thread of the main process sums ``Pss`` of ``/proc/<pid>/smaps_rollup`` over the main process
and its children every 50 ms; growth is the peak minus the sum just before ``iter()``. PSS
counts a page shared by k processes as 1/k in each, so the sum is the memory the tree uses.
The workers' USS column is the peak of their summed ``Private_Clean + Private_Dirty``: what
they hold that no other process shares (copied pages and their own allocations).

    .venv/bin/python scripts/memory_cow.py                 # 3M items each (a few minutes)
    .venv/bin/python scripts/memory_cow.py --items 300000  # quicker
    .venv/bin/python scripts/memory_cow.py --loaders torch,ferry-shared --workloads str
    .venv/bin/python scripts/memory_cow.py --gc-freeze --sequential  # the remaining growth

Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from ferry._core.memory import proc_kb
from ferry.bench.measure import descendants

LOADERS = ("torch", "ferry", "ferry-thread", "ferry-shared")
WORKLOADS = {"str": 2, "dict": 4}  # workload -> number of workers


def items(workload: str, n: int) -> Iterator[Any]:
    for i in range(n):
        path = f"/datasets/train/{i // 1000:05d}/image_{i:08d}.jpg"
        yield path if workload == "str" else {"path": path, "label": i % 1000}


class Items:
    """A map-style dataset over a sequence (a list or a SharedList) of items."""

    def __init__(self, items: Any) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        return self.items[index]


# -- the process tree's memory --------------------------------------------------------------------


def _memory_kb(pid: int) -> tuple[int, int]:
    """``(Pss, Private_Clean + Private_Dirty)`` of ``pid`` in KiB; zeros once it has exited."""
    fields = proc_kb(f"/proc/{pid}/smaps_rollup", "Pss", "Private_Clean", "Private_Dirty")
    private = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    return fields.get("Pss", 0) // 1024, private // 1024


def tree_memory_kb(root: int) -> tuple[int, int]:
    """The tree's summed PSS, and its descendants' summed private memory (USS), in KiB."""
    pss, children_private = _memory_kb(root)[0], 0
    for pid in descendants(root):
        pid_pss, pid_private = _memory_kb(pid)
        pss += pid_pss
        children_private += pid_private
    return pss, children_private


class PeakSampler:
    """Samples the tree's memory every ``interval`` seconds on a thread; keeps the peaks."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval, self.peak_kb, self.workers_peak_kb = interval, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pss-sampler", daemon=True)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        root = os.getpid()
        while True:
            pss, workers_private = tree_memory_kb(root)
            self.peak_kb = max(self.peak_kb, pss)
            self.workers_peak_kb = max(self.workers_peak_kb, workers_private)
            if self._stop.wait(self.interval):
                return


# -- one case, in its own interpreter -------------------------------------------------------------


def run_case(
    loader_name: str, workload: str, *, n: int, batch_size: int, shuffle: bool, freeze: bool
) -> dict:
    import gc

    import torch

    import ferry

    workers = WORKLOADS[workload]
    start = time.perf_counter()
    if loader_name == "ferry-shared":
        data: Any = ferry.SharedList(items(workload, n))
    else:
        data = list(items(workload, n))
    build_s = time.perf_counter() - start
    options: dict[str, Any] = {"batch_size": batch_size, "shuffle": shuffle, "num_workers": workers}
    if loader_name == "torch":
        loader: Any = torch.utils.data.DataLoader(
            Items(data), multiprocessing_context="fork", **options
        )
    elif loader_name == "ferry-thread":
        loader = ferry.DataLoader(Items(data), worker_type="thread", **options)
    else:
        loader = ferry.DataLoader(Items(data), multiprocessing_context="fork", **options)
    if freeze:
        gc.freeze()
    baseline_kb, _ = tree_memory_kb(os.getpid())
    start = time.perf_counter()
    batches = 0
    with PeakSampler() as sampler:
        for _ in loader:
            batches += 1
    wall_s = time.perf_counter() - start
    assert batches == -(-n // batch_size), batches
    return {
        "loader": loader_name,
        "workload": workload,
        "items": n,
        "workers": workers,
        "build_s": round(build_s, 2),
        "baseline_mb": round(baseline_kb / 1024, 1),
        "growth_mb": round((sampler.peak_kb - baseline_kb) / 1024, 1),
        "workers_private_mb": round(sampler.workers_peak_kb / 1024, 1),
        "wall_s": round(wall_s, 2),
    }


# -- the table ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=3_000_000, help="items per workload")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--sequential", action="store_true", help="no shuffle")
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="call gc.freeze() before iter(): collections in workers then skip inherited objects",
    )
    parser.add_argument("--loaders", default=",".join(LOADERS), help="comma-separated")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument("--one", nargs=2, metavar=("LOADER", "WORKLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not os.path.exists("/proc/self/smaps_rollup"):
        sys.exit("memory_cow.py reads /proc/<pid>/smaps_rollup: Linux 4.14 or later only")
    if args.one:
        loader_name, workload = args.one
        result = run_case(
            loader_name,
            workload,
            n=args.items,
            batch_size=args.batch_size,
            shuffle=not args.sequential,
            freeze=args.gc_freeze,
        )
        print(json.dumps(result))
        return
    loaders, workloads = args.loaders.split(","), args.workloads.split(",")
    for name in loaders:
        if name not in LOADERS:
            sys.exit(f"--loaders: expected names among {', '.join(LOADERS)}, got {name!r}")
    for name in workloads:
        if name not in WORKLOADS:
            sys.exit(f"--workloads: expected names among {', '.join(WORKLOADS)}, got {name!r}")
    print(
        f"{args.items:,} items per workload, batch {args.batch_size}, "
        f"{'sequential' if args.sequential else 'shuffled'}, one epoch, fork"
        f"{', gc.freeze() before iter()' if args.gc_freeze else ''}; "
        "PSS of the process tree, peak minus before iter()\n"
    )
    print("| workload | loader | workers | tree PSS before | growth | workers' USS | epoch |")
    print("|---|---|--:|--:|--:|--:|--:|")
    for workload in workloads:
        for name in loaders:
            command = [sys.executable, __file__, "--one", name, workload]
            command += ["--items", str(args.items), "--batch-size", str(args.batch_size)]
            command += ["--sequential"] if args.sequential else []
            command += ["--gc-freeze"] if args.gc_freeze else []
            done = subprocess.run(command, check=False, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"| {workload} | {name} | failed: {done.stderr.strip()[-300:]} |")
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            print(
                f"| {workload} | {name} | {row['workers']} | {row['baseline_mb']:,.0f} MB "
                f"| {row['growth_mb']:+,.0f} MB | {row['workers_private_mb']:,.0f} MB "
                f"| {row['wall_s']:.1f} s |",
                flush=True,
            )


if __name__ == "__main__":
    main()
