"""A/B of ``pin_memory=True`` with workers on a machine without an accelerator.

Pinning needs an accelerator; here it is replaced by a stand-in of the same shape (a copy of
every tensor of the batch, which, like the copy into pinned memory, releases the GIL), so what
is measured is where that copy runs: in the loop's ``next()`` or beside it. Each round runs
one fresh interpreter per tree and setting, in turn; the median over rounds is printed, in
batches per second. ``step`` is the simulated training step per batch (a sleep), in ms.

    git worktree add /tmp/base <commit>
    .venv/bin/python scripts/pin_standin.py /tmp/base/src src --rounds 5

The real figure needs a GPU: ``examples/gpu_handoff.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

_RUN = """
import statistics, sys, time, torch, ferry, ferry.loader, ferry._engine.transport.pin as pin
ferry.loader.accelerator_available = lambda: True
pin._pin_tensor = lambda tensor, device: tensor.clone()
workers, step = int(sys.argv[1]), float(sys.argv[2]) / 1000
n = 1024 * 64
ds = ferry.TensorDataset(torch.randn(n, 256), torch.randint(0, 10, (n,)))
loader = ferry.DataLoader(ds, batch_size=1024, shuffle=True, num_workers=workers,
                          pin_memory=True, persistent_workers=True,
                          generator=torch.Generator().manual_seed(0))
rates = []
for rep in range(4):
    it = iter(loader)
    next(it)
    start, count = time.perf_counter(), 0
    for _ in it:
        if step:
            time.sleep(step)
        count += 1
    rates.append(count / (time.perf_counter() - start))
print(statistics.median(rates[1:]))
"""


def rate(src: str, workers: int, step: float) -> float:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    out = subprocess.run(
        [sys.executable, "-c", _RUN, str(workers), str(step)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("a", help="source folder of tree A (the one holding ferry/)")
    parser.add_argument("b", help="source folder of tree B")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", default="0,2", help="training steps to try, in ms")
    args = parser.parse_args()
    steps = [float(s) for s in args.steps.split(",")]
    results: dict[tuple[str, float], list[float]] = {}
    for _ in range(args.rounds):
        for step in steps:
            for tree in (args.a, args.b):
                results.setdefault((tree, step), []).append(rate(tree, args.workers, step))
    print(f"{args.workers} process workers, 1 MiB batches, stand-in pin (a copy)")
    print(f"{'step ms':>8} {'A b/s':>9} {'B b/s':>9} {'B/A':>6}")
    for step in steps:
        a = statistics.median(results[(args.a, step)])
        b = statistics.median(results[(args.b, step)])
        print(f"{step:>8g} {a:>9.1f} {b:>9.1f} {b / a:>6.2f}")


if __name__ == "__main__":
    main()
