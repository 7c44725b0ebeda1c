"""The main process's ceiling: how many batches a second the loop takes in when the workers'
batches cost next to nothing, torch beside ferry, at 2 to 32 process workers.

Each sample is one row of a preallocated ``TensorDataset`` (each side's own; float32[32] and an
int label), batch 256, shuffled: a worker makes a batch in well under a millisecond, so the rate
is what the main process can receive, decode and hand out (on 2 cores the workers take CPU from
it too, as they would on any host where they outnumber the cores). One loader per side and
worker count, persistent workers, a warm-up epoch, then epochs of the two sides in turn; each
side's median.

    .venv/bin/python scripts/main_ceiling.py                     # 2, 4, 8, 16, 32 workers
    .venv/bin/python scripts/main_ceiling.py --workers 2 8 --reps 7 --src /tmp/base/src

Issue 33 asks that ferry's rate stay at least 2x torch's at every worker count.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.utils.data as tud

# ``--src DIR`` runs another tree's ferry (an A/B); it is read before ferry is imported.
_SRC = sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv else None
sys.path.insert(0, _SRC or str(Path(__file__).resolve().parents[1] / "src"))

import ferry  # noqa: E402  (after the path is set)

SAMPLES, BATCH = 256 * 400, 256


def _epoch(loader: Any) -> float:
    """Batches a second over one epoch (the first batch's wait left out)."""
    iterator = iter(loader)
    next(iterator)
    start, count = time.perf_counter(), 0
    for _ in iterator:
        count += 1
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--src", help="another tree's src directory, for its ferry")
    args = parser.parse_args()
    # (Both loaders warn about more workers than CPUs: that is the point here.)
    warnings.filterwarnings("ignore", message=".*worker processes in total")
    generator = torch.Generator().manual_seed(0)
    columns = (torch.randn(SAMPLES, 32), torch.randint(0, 10, (SAMPLES,)))
    print(f"ferry from {Path(ferry.__file__).parent}; batch {BATCH}, {SAMPLES // BATCH} batches")
    print(f"{'workers':>7} {'torch b/s':>10} {'ferry b/s':>10} {'ferry/torch':>11}")
    for workers in args.workers:
        loaders = {
            name: lib.DataLoader(
                lib.TensorDataset(*columns),  # (each side's own, as its users write it)
                batch_size=BATCH,
                shuffle=True,
                num_workers=workers,
                persistent_workers=True,
                generator=generator,
            )
            for name, lib in (("torch", tud), ("ferry", ferry))
        }
        rates: dict[str, list[float]] = {name: [] for name in loaders}
        for loader in loaders.values():
            _epoch(loader)  # warm-up: the workers start
        for _ in range(args.reps):
            for name, loader in loaders.items():
                rates[name].append(_epoch(loader))
        torch_rate, ferry_rate = (statistics.median(rates[n]) for n in ("torch", "ferry"))
        ratio = ferry_rate / torch_rate
        print(f"{workers:>7} {torch_rate:>10,.0f} {ferry_rate:>10,.0f} {ratio:>10.2f}x")
        del loaders


if __name__ == "__main__":
    main()
