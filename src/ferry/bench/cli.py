"""The ``bench`` subcommand: parse the options, run the suite, print and save the report.

Exit codes: 0 when every row ran, 1 when some row failed (its error is in the table), 2 for
bad arguments or a missing optional dependency, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ferry._cli import MissingExtra, positive_int, prepare_output, require_matplotlib, seconds
from ferry.bench.latency import format_latency
from ferry.bench.report import format_table, metadata, to_json, write_plot
from ferry.bench.resume import ResumeRow, format_resume, run_resume, time_state_dict
from ferry.bench.runner import Config, run_suite
from ferry.bench.scaling import SCALING_WORKLOADS
from ferry.bench.workloads import WORKLOADS

__all__ = ["config_from_args", "configure", "default_workloads", "run"]

DESCRIPTION = """\
Runs built-in workloads (data made on the fly, nothing downloaded) through
torch.utils.data.DataLoader and ferry.DataLoader with identical arguments, alternating the two,
and prints a table of medians: batches/s and their ratio, CPU per batch, peak memory, time to
the first batch, and the memcpy bound of each batch's bytes. The I/O-latency workloads (io10,
io50) get a second table: samples/s beside the bound that the loader's concurrency C allows at
the latency L (C/L) and the CPU bound.

The default run takes about 2 minutes on 2 idle cores. --io runs the I/O rows at full size (io10 and
io50, 1,024 samples: about 6 minutes more). --scaling runs the scaling mode instead: the jpeg
and uint8 workloads at 1, 2, 4, ... workers (--workers-list), each loader against the roof (the
same dataset work in N plain processes, no loader), with the GPU feed where CUDA is present."""


def _workload_names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    known = {**WORKLOADS, **SCALING_WORKLOADS}
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown workload {', '.join(map(repr, unknown)) or repr(text)}; "
            f"choose from {', '.join(WORKLOADS)} (with --scaling: "
            f"{', '.join(SCALING_WORKLOADS)})"
        )
    return tuple(dict.fromkeys(names))


def default_workloads(io: bool, quick: bool = False) -> tuple[str, ...]:
    """The workloads of a run without ``--only``: every family; io50 (about 26 s a run with
    workers at full size) with ``--io``, or under ``--quick``, where its runs are 8 samples."""
    return tuple(name for name in WORKLOADS if io or quick or name != "io50")


def _worker_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or any(count < 0 for count in counts):
        raise argparse.ArgumentTypeError(
            f"expected a worker count >= 0 (or several, comma-separated), got {text!r}"
        )
    return tuple(dict.fromkeys(counts))


def _scaling_counts(text: str) -> tuple[int, ...]:
    counts = _worker_counts(text)
    if 0 in counts:
        raise argparse.ArgumentTypeError(f"expected worker counts >= 1, got {text!r}")
    return counts


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` options to ``parser``."""
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    listing = "\n".join(f"  {w.name:<8} {w.summary}" for w in WORKLOADS.values())
    scaling = "\n".join(f"  {w.name:<8} {w.summary}" for w in SCALING_WORKLOADS.values())
    parser.epilog = (
        f"workloads:\n{listing}\n\nworkloads of --scaling:\n{scaling}\n\n"
        "exit status: 0 every row ran, 1 a row failed (its error is in the table;\n"
        "--scaling: also a row --budget left out), 2 bad arguments or matplotlib\n"
        "missing for --plot, 130 interrupted"
    )
    add = parser.add_argument
    add("--quick", action="store_true", help="small, fast configuration (1 rep + warm-up); CI")
    add("--only", type=_workload_names, metavar="NAME[,NAME]", help="run only these workloads")
    add("--workers", type=_worker_counts, metavar="N[,N]", help="worker counts (default: 0,2)")
    add(
        "--reps",
        type=positive_int,
        metavar="N",
        help="measured runs per side (default 3); --scaling: measured epochs per loader",
    )
    add("--batch-size", type=positive_int, metavar="N", help="override every batch size")
    add("--json", type=Path, metavar="PATH", help="write the results as JSON")
    add(
        "--plot",
        type=Path,
        metavar="PATH",
        help="write a PNG chart of the ratios and rates, log axes (matplotlib)",
    )
    add(
        "--timeout",
        type=seconds,
        default=300.0,
        metavar="SECONDS",
        help="a run (--scaling: an epoch, a roof) taking longer fails its row or side "
        "(default 300; 0: no limit)",
    )
    add(
        "--no-resume",
        action="store_true",
        help="skip the resume rows (time to first batch resuming mid-epoch; state_dict() time)",
    )
    add(
        "--io",
        action="store_true",
        help="the I/O rows at full size, io50 included (about 6 minutes more on 2 cores)",
    )
    add(
        "--scaling",
        action="store_true",
        help="the scaling mode: loaders at 1, 2, 4, ... workers against the roof",
    )
    add(
        "--workers-list",
        type=_scaling_counts,
        metavar="N[,N]",
        help="--scaling: worker counts, run in this order (default 1, 2, 4, ... the CPU count)",
    )
    add(
        "--feed",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="--scaling: 'gpu' pins, moves each batch to CUDA and normalizes it there; "
        "'auto' (default) is gpu where CUDA is present",
    )
    add("--no-threads", action="store_true", help="--scaling: leave out ferry's thread workers")
    add(
        "--balanced",
        action="store_true",
        help="--scaling: also ferry's process workers with balance_workers=True",
    )
    add(
        "--unmoved",
        action="store_true",
        help="--scaling: also ferry's process workers with move_workers=False (placed by the "
        "scheduler alone, as torch's)",
    )
    add(
        "--batches-per-worker",
        type=positive_int,
        metavar="N",
        help="--scaling: batches each worker makes in an epoch (default: the workload's, 4-6; "
        "long epochs show what balancing gives)",
    )
    add(
        "--budget",
        type=seconds,
        metavar="SECONDS",
        help="--scaling: start no row after this many seconds (the rest are reported not run)",
    )
    add(
        "--markdown",
        type=Path,
        metavar="PATH",
        help="--scaling: write the table as markdown (rewritten after every row, as --json)",
    )
    add(
        "--candidate",
        choices=("ferry", "torch"),
        default="ferry",
        help="the loader measured against torch's; 'torch' is an A/A check of the harness",
    )


def config_from_args(args: argparse.Namespace) -> Config:
    """The :class:`Config` the parsed options describe."""
    reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    return Config(
        workloads=args.only or default_workloads(args.io, args.quick),
        workers=args.workers if args.workers is not None else (0, 2),
        reps=reps,
        quick=args.quick,
        batch_size=args.batch_size,
        timeout_s=args.timeout,
        candidate=args.candidate,
        io=args.io,
    )


def _load_average() -> float | None:
    """The 1-minute load average, or None where the system does not report one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _scaling_only_options(args: argparse.Namespace) -> str | None:
    """The problem with options that only ``--scaling`` takes, given without it."""
    given = [
        option
        for option, value in (
            ("--workers-list", args.workers_list),
            ("--feed", None if args.feed == "auto" else args.feed),
            ("--no-threads", args.no_threads or None),
            ("--balanced", args.balanced or None),
            ("--unmoved", args.unmoved or None),
            ("--batches-per-worker", args.batches_per_worker),
            ("--budget", args.budget),
            ("--markdown", args.markdown),
        )
        if value is not None
    ]
    if given:
        return f"{', '.join(given)} go(es) with --scaling"
    unknown = [name for name in args.only or () if name not in WORKLOADS]
    if unknown:
        return f"workload {', '.join(map(repr, unknown))} runs with --scaling only"
    return None


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run the benchmark the parsed ``args`` describe; ``argv`` is recorded in the metadata."""
    try:
        if args.plot is not None:
            require_matplotlib()
    except MissingExtra as exc:
        print(f"ferry bench: {exc}", file=sys.stderr)
        return 2
    for path, option in ((args.json, "--json"), (args.plot, "--plot")):
        problem = prepare_output(path, option)
        if problem:
            print(f"ferry bench: {problem}", file=sys.stderr)
            return 2
    if args.scaling:
        from ferry.bench.scaling_cli import run_scaling_command

        return run_scaling_command(args, argv)
    problem = _scaling_only_options(args)
    if problem:
        print(f"ferry bench: {problem}", file=sys.stderr)
        return 2
    config = config_from_args(args)
    load = _load_average()
    cpus = os.cpu_count() or 1
    if load is not None and load > cpus / 2:
        _progress(
            f"ferry bench: warning: the machine is busy (1-minute load {load:.1f} on {cpus} "
            "CPUs); the figures will be noisy, and torch's intra-op threads may stall"
        )
    _progress(
        f"ferry bench: {', '.join(config.workloads)} with workers "
        f"{', '.join(map(str, config.workers))}; {config.reps} measured run(s) per side after "
        f"{config.warmup} warm-up{'; quick' if config.quick else ''}"
        + ("; A/A check: torch against itself" if config.candidate == "torch" else "")
    )
    started = time.perf_counter()
    try:
        rows = run_suite(config, _progress)
    except KeyboardInterrupt:
        _progress("ferry bench: interrupted; no report")
        return 130
    _progress(f"ferry bench: done in {time.perf_counter() - started:.1f} s")
    print(format_table(rows))
    latency = format_latency(rows)
    if latency:
        print()
        print(latency)
    resume_rows: list[ResumeRow] = []
    if not args.no_resume and config.candidate == "ferry":
        resume_rows = run_resume(config.quick, config.reps, _progress)
        state_dict_s = time_state_dict()
        print()
        print(format_resume(resume_rows, state_dict_s))
    if args.json is not None:
        meta = metadata(argv, config)
        meta["load_average_at_start"] = load
        document = to_json(rows, meta)
        if resume_rows:
            document["resume"] = [dataclasses.asdict(r) for r in resume_rows]
            document["state_dict_s_8_workers"] = state_dict_s
        args.json.write_text(json.dumps(document, indent=2) + "\n")
        _progress(f"ferry bench: wrote {args.json}")
    if args.plot is not None:
        write_plot(rows, args.plot)
        _progress(f"ferry bench: wrote {args.plot}")
    failed = any(row.error for row in rows) or any(row.error for row in resume_rows)
    return 1 if failed else 0
