"""Do this machine's CPUs differ in speed, and would moving workers between them even it out?

On the 16-vCPU GPU host, plain processes doing equal shares of the jpeg work (the scaling
mode's roof) ran 1.3-1.4x apart, in two groups at 15 processes (docs/design/scaling.md, "On the
GPU host"). A loader that deals batches to workers in turns, as torch does (and ferry by
default, so that each worker's random draws are torch's), ends an epoch with its slowest worker.
If the speed belongs to the CPU a process sits on (and Linux leaves a busy process where it is),
then moving the workers round the CPUs would give each the average speed, and turns would reach
the summed roof; if it belongs to the process, or changes from second to second, it would not.

Three measurements, in about 40 seconds on 16 CPUs (the jpeg work needs Pillow and numpy):

* ``topology``: each allowed CPU's core, package and SMT siblings, and its MHz where shown.
* ``map``: N processes, each pinned to one CPU, all decoding at once for ``--seconds``; three
  rounds, the processes shifted one CPU further each round. Each CPU's rate per round, and how
  much of the spread follows the CPU (the rates of one CPU agree across rounds) rather than
  the process.
* ``deal``: N processes, each an equal share of ``--samples`` (the roof's way), timed from one
  start to the last one's end, four ways: free (the scheduler places them), pinned (process
  i on CPU i), rotating (pinned, and the whole assignment shifted one CPU every
  ``--period-ms``), nudged (free, but every period each process is moved to the CPU the next
  one is on, and set free again: the processes swap places among the CPUs they hold, and stay
  free for the scheduler). The last two are ferry's own mover (``move_workers``,
  ``ferry._engine.crew.placement``) in its two modes. Samples/s over the slowest, each
  process's rate, and steal time.

    PYTHONPATH=src python3 scripts/cpu_speeds.py --json OUT/cpu_speeds.json

On a machine whose CPUs are alike (this 2-core one) the four ways of ``deal`` agree.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT / "src"))

from ferry._engine.crew.placement import WorkerMover  # noqa: E402
from ferry.bench.workloads import JpegCrops, _prepare_photos  # noqa: E402

_Conn = Any


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def topology(cpus: list[int]) -> list[dict[str, Any]]:
    """Each CPU's core, package, SMT siblings and current MHz, where Linux shows them."""
    mhz: dict[int, float] = {}
    try:
        current = -1
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("processor"):
                current = int(line.split(":")[1])
            elif line.startswith("cpu MHz") and current >= 0:
                mhz[current] = float(line.split(":")[1])
    except OSError:
        pass
    out = []
    for cpu in cpus:
        base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")

        def read(name: str, base: Path = base) -> str | None:
            try:
                return (base / name).read_text().strip()
            except OSError:
                return None

        out.append(
            {
                "cpu": cpu,
                "core": read("core_id"),
                "package": read("physical_package_id"),
                "siblings": read("thread_siblings_list"),
                "mhz": mhz.get(cpu),
            }
        )
    return out


def steal() -> dict[int, int]:
    """Steal ticks per CPU from /proc/stat (the 8th field), empty where not shown."""
    out = {}
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            parts = line.split()
            if parts[0].startswith("cpu") and parts[0] != "cpu" and len(parts) > 8:
                out[int(parts[0][3:])] = int(parts[8])
    except OSError:
        pass
    return out


class Nudger:
    """ferry's own mover (:class:`ferry._engine.crew.placement.WorkerMover`, as
    ``move_workers`` runs it) over the processes ``pids()`` names, every ``period_s`` while
    the block runs: torch's workers, ferry's or plain processes alike. ``mode``: "swap" (trade
    CPUs, then set free) or "rotate" (pinned, shifted one CPU a period)."""

    def __init__(self, pids: Callable[[], list[int]], period_s: float, mode: str = "swap") -> None:
        self.mover = WorkerMover(pids, mode=mode, period_s=period_s)

    @property
    def moves(self) -> int:
        return self.mover.moves

    def __enter__(self) -> Nudger:
        self.mover.resume()
        return self

    def __exit__(self, *exc: object) -> None:
        self.mover.close()


def _decode_for(dataset: JpegCrops, seconds: float, start: Any, conn: _Conn, cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    dataset[0]
    start.wait()
    began = time.perf_counter()
    done, index = 0, 0
    while time.perf_counter() - began < seconds:
        dataset[index]
        index += 1
        done += 1
    conn.send(done / (time.perf_counter() - began))
    conn.close()


def _decode_share(dataset: JpegCrops, share: range, start: Any, conn: _Conn, cpu: int) -> None:
    if cpu >= 0:
        os.sched_setaffinity(0, {cpu})
    dataset[share[0]]
    start.wait()
    began = time.perf_counter()
    for index in share:
        dataset[index]
    ended = time.perf_counter()
    conn.send((began, ended, len(share) / (ended - began)))
    conn.close()


def speed_map(
    dataset: JpegCrops, cpus: list[int], procs: int, seconds: float, rounds: int
) -> dict[str, Any]:
    """Each CPU's rate in each round; process i sits on CPU ``cpus[(i + round) % len(cpus)]``."""
    ctx = multiprocessing.get_context("fork")
    per_round: list[dict[int, float]] = []
    for shift in range(rounds):
        start = ctx.Event()
        placed = [cpus[(i + shift) % len(cpus)] for i in range(procs)]
        pipes, children = [], []
        for cpu in placed:
            here, there = ctx.Pipe(duplex=False)
            child = ctx.Process(target=_decode_for, args=(dataset, seconds, start, there, cpu))
            child.start()
            pipes.append(here)
            children.append(child)
        time.sleep(0.5)  # the warm-up sample
        start.set()
        rates = {cpu: pipe.recv() for cpu, pipe in zip(placed, pipes, strict=True)}
        for child in children:
            child.join(10)
        per_round.append(rates)
    seen = sorted({cpu for rates in per_round for cpu in rates})
    both = [cpu for cpu in seen if sum(cpu in rates for rates in per_round) >= 2]
    # How much of the spread follows the CPU: the spread of each CPU's mean over rounds, against
    # the spread of all readings (1.0: all of it; near 0: none).
    all_rates = [rate for rates in per_round for rate in rates.values()]
    cpu_means = [statistics.fmean(r[cpu] for r in per_round if cpu in r) for cpu in both]
    follows = (
        statistics.pstdev(cpu_means) / statistics.pstdev(all_rates)
        if len(both) > 1 and statistics.pstdev(all_rates) > 0
        else None
    )
    return {
        "rounds": [
            {str(cpu): round(rate, 1) for cpu, rate in rates.items()} for rates in per_round
        ],
        "spread": max(all_rates) / min(all_rates),
        "follows_cpu": follows,
    }


def deal(
    dataset: JpegCrops, cpus: list[int], procs: int, samples: int, *, how: str, period_s: float
) -> dict[str, Any]:
    """Equal shares in ``procs`` processes, placed ``how``: free, pinned, rotating or nudged."""
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    each = samples // procs
    pipes, children = [], []
    for i in range(procs):
        here, there = ctx.Pipe(duplex=False)
        cpu = cpus[i % len(cpus)] if how == "pinned" else -1  # (the mover pins "rotating")
        share = range(i * each, (i + 1) * each)
        child = ctx.Process(target=_decode_share, args=(dataset, share, start, there, cpu))
        child.start()
        pipes.append(here)
        children.append(child)
    time.sleep(0.5)
    stolen = steal()
    began = time.perf_counter()
    moves = 0
    if how in {"rotating", "nudged"}:

        def alive() -> list[int]:
            return [c.pid for c in children if c.is_alive() and c.pid is not None]

        mode = "rotate" if how == "rotating" else "swap"
        with Nudger(alive, period_s, mode) as nudger:
            start.set()
            results = [pipe.recv() for pipe in pipes]
        moves = nudger.moves
    else:
        start.set()
        results = [pipe.recv() for pipe in pipes]
    for child in children:
        child.join(10)
    last = max(ended for _, ended, _ in results)
    rates = [rate for _, _, rate in results]
    after = steal()
    return {
        "how": how,
        "samples_per_s": each * procs / (last - began),
        "sum_of_rates": sum(rates),
        "per_process": [round(rate, 1) for rate in rates],
        "spread": max(rates) / min(rates),
        "moves": moves,
        "steal_ticks": sum(after.get(cpu, 0) - stolen.get(cpu, 0) for cpu in cpus),
    }


def main() -> int:
    cpus = allowed_cpus()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=max(1, len(cpus) - 1))
    parser.add_argument("--seconds", type=float, default=2.0, help="each round of the map")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=0, help="default: 300 a process")
    parser.add_argument("--period-ms", type=float, default=50.0)
    parser.add_argument("--repeat", type=int, default=2, help="passes over the four ways")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    procs = min(args.procs, len(cpus))
    samples = args.samples or 300 * procs
    dataset = JpegCrops(_prepare_photos(samples, False), samples)

    report: dict[str, Any] = {"cpus": cpus, "procs": procs, "topology": topology(cpus)}
    print(f"{len(cpus)} CPUs allowed, {procs} processes")
    for row in report["topology"]:
        print(
            f"  cpu {row['cpu']}: core {row['core']} package {row['package']} "
            f"siblings {row['siblings']} MHz {row['mhz']}"
        )
    report["map"] = speed_map(dataset, cpus, procs, args.seconds, args.rounds)
    print("map (samples/s by CPU, one line a round):")
    for rates in report["map"]["rounds"]:
        print(
            "  "
            + " ".join(
                f"{cpu}:{rate:.0f}"
                for cpu, rate in sorted(rates.items(), key=lambda kv: int(kv[0]))
            )
        )
    follows = report["map"]["follows_cpu"]
    print(
        f"  spread {report['map']['spread']:.2f}x; share of the spread that follows the CPU: "
        + ("n/a" if follows is None else f"{follows:.2f}")
    )
    report["deal"] = []
    for _ in range(args.repeat):
        for how in ("free", "pinned", "rotating", "nudged"):
            row = deal(dataset, cpus, procs, samples, how=how, period_s=args.period_ms / 1000)
            report["deal"].append(row)
            print(
                f"deal {how:8s}: {row['samples_per_s']:8.1f} samples/s over the slowest, "
                f"sum of rates {row['sum_of_rates']:8.1f} "
                f"({row['samples_per_s'] / row['sum_of_rates']:.0%}), "
                f"spread {row['spread']:.2f}x, moves {row['moves']}, steal {row['steal_ticks']}"
            )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
