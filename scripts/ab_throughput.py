"""A/B the steady-state throughput of two ferry source trees, alternating runs.

Used to check that a change costs nothing measurable on the per-batch path (for example the
resume state tracking): inline, 2 process workers, 2 thread workers, and 2 persistent process
workers (one loader, its epochs after the first: where the persistent-workers regression hid).
Each round runs one fresh interpreter per tree and engine, in turn, so drift of the machine hits
both alike; the median over rounds is printed.

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
rates = []
loader = None
for rep in range(4):
    if loader is None or not persistent:
        loader = ferry.DataLoader(ds, batch_size=256, shuffle=True, num_workers=workers,
                                  worker_type=kind, generator=torch.Generator().manual_seed(0),
                                  persistent_workers=persistent)
    it = iter(loader)
    next(it)
    start, count = time.perf_counter(), 0
    for _ in it:
        count += 1
    rates.append(count / (time.perf_counter() - start))
print(statistics.median(rates[1:]))
"""


def rate(src: str, workers: int, kind: str, persistent: bool) -> float:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    args = [sys.executable, "-c", _RUN, str(workers), kind, str(int(persistent))]
    out = subprocess.run(args, env=env, check=True, capture_output=True)
    return float(out.stdout)


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
        runs: dict[str, list[float]] = {"baseline": [], "candidate": []}
        for _ in range(args.rounds):
            runs["baseline"].append(rate(args.baseline, workers, kind, persistent))
            runs["candidate"].append(rate(args.candidate, workers, kind, persistent))
        base, cand = (statistics.median(runs[k]) for k in ("baseline", "candidate"))
        print(
            f"TensorDataset, batch 256, num_workers={workers}"
            + (f", worker_type={kind!r}" if workers else "")
            + (", persistent_workers=True" if persistent else "")
            + f": baseline {base:,.0f} b/s, "
            f"candidate {cand:,.0f} b/s, candidate/baseline {cand / base:.3f} "
            f"(median of {args.rounds} alternating rounds)"
        )


if __name__ == "__main__":
    main()
