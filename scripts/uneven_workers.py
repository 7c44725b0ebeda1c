"""One worker slower than the others: torch's turns, torch's ``in_order=False``, and ferry's
turns, ``in_order=False`` and ``balance_workers=True``, side by side.

Worker 0 sleeps 3 ms a sample and the others 2 ms: 1.5x apart, about what the GPU host's vCPUs
differ by (docs/design/scaling.md). Sleeping, so that the 4 workers do not crowd 2 cores. 4
workers, batch 8, 96 batches an epoch, ``prefetch_factor=4``, persistent workers. A warm-up
epoch of each side, then epochs of the sides in turn; each side's median, in samples/s.

    .venv/bin/python scripts/uneven_workers.py [--reps 9] [--src /tmp/base/src]

Beside them: the round-robin bound (the slow worker's share, at its speed: where loaders that
deal batches in turns end) and the summed rates of the workers (where none waits).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.utils.data as tud

# ``--src DIR`` runs another tree's ferry (an A/B); it is read before ferry is imported.
_SRC = sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv else None
sys.path.insert(0, _SRC or str(Path(__file__).resolve().parents[1] / "src"))

import ferry  # noqa: E402  (after the path is set)

SLOW_S, FAST_S = 0.003, 0.002
SAMPLES, BATCH, WORKERS = 768, 8, 4


class Uneven:
    """Sample ``i`` is ``i``; worker 0 takes ``SLOW_S`` a sample, the others ``FAST_S``."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> int:
        info = tud.get_worker_info() or ferry.get_worker_info()
        time.sleep(SLOW_S if info is not None and info.id == 0 else FAST_S)
        return index


def sides() -> dict[str, Callable[[], Any]]:
    def make(lib: Any, **options: Any) -> Callable[[], Any]:
        return lambda: lib.DataLoader(
            Uneven(),
            batch_size=BATCH,
            num_workers=WORKERS,
            persistent_workers=True,
            prefetch_factor=4,
            **options,
        )

    return {
        "torch": make(tud),
        "torch in_order=False": make(tud, in_order=False),
        "ferry": make(ferry),
        "ferry in_order=False": make(ferry, in_order=False),
        "ferry balance_workers=True": make(ferry, balance_workers=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=9, help="measured epochs a side")
    parser.add_argument("--src", help="the ferry source tree to run (default: this one's)")
    args = parser.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (torch: more workers than CPUs)
        loaders = {name: build() for name, build in sides().items()}
    times: dict[str, list[float]] = {name: [] for name in loaders}
    for rep in range(args.reps + 1):
        for name, loader in loaders.items():
            began = time.perf_counter()
            seen = [x for batch in loader for x in batch.tolist()]
            if rep:
                times[name].append(time.perf_counter() - began)
            want = list(range(SAMPLES))
            assert (seen if "in_order=False" not in name else sorted(seen)) == want, name
    bound = SAMPLES / (SAMPLES / WORKERS * SLOW_S)
    summed = (WORKERS - 1) / FAST_S + 1 / SLOW_S
    print(f"round-robin bound {bound:,.0f} samples/s; the workers' summed rates {summed:,.0f}")
    for name, seconds in times.items():
        print(
            f"{name:28s} {SAMPLES / statistics.median(seconds):7,.0f} samples/s "
            f"(epochs {min(seconds) * 1e3:.0f}-{max(seconds) * 1e3:.0f} ms)"
        )


if __name__ == "__main__":
    main()
