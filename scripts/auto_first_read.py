"""``num_workers="auto"`` on datasets whose first read differs from the rest: which worker kind
it settles on, and how long an epoch takes, against fixed process workers.

* ``opens-file``: each process opens its file at its first read (20 ms of waiting, by whichever
  read finds it closed: the common lazy-handle pattern), then each sample computes ``--work``
  seconds of Python. Process workers are right for it.
* ``waits``: every read waits ``--latency`` (a network read) and computes 50 us. Threads are
  right for it.
* ``opens-twice``: each process's first two reads wait 20 ms (a file opened, then its index
  read), then each computes ``--work`` seconds of Python: the first read and the probe after
  it both wait, the reads after them compute. Process workers are right for it.

One fresh loader per run (``"auto"`` decides in the first epoch), fork, batch 32, 1,024
samples, ``--epochs`` epochs (workers that do not persist: each epoch's open their files
again); each row's median over ``--reps`` runs, the sides in turn. With ``--sweep``, only
``opens-file`` under ``"auto"``, at 0.5 to 8 ms of work a sample, 3 runs each: the worker
kind each run ended on (``p``/``t``).

    .venv/bin/python scripts/auto_first_read.py [--reps 5] [--epochs 3] [--src /tmp/base/src]
    .venv/bin/python scripts/auto_first_read.py --sweep
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch.utils.data as tud

# ``--src DIR`` runs another tree's ferry (an A/B); it is read before ferry is imported.
_SRC = sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv else None
sys.path.insert(0, _SRC or str(Path(__file__).resolve().parents[1] / "src"))

import ferry  # noqa: E402  (after the path is set)

SAMPLES, BATCH = 1024, 32


class OpensFile(tud.Dataset[int]):
    def __init__(self, work: float) -> None:
        self.work = work
        self.handle: object | None = None

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> int:
        if self.handle is None:
            time.sleep(0.02)
            self.handle = object()
        end = time.thread_time() + self.work
        while time.thread_time() < end:
            pass
        return index


class OpensTwice(OpensFile):
    def __init__(self, work: float) -> None:
        super().__init__(work)
        self.opened = 0

    def __getitem__(self, index: int) -> int:
        if self.opened < 2:
            self.opened += 1
            time.sleep(0.02)
        return super().__getitem__(index)


class Waits(tud.Dataset[int]):
    def __init__(self, latency: float) -> None:
        self.latency = latency

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> int:
        time.sleep(self.latency)
        end = time.thread_time() + 0.00005
        while time.thread_time() < end:
            pass
        return index


Run = tuple[float, str, float, float, float]


def _epoch(dataset: Any, workers: Any, epochs: int = 1) -> Run:
    """One fresh loader's ``epochs`` epochs: the first's seconds, the engine it ended on,
    when its first and second batches came, and the median seconds of the later epochs
    (0: one epoch)."""
    loader: ferry.DataLoader[Any] = ferry.DataLoader(
        dataset, batch_size=BATCH, num_workers=workers, multiprocessing_context="fork"
    )
    start = time.perf_counter()
    came = []
    for _ in loader:
        if len(came) < 2:
            came.append(time.perf_counter() - start)
    took = time.perf_counter() - start
    stats = loader.stats()
    engine = stats.engine if stats is not None else "?"
    later = []
    for _ in range(epochs - 1):
        begun = time.perf_counter()
        for _ in loader:
            pass
        later.append(time.perf_counter() - begun)
    return took, engine, came[0], came[1], statistics.median(later) if later else 0.0


def _sweep() -> None:
    kinds = []
    for work in (0.0005, 0.001, 0.002, 0.003, 0.004, 0.008):
        ended = "".join(_epoch(OpensFile(work), "auto")[1][0] for _ in range(3))
        kinds.append(f"{work * 1e3:g} ms: {ended}")
    print(f"ferry from {ferry.__file__}; opens-file, auto: " + ", ".join(kinds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--work", type=float, default=0.001, help="opens-file: CPU s/sample")
    parser.add_argument("--latency", type=float, default=0.01, help="waits: s/sample")
    parser.add_argument("--src", default=None, help="another tree's src (read before import)")
    parser.add_argument("--epochs", type=int, default=1, help="epochs a loader (later: median)")
    parser.add_argument("--sweep", action="store_true", help="opens-file at 0.5-8 ms of work")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    if args.sweep:
        _sweep()
        return
    rows = [
        ("opens-file", OpensFile(args.work), "auto"),
        ("opens-file", OpensFile(args.work), 2),
        ("waits", Waits(args.latency), "auto"),
        ("waits", Waits(args.latency), 2),
        ("opens-twice", OpensTwice(args.work * 4), "auto"),
        ("opens-twice", OpensTwice(args.work * 4), 2),
    ]
    runs: dict[int, list[Run]] = {i: [] for i in range(len(rows))}
    for _ in range(args.reps):
        for i, (_, dataset, workers) in enumerate(rows):
            runs[i].append(_epoch(dataset, workers, args.epochs))
    print(f"ferry from {ferry.__file__}; {args.reps} runs a row, medians")
    print(
        "| dataset | num_workers | epoch 0 samples/s | first batch ms | second | ended on "
        "| later epochs samples/s |"
    )
    print("| --- | --- | --: | --: | --: | --- | --: |")
    for i, (name, _, workers) in enumerate(rows):
        took = statistics.median(r[0] for r in runs[i])
        first = statistics.median(r[2] for r in runs[i])
        second = statistics.median(r[3] for r in runs[i])
        ended = ", ".join(f"{k} x{n}" for k, n in Counter(r[1] for r in runs[i]).items())
        later = statistics.median(r[4] for r in runs[i])
        print(
            f"| {name} | {workers} | {SAMPLES / took:,.0f} | {first * 1e3:.1f} | "
            f"{second * 1e3:.1f} | {ended} | {f'{SAMPLES / later:,.0f}' if later else '-'} |"
        )


if __name__ == "__main__":
    main()
