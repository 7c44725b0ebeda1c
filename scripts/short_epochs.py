"""Short epochs of fresh process workers, in a small and a large main process: torch against
one or two ferry source trees, alternating, CPU time included.

A validation pass, a small dataset, a test: epochs of a dozen batches, each with workers forked
afresh. What such an epoch costs grows with the main process (a fork copies its page tables,
and anything a worker does that walks its memory walks what it inherited), so each side runs
twice: after ``import torch`` alone ("small", about 225 MB), and after importing Lightning,
transformers, accelerate, datasets and hypothesis too ("large", about 470 MB), as a training
script or a test session does. Per epoch: the wall time, and the CPU time of the main process
and of its (reaped) workers. Each figure is the median over rounds of a 40-epoch run; each round
runs every side in a fresh interpreter, in turn.

    .venv/bin/python scripts/short_epochs.py --rounds 3
    .venv/bin/python scripts/short_epochs.py --rounds 3 --baseline /tmp/base/src
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

_RUN = """
import resource, sys, time
if sys.argv[2] == "large":
    import accelerate, datasets, hypothesis, lightning, transformers
import torch
import torch.utils.data as tud
import ferry
module = tud if sys.argv[1] == "torch" else ferry
data = list(range(12))
def cpu():
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime
for _ in module.DataLoader(data, batch_size=3, num_workers=2):
    pass
own, kids = cpu()
start = time.perf_counter()
for _ in range(40):
    for _ in module.DataLoader(data, batch_size=3, num_workers=2):
        pass
wall = time.perf_counter() - start
own2, kids2 = cpu()
print(wall / 40, (own2 - own) / 40, (kids2 - kids) / 40)
"""


def run(side: str, src: str | None, size: str) -> tuple[float, float, float]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.path.abspath(src)
    lib = "torch" if src is None else "ferry"
    out = subprocess.run(
        [sys.executable, "-c", _RUN, lib, size],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout.split()
    wall, own, kids = map(float, out)
    return wall, own, kids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", help="src directory of a ferry tree to compare with")
    parser.add_argument("--candidate", default="src", help="src directory (default: src)")
    args = parser.parse_args()
    sides: list[tuple[str, str | None]] = [("torch", None)]
    if args.baseline:
        sides.append(("ferry baseline", args.baseline))
    sides.append(("ferry", args.candidate))
    for size in ("small", "large"):
        figures: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _ in sides}
        for round_ in range(args.rounds):
            order = sides if round_ % 2 == 0 else sides[::-1]
            for name, src in order:
                figures[name].append(run(name, src, size))
        print(f"{size} main process: per epoch of 2 fresh workers, 4 batches of 3 (ms)")
        print(f"  {'side':16} {'wall':>6} {'main CPU':>9} {'workers CPU':>12}")
        for name, _ in sides:
            wall, own, kids = (statistics.median(f[i] for f in figures[name]) for i in range(3))
            print(f"  {name:16} {wall * 1e3:6.1f} {own * 1e3:9.1f} {kids * 1e3:12.1f}")


if __name__ == "__main__":
    main()
