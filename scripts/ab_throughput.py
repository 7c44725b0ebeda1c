"""A/B the steady-state throughput of two ferry source trees, alternating runs.

Used to check that a change costs nothing measurable on the per-batch path (for example the
resume state tracking): inline, 2 process workers, 2 thread workers, and 2 persistent process
workers (one loader, its epochs after the first: where the persistent-workers regression hid).
Each round runs one fresh interpreter per tree and engine, in turn (each tree first in every
other round), so drift of the machine hits both alike; the median over rounds is printed, of
the batches per second and of the CPU time the main thread spent per batch
(``time.thread_time()`` around each epoch): wall time on a shared machine swings by 2x from run
to run, the main thread's CPU far less, so a change to the per-batch path shows there first.

    git worktree add /tmp/base <commit>
    .venv/bin/python scripts/ab_throughput.py /tmp/base/src src --rounds 5
    .venv/bin/python scripts/ab_throughput.py /tmp/base/src src --rounds 15 --engines inline
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
ds = ferry.TensorDataset(torch.randn(256 * 2000, 32), torch.randint(0, 10, (256 * 2000,)))
rates, cpu = [], []
loader = None
for rep in range(4):
    if loader is None or not persistent:
        loader = ferry.DataLoader(ds, batch_size=256, shuffle=True, num_workers=workers,
                                  worker_type=kind, generator=torch.Generator().manual_seed(0),
                                  persistent_workers=persistent)
    it = iter(loader)
    next(it)
    start, clock, count = time.perf_counter(), time.thread_time(), 0
    for _ in it:
        count += 1
    rates.append(count / (time.perf_counter() - start))
    cpu.append((time.thread_time() - clock) / count * 1e6)
print(statistics.median(rates[1:]), statistics.median(cpu[1:]))
"""


def measure(src: str, workers: int, kind: str, persistent: bool) -> tuple[float, float]:
    """(batches per second, the main thread's CPU microseconds per batch) of one run."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    args = [sys.executable, "-c", _RUN, str(workers), kind, str(int(persistent))]
    out = subprocess.run(args, env=env, check=True, capture_output=True, text=True)
    rate, cpu = out.stdout.split()
    return float(rate), float(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("baseline", help="src directory of the baseline tree")
    parser.add_argument("candidate", help="src directory of the candidate tree")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--engines",
        default="inline,process,thread,persistent",
        help="comma-separated: which to run",
    )
    args = parser.parse_args()
    engines = {
        "inline": (0, "process", False),
        "process": (2, "process", False),
        "thread": (2, "thread", False),
        "persistent": (2, "process", True),
    }
    for workers, kind, persistent in (engines[name] for name in args.engines.split(",")):
        runs: dict[str, list[tuple[float, float]]] = {"baseline": [], "candidate": []}
        trees = [("baseline", args.baseline), ("candidate", args.candidate)]
        for round_ in range(args.rounds):
            # Each tree goes first in every other round: the tree run first in a round was
            # favoured by up to 8% on thread workers (the same two trees, in either order).
            for name, src in trees if round_ % 2 == 0 else trees[::-1]:
                runs[name].append(measure(src, workers, kind, persistent))
        (base, base_cpu), (cand, cand_cpu) = (
            (statistics.median(r for r, _ in runs[k]), statistics.median(c for _, c in runs[k]))
            for k in ("baseline", "candidate")
        )
        print(
            f"TensorDataset, batch 256, num_workers={workers}"
            + (f", worker_type={kind!r}" if workers else "")
            + (", persistent_workers=True" if persistent else "")
            + f": baseline {base:,.0f} b/s, "
            f"candidate {cand:,.0f} b/s, candidate/baseline {cand / base:.3f}; main-thread CPU "
            f"per batch {base_cpu:.1f} us, {cand_cpu:.1f} us, {cand_cpu / base_cpu:.3f} "
            f"(median of {args.rounds} alternating rounds)"
        )
        # Paired: each round's candidate over the baseline of the same round, which the
        # machine's drift over the run cannot move; the quartiles say how far rounds spread.
        ratios = [c / b for (b, _), (c, _) in zip(runs["baseline"], runs["candidate"], strict=True)]
        low, mid, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        print(f"  paired per round: candidate/baseline {mid:.3f} (quartiles {low:.3f}-{high:.3f})")


if __name__ == "__main__":
    main()
