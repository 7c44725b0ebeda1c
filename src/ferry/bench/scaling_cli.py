"""``python -m ferry bench --scaling``: check its options, run it, write what it measured as it
goes (``--json``, ``--markdown``: rewritten after every row) and print the table at the end.

Exit codes as the default run's: 0 every row ran, 1 a row or side failed or was left out by
``--budget``, 2 bad arguments (or ``--feed gpu`` without CUDA), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ferry._cli import prepare_output
from ferry.bench.cli import _load_average, _progress
from ferry.bench.report import metadata
from ferry.bench.scaling import (
    SCALING_WORKLOADS,
    ScalingConfig,
    ScalingRow,
    default_worker_counts,
    run_scaling,
)
from ferry.bench.scaling_report import format_scaling, scaling_json, scaling_markdown

__all__ = ["run_scaling_command", "scaling_config"]


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the options for ``--scaling``; None when nothing is."""
    others = [
        option
        for option, given in (
            ("--workers", args.workers is not None),
            ("--batch-size", args.batch_size is not None),
            ("--plot", args.plot is not None),
            ("--io", args.io),
            ("--candidate", args.candidate != "ferry"),
        )
        if given
    ]
    if others:
        return f"{', '.join(others)} cannot go with --scaling (worker counts: --workers-list)"
    unknown = [name for name in args.only or () if name not in SCALING_WORKLOADS]
    if unknown:
        return f"--scaling runs {', '.join(SCALING_WORKLOADS)}, not {', '.join(map(repr, unknown))}"
    if args.feed == "gpu" and not torch.cuda.is_available():
        return "--feed gpu needs CUDA, which torch does not find here"
    return None


def scaling_config(args: argparse.Namespace, cpus: int | None = None) -> ScalingConfig:
    """The :class:`ScalingConfig` the parsed options describe (``cpus``: the default worker
    counts' top, this machine's usable CPUs when None)."""
    feed = args.feed
    if feed == "auto":
        feed = "gpu" if torch.cuda.is_available() else "cpu"
    return ScalingConfig(
        workloads=args.only or tuple(SCALING_WORKLOADS),
        workers=args.workers_list or default_worker_counts(cpus or _usable_cpus()),
        reps=args.reps if args.reps is not None else (1 if args.quick else 3),
        feed=feed,
        quick=args.quick,
        threads=not args.no_threads,
        balanced=args.balanced,
        unmoved=args.unmoved,
        batches_per_worker=args.batches_per_worker,
        timeout_s=args.timeout,
        budget_s=args.budget,
    )


def _meta(argv: Sequence[str], config: ScalingConfig, load: float | None) -> dict[str, Any]:
    meta = {
        key: value
        for key, value in metadata(argv, config).items()
        if key not in ("cpu_method", "memory_method")
    }
    meta["load_average_at_start"] = load
    meta["feed"] = config.feed
    if config.feed == "gpu":
        meta["gpu"] = torch.cuda.get_device_name(0)
    return meta


def _writer(args: argparse.Namespace, meta: dict[str, Any]) -> tuple[Any, list[tuple[Path, str]]]:
    written: list[tuple[Path, str]] = []

    def write(rows: Sequence[ScalingRow]) -> None:
        written.clear()
        if args.json is not None:
            text = json.dumps(scaling_json(rows, meta), indent=2) + "\n"
            _replace(args.json, text)
            written.append((args.json, "JSON"))
        if args.markdown is not None:
            _replace(args.markdown, scaling_markdown(rows, meta))
            written.append((args.markdown, "markdown"))

    return write, written


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, so a reader never sees half."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def run_scaling_command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run the scaling mode the parsed ``args`` describe; ``argv`` is recorded in the metadata."""
    problem = _problem(args)
    for path, option in ((args.json, "--json"), (args.markdown, "--markdown")):
        problem = problem or prepare_output(path, option)
    if problem:
        print(f"ferry bench: {problem}", file=sys.stderr)
        return 2
    config = scaling_config(args)
    load = _load_average()
    _progress(
        f"ferry bench --scaling: {', '.join(config.workloads)} at "
        f"{', '.join(map(str, config.workers))} workers, {config.feed} feed; warm-up epoch + "
        f"{config.reps} measured epoch(s) per loader"
        + (f"; budget {config.budget_s:g} s" if config.budget_s is not None else "")
        + (f"; 1-minute load {load:.1f}" if load is not None else "")
    )
    meta = _meta(argv, config, load)
    write, written = _writer(args, meta)
    started = time.perf_counter()
    try:
        rows = run_scaling(config, _progress, on_row=write)
    except KeyboardInterrupt:
        _progress("ferry bench: interrupted; the files hold the rows done so far")
        return 130
    _progress(f"ferry bench: done in {time.perf_counter() - started:.1f} s")
    print(format_scaling(rows))
    for path, kind in written:
        _progress(f"ferry bench: wrote {kind} to {path}")
    failed = any(
        row.skipped or row.error or row.roof_error or any(side.error for side in row.sides)
        for row in rows
    )
    return 1 if failed else 0
