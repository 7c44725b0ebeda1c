"""``num_workers="auto"`` on datasets whose every read waits, then computes: the kind of worker
each epoch ran on, its rate, and how much of the GIL the thread workers' reads held.

Each sample sleeps ``latency`` (a network read: the GIL is let go) and then computes ``work``
seconds of Python (the GIL is held). The judge moves process workers to threads where the
reads wait; since the twelfth session, threads whose reads then held the GIL at least
``GIL_BOUND`` CPU seconds a second while the loader was behind become processes again at the
next epoch (docs/design/autotune.md, "Threads found bound by the GIL").

One fresh loader a row, fork, 1,024 samples, batch 32, ``--epochs`` epochs, non-persistent
workers, the loop doing nothing. Each epoch prints as ``t2 5,549/s g0.37``: thread workers, 2 of
them, samples/s, and the reads' CPU seconds a second while on threads (``LoaderStats.read_cpu_s``
over ``read_span_s``; 0 on processes, or on a tree that does not measure it).

    .venv/bin/python scripts/auto_gil.py [--epochs 4] [--src /tmp/base/src] [--bound 0.2]

``--src DIR`` runs another tree's ferry (an A/B); ``--bound`` sets ``GIL_BOUND`` (what the
threads would have done at another bound).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch.utils.data as tud

# ``--src DIR`` runs another tree's ferry (an A/B); it is read before ferry is imported.
_SRC = sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv else None
sys.path.insert(0, _SRC or str(Path(__file__).resolve().parents[1] / "src"))

import ferry  # noqa: E402  (after the path is set)

SAMPLES, BATCH = 1024, 32
# (seconds of sleep, seconds of Python) per read
ROWS = [
    (0.01, 5e-5),
    (0.002, 5e-5),
    (0.0005, 5e-5),
    (0.005, 5e-4),
    (0.02, 1e-3),
    (0.001, 2e-4),
    (0.0, 1e-3),
]


class WaitsThenComputes(tud.Dataset[int]):
    def __init__(self, latency: float, work: float) -> None:
        self.latency, self.work = latency, work

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> int:
        if self.latency:
            time.sleep(self.latency)
        end = time.thread_time() + self.work
        while time.thread_time() < end:
            pass
        return index


def run(latency: float, work: float, epochs: int) -> str:
    loader: Any = ferry.DataLoader(
        WaitsThenComputes(latency, work), batch_size=BATCH, num_workers="auto"
    )
    cells = []
    for _ in range(epochs):
        start = time.perf_counter()
        samples = sum(len(batch) for batch in loader)
        rate = samples / (time.perf_counter() - start)
        stats = loader.stats()
        span = getattr(stats, "read_span_s", 0.0)
        share = getattr(stats, "read_cpu_s", 0.0) / span if span else 0.0
        cells.append(f"{stats.engine[0]}{loader.num_workers} {rate:6,.0f}/s g{share:.2f}")
    return f"{1e3 * latency:5.1f} ms + {1e6 * work:5.0f} us: " + " | ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--src", help="another tree's src/ (read before ferry is imported)")
    parser.add_argument("--bound", type=float, help="GIL_BOUND for this run")
    args = parser.parse_args()
    if args.bound is not None:
        from ferry._engine.tuning import autotune

        autotune.GIL_BOUND = args.bound
    warnings.simplefilter("ignore")  # (the tuner may try more thread workers than CPUs)
    print(f"ferry from {Path(ferry.__file__).parent}")
    for latency, work in ROWS:
        print(run(latency, work, args.epochs), flush=True)


if __name__ == "__main__":
    main()
