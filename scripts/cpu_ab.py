"""A/B the main thread's CPU time per batch of two ferry source trees, alternating runs.

Wall time on a shared machine swings by 2x from run to run; the CPU time the main thread
spends per batch (``time.thread_time()`` around each epoch) moves far less, so a change to the
per-batch path shows here first. TensorDataset float32[32], batch 256, 1,000 batches an epoch,
shuffled; median of epochs 1-4 per run, median over alternating runs, for inline, 2 thread
workers, and 2 process workers with and without persistent workers.

    git worktree add /tmp/base <commit>
    .venv/bin/python scripts/cpu_ab.py /tmp/base/src src --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

_RUN = """
import statistics, sys, time, torch, ferry
workers, kind, persistent = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
ds = ferry.TensorDataset(torch.randn(256 * 1000, 32), torch.randint(0, 10, (256 * 1000,)))
loader = None
cpu = []
for rep in range(5):
    if loader is None or not persistent:
        loader = ferry.DataLoader(ds, batch_size=256, shuffle=True, num_workers=workers,
                                  worker_type=kind, generator=torch.Generator().manual_seed(0),
                                  persistent_workers=persistent)
    it = iter(loader)
    next(it)
    start, count = time.thread_time(), 0
    for _ in it:
        count += 1
    cpu.append((time.thread_time() - start) / count * 1e6)
print(statistics.median(cpu[1:]))
"""

ENGINES = (
    ("inline", 0, "process", False),
    ("2 thread workers", 2, "thread", False),
    ("2 process workers, persistent", 2, "process", True),
    ("2 process workers", 2, "process", False),
)


def _run(tree: str, workers: int, kind: str, persistent: bool) -> float:
    env = dict(os.environ, PYTHONPATH=tree)
    args = [sys.executable, "-c", _RUN, str(workers), kind, "1" if persistent else "0"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("baseline", help="the baseline tree's src folder")
    parser.add_argument("candidate", help="the candidate tree's src folder")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for name, workers, kind, persistent in ENGINES:
        runs: dict[str, list[float]] = {args.baseline: [], args.candidate: []}
        for _ in range(args.rounds):
            for tree, rates in runs.items():
                rates.append(_run(tree, workers, kind, persistent))
        base, cand = (statistics.median(runs[t]) for t in (args.baseline, args.candidate))
        print(
            f"{name}: main-thread CPU per batch, baseline {base:.1f} us, candidate {cand:.1f} "
            f"us, candidate/baseline {cand / base:.3f} (median of {args.rounds} alternating runs)"
        )


if __name__ == "__main__":
    main()
