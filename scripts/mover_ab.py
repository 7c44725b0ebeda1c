"""The mover's modes side by side in the scaling mode: ferry's process workers moved by the
default mode ("even": those behind to the fastest CPUs) and by the one before it ("swap":
trading places only), beside torch and the roof, alternating epoch by epoch and paired by
round as ``ferry bench --scaling`` pairs them (docs/design/scaling.md, "Those behind to the
fastest CPUs").

    PYTHONPATH=src python3 scripts/mover_ab.py --workers 15 --only jpeg --reps 20 --feed gpu \
        --json OUT.json

Prints a line per row as it ends, then each row's table: each side's median rate, its share of
the roof and its ratio to torch (medians of each round's ratio), and even over swap (the median
of each round's ratio, with every round's). ``--modes`` picks other modes (any of even, swap,
rotate); the first is the side called "ferry".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from ferry._engine.crew import placement
from ferry.bench import scaling


def _sides(modes: Sequence[str]) -> tuple[tuple[str, str, tuple[tuple[str, Any], ...]], ...]:
    ferry = (("ferry" if i == 0 else f"ferry {mode}", "ferry", ()) for i, mode in enumerate(modes))
    return (("torch", "torch", ()), *ferry)


def _with_modes(modes: Sequence[str]) -> None:
    """Each ferry side's epochs (the first one makes its mover) under its mode."""
    run_epoch = scaling._epoch
    by_label = {("ferry" if i == 0 else f"ferry {m}"): m for i, m in enumerate(modes)}

    def epoch(side: Any, step: Any, timeout_s: float) -> float:
        before = placement.MODE
        placement.MODE = by_label.get(side.label, before)
        try:
            return run_epoch(side, step, timeout_s)
        finally:
            placement.MODE = before

    scaling.SIDES = _sides(modes)
    scaling._epoch = epoch


def _paired(row: scaling.ScalingRow, label: str, base: str) -> list[float]:
    side, other = row.side(label), row.side(base)
    if side is None or other is None:
        return []
    return [a / b for a, b in zip(side.epochs, other.epochs, strict=False) if b]


def _table(rows: Sequence[scaling.ScalingRow], modes: Sequence[str]) -> str:
    lines = []
    labels = [label for label, _, _ in _sides(modes)]
    for row in rows:
        lines.append(
            f"{row.workload} x{row.workers}: {row.batches} batches of {row.batch_size}, "
            f"{len(row.roof_rounds)} rounds, roof {row.roof or 0:,.0f}/s"
        )
        for label in labels:
            side = row.side(label)
            if side is None:
                continue
            if side.error:
                lines.append(f"  {label:<12} failed: {side.error}")
                continue
            share, over = row.share_of_roof(label), row.over_torch(label)
            lines.append(
                f"  {label:<12} {side.samples_per_s or 0:>10,.0f}/s  "
                f"{(share or 0):6.1%} roof  {(over or 0):5.2f}x torch"
            )
        for mode in modes[1:]:
            ratios = _paired(row, "ferry", f"ferry {mode}")
            if ratios:
                lines.append(
                    f"  {modes[0]} / {mode}: median {statistics.median(ratios):.3f} over "
                    f"{len(ratios)} rounds ({' '.join(f'{r:.2f}' for r in ratios)})"
                )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2])
    parser.add_argument("--only", choices=sorted(scaling.SCALING_WORKLOADS), default=None)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--feed", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--modes", nargs="+", default=["even", "swap"])
    parser.add_argument("--batches-per-worker", type=int, default=None)
    parser.add_argument("--budget", type=float, default=None, help="seconds; no row after")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--quick", action="store_true", help="tiny batches (a smoke test)")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    unknown = set(args.modes) - {"even", "swap", "rotate"}
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; expected even, swap or rotate")
    _with_modes(args.modes)
    config = scaling.ScalingConfig(
        workloads=(args.only,) if args.only else tuple(scaling.SCALING_WORKLOADS),
        workers=tuple(args.workers),
        reps=args.reps,
        feed=args.feed,
        quick=args.quick,
        threads=False,
        batches_per_worker=args.batches_per_worker,
        timeout_s=args.timeout,
        budget_s=args.budget,
    )
    started = time.perf_counter()

    def keep(rows: Sequence[scaling.ScalingRow]) -> None:
        if args.json:
            with open(args.json, "w") as out:
                json.dump([asdict(row) for row in rows], out, indent=1)

    rows = scaling.run_scaling(config, lambda line: print(line, flush=True), keep)
    print(_table(rows, args.modes))
    print(f"mover_ab: {time.perf_counter() - started:.0f} s")
    return 0 if all(row.error is None and not row.skipped for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
