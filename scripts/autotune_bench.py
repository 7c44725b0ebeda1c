"""BENCHMARKS.md's autotune rows: ``num_workers="auto"`` against torch's default and the best
fixed setting.

For each scenario (a workload of ``python -m ferry bench`` and a simulated training step), the
median batches/s over ``--runs`` runs of:

* torch's default loader, ``num_workers=0``;
* ferry with ``num_workers="auto", prefetch_factor="auto"``: a fresh loader per run, three
  epochs, each epoch's batches/s and the setting it ran with;
* ferry with each setting of a small grid (process workers 1 to the CPU count with
  ``prefetch_factor=2``, the CPU count with 4, and as many thread workers): the best one.

An epoch's batches/s is counted from ``iter()`` to its last batch, worker start-up included,
as a run without persistent workers pays it every epoch. The training step is ``time.sleep``:
the CPU is free during it, as while a GPU computes. Batches and order are the same in every
case (shuffled with the same seed); only the time differs.

    .venv/bin/python scripts/autotune_bench.py
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from typing import Any

import torch
import torch.utils.data as tud

import ferry
from ferry.bench.runner import load_api
from ferry.bench.workloads import WORKLOADS

Setting = tuple[str, int, int]  # worker type, num_workers, prefetch_factor


def epoch_rate(loader: Any, step_s: float) -> float:
    """Batches/s of one epoch of ``loader`` with a training step of ``step_s`` seconds."""
    start, count = time.perf_counter(), 0
    for _ in loader:
        if step_s:
            time.sleep(step_s)
        count += 1
    return count / (time.perf_counter() - start)


def build(module: Any, dataset: Any, batch_size: int, **options: Any) -> Any:
    generator = torch.Generator().manual_seed(0)
    return module.DataLoader(
        dataset, batch_size=batch_size, shuffle=True, generator=generator, **options
    )


def label(setting: Setting) -> str:
    kind, workers, prefetch = setting
    return f"{workers} {kind}, prefetch {prefetch}"


def scenario(name: str, step_ms: float, batches: int, runs: int, cpus: int) -> str:
    """One markdown row: torch's default, ferry "auto" per epoch, the best fixed setting.

    The loaders take turns, one run each per round, so the machine's drift hits all alike."""
    workload = WORKLOADS[name]
    size = workload.batch_size
    samples = size * batches
    dataset = workload.dataset(workload.prepare(samples, False), samples, load_api("ferry"))
    step_s = step_ms / 1000
    grid: list[Setting] = [("process", w, 2) for w in range(1, cpus + 1)]
    grid += [("process", cpus, 4), ("thread", cpus, 2)]

    torch_rates: list[float] = []
    auto_rates: list[list[float]] = [[], [], []]
    histories: collections.Counter[tuple[str, ...]] = collections.Counter()
    fixed_rates: dict[Setting, list[float]] = {setting: [] for setting in grid}
    last_reason = ""
    for _ in range(runs):
        torch_rates.append(epoch_rate(build(tud, dataset, size), step_s))
        loader = build(ferry, dataset, size, num_workers="auto", prefetch_factor="auto")
        history = []
        for rates in auto_rates:
            rates.append(epoch_rate(loader, step_s))
            history.append(f"{loader.num_workers}/{loader.prefetch_factor}")
        histories[tuple(history)] += 1
        last_reason = loader.stats().tuning
        for setting, rates in fixed_rates.items():
            kind, workers, prefetch = setting
            options = {"worker_type": kind, "num_workers": workers, "prefetch_factor": prefetch}
            rates.append(epoch_rate(build(ferry, dataset, size, **options), step_s))

    fixed = {setting: statistics.median(rates) for setting, rates in fixed_rates.items()}
    best = max(fixed, key=fixed.__getitem__)
    print(f"  {name}, step {step_ms:g} ms, fixed settings (b/s):")
    for setting, rate in fixed.items():
        print(f"    {label(setting)}: {rate:.1f}")
    print(f"  tuning after the last run: {last_reason}")
    usual, count = histories.most_common(1)[0]
    epochs = " / ".join(f"{statistics.median(rates):.1f}" for rates in auto_rates)
    return (
        f"| `{name}`, batch {size}, {batches} batches/epoch | {step_ms:g} ms "
        f"| {statistics.median(torch_rates):.1f} | {epochs} "
        f"| {' → '.join(usual)} ({count} of {runs} runs) "
        f"| {fixed[best]:.1f} ({label(best)}) |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per loader (median)")
    parser.add_argument("--workload", default="jpeg", choices=sorted(WORKLOADS))
    parser.add_argument("--batches", type=int, default=30, help="batches per epoch")
    parser.add_argument(
        "--steps", default="0,60", help="simulated training steps, ms, comma-separated"
    )
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert cpus is not None
    print(
        f"{cpus} CPUs, 1-minute load average {os.getloadavg()[0]:.2f}, torch {torch.__version__}, "
        f"median of {args.runs} runs"
    )
    rows = [
        scenario(args.workload, float(ms), args.batches, args.runs, cpus)
        for ms in args.steps.split(",")
    ]
    print()
    print(
        '| workload | training step | torch `num_workers=0` b/s | ferry `"auto"` b/s, '
        "epochs 1 / 2 / 3 | auto's num_workers/prefetch_factor per epoch | best fixed b/s |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
