"""Memory of a loader whose batches are large, ferry beside torch.

The scenario: batches of 1 GiB (8 samples of 32x1024x1024 float32, ``batch_size=8``; smaller
with ``--sample-mib``), two process workers, a training loop that reads every batch
(``batch.sum()``) and keeps it until the next one arrives (``for batch in loader``). Each run
is a fresh interpreter; while it runs this script samples, about every 20 ms:

* the proportional set size (PSS) of the whole process tree (the loop's process and its
  workers), from ``/proc/<pid>/smaps_rollup``: every page counted once, shared ones split
  between the processes that map them;
* the resident set (RSS) of the main process;
* ``Shmem`` of ``/proc/meminfo`` above what it was when the run began: shared memory that
  exists, mapped or not (system-wide, so another program's shared memory would show too).

The peak of each, over the run, is kept; the table shows the median over ``--rounds`` rounds
(the loaders alternate within a round). ``--impl`` picks the loaders: ``ferry``, ``torch``, and
ferry with every slab kept for reuse (``ferry-reuse``) or carrying one batch (``ferry-one-batch``),
whatever its size (``ferry._engine.transport.shm.REUSE_LIMIT`` set in the run, before the
workers fork).

``--handoff`` measures what that choice costs in time instead: a dataset that returns one
preallocated tensor (so moving the batch is all there is), 2 workers, two epochs of 60 batches
after a warm-up epoch, the loop reading one value per 4 KiB page; milliseconds per batch.

    .venv/bin/python scripts/memory_large_batches.py --rounds 3
    .venv/bin/python scripts/memory_large_batches.py --batches 12 --epochs 2 --persistent
    .venv/bin/python scripts/memory_large_batches.py --batches 40 --sample-mib 4
    .venv/bin/python scripts/memory_large_batches.py --handoff --sample-mib 8 \
        --impl ferry-reuse ferry-one-batch torch
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from ferry._core.memory import proc_kb
from ferry.bench.measure import descendants

_PICK = """
import sys, time, torch
impl = sys.argv[1]
if impl.startswith("ferry"):
    from ferry import DataLoader
    from ferry._engine.transport import shm
    shm.REUSE_LIMIT = {"ferry-reuse": 1 << 62, "ferry-one-batch": 0}.get(impl, shm.REUSE_LIMIT)
else:
    from torch.utils.data import DataLoader
"""

_RUN = (
    _PICK
    + """
batches, workers, epochs, persistent, mib = map(int, sys.argv[2:7])

class Big:
    def __len__(self):
        return batches * 8

    def __getitem__(self, index):
        return torch.full((mib // 4, 1024, 1024), float(index))

loader = DataLoader(Big(), batch_size=8, num_workers=workers,
                    persistent_workers=bool(persistent))
seen = 0
for _ in range(epochs):
    for batch in loader:
        seen += 1
        float(batch.sum())
held = -1
if impl.startswith("ferry") and persistent:
    # Shared memory the loader still maps between epochs (its stats line).
    held = loader.stats().shared_memory_bytes >> 20
print("batches", seen, "shared MiB held after the last epoch", held, flush=True)
"""
)

_HANDOFF = (
    _PICK
    + """
mib = int(sys.argv[2])

class One:
    tensor = torch.ones(mib << 18)

    def __len__(self):
        return 480

    def __getitem__(self, index):
        return self.tensor

loader = DataLoader(One(), batch_size=8, num_workers=2, persistent_workers=True)
for batch in loader:
    pass
start, count = time.perf_counter(), 0
for _ in range(2):
    for batch in loader:
        count += 1
        float(batch[:, ::1024].sum())
print((time.perf_counter() - start) / count * 1000)
"""
)

_MIB = 1 << 20


def _rollup(pid: int, field: str) -> int:
    """``field`` of ``/proc/<pid>/smaps_rollup`` in bytes (0 if the process is gone)."""
    return proc_kb(f"/proc/{pid}/smaps_rollup", field).get(field, 0)


def _shmem() -> int:
    return proc_kb("/proc/meminfo", "Shmem").get("Shmem", 0)


def measure(impl: str, args: argparse.Namespace) -> dict[str, float]:
    """Peak figures (MiB) of one run, and its wall seconds."""
    shm_base = _shmem()
    started = time.perf_counter()
    argv = [impl, args.batches, args.workers, args.epochs, int(args.persistent), args.sample_mib]
    child = subprocess.Popen(
        [sys.executable, "-c", _RUN, *map(str, argv)],
        stdout=subprocess.PIPE,
        text=True,
    )
    peak_pss = peak_rss = peak_shm = 0
    while child.poll() is None:
        pss = sum(_rollup(pid, "Pss") for pid in [child.pid, *descendants(child.pid)])
        peak_pss = max(peak_pss, pss)
        peak_rss = max(peak_rss, _rollup(child.pid, "Rss"))
        peak_shm = max(peak_shm, _shmem() - shm_base)
        time.sleep(args.interval)
    out, _ = child.communicate(timeout=60)
    if child.returncode != 0:
        raise SystemExit(f"{impl} run failed with exit status {child.returncode}")
    print(f"  {impl}: {out.strip()}", file=sys.stderr)
    return {
        "pss": peak_pss / _MIB,
        "rss": peak_rss / _MIB,
        "shm": peak_shm / _MIB,
        "wall": time.perf_counter() - started,
    }


def handoff(impl: str, args: argparse.Namespace) -> float:
    """Milliseconds per batch of one ``--handoff`` run."""
    out = subprocess.run(
        [sys.executable, "-c", _HANDOFF, impl, str(args.sample_mib)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=3, help="batches per epoch")
    parser.add_argument(
        "--sample-mib", type=int, default=128, help="MiB per sample, a multiple of 4 (8 a batch)"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--persistent", action="store_true", help="persistent_workers=True")
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between samples")
    parser.add_argument(
        "--impl",
        nargs="+",
        default=["ferry", "torch"],
        choices=["ferry", "torch", "ferry-reuse", "ferry-one-batch"],
    )
    parser.add_argument("--handoff", action="store_true", help="time per batch, not memory")
    args = parser.parse_args()
    if args.handoff:
        times: dict[str, list[float]] = {impl: [] for impl in args.impl}
        for _ in range(args.rounds):
            for impl in args.impl:
                times[impl].append(handoff(impl, args))
        print(f"batches of {8 * args.sample_mib} MiB moved by 2 process workers; ms per batch")
        for impl, taken in times.items():
            each = ", ".join(f"{t:.1f}" for t in taken)
            print(f"{impl:<16}{statistics.median(taken):>8.1f}   runs: {each}")
        return
    results: dict[str, list[dict[str, float]]] = {impl: [] for impl in args.impl}
    for round_number in range(args.rounds):
        print(f"round {round_number + 1}/{args.rounds}", file=sys.stderr)
        for impl in args.impl:
            results[impl].append(measure(impl, args))
    print(
        f"{args.batches} batches of {8 * args.sample_mib} MiB x {args.epochs} epoch(s), "
        f"{args.workers} process "
        f"workers{', persistent' if args.persistent else ''}; median of {args.rounds} runs, MiB"
    )
    header = f"{'loader':<16}{'peak PSS (tree)':>17}{'peak RSS (main)':>17}{'peak Shmem':>12}"
    print(header + f"{'wall s':>8}   runs (PSS)")
    for impl, runs in results.items():
        pss, rss, shm, wall = (
            statistics.median(run[key] for run in runs) for key in ("pss", "rss", "shm", "wall")
        )
        each = ", ".join(f"{run['pss']:.0f}" for run in runs)
        print(f"{impl:<16}{pss:>17.0f}{rss:>17.0f}{shm:>12.0f}{wall:>8.1f}   {each}")


if __name__ == "__main__":
    main()
