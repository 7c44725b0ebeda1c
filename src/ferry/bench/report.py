"""How benchmark results are shown: the text table, the ``--json`` file and the ``--plot`` chart."""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ferry._cli import require_matplotlib
from ferry.bench.latency import latency_lines
from ferry.bench.measure import HAVE_PROC
from ferry.bench.results import Row, Summary, column_renderer
from ferry.bench.runner import Config
from ferry.bench.scaling import ScalingConfig

__all__ = [
    "format_table",
    "metadata",
    "to_json",
    "workers_label",
    "write_plot",
]

_ERROR_WIDTH = 160
_MIB = 1 << 20

LEGEND = """\
b/s: batches per second in steady state (first to last batch), median of the measured runs.
CPU ms/b: CPU per batch, main process (all threads) + worker processes, same window.
MiB: peak RSS of the main process + workers (forked workers also count pages they share).
1st ms: from iter(loader) to the first batch in hand. memcpy b/s: one copy of a batch's bytes.
"N thread" rows: ferry's thread workers against torch's process workers (torch has no threads)."""

_COLUMNS = (
    ("workload", "<"),
    ("workers", "<"),
    ("torch b/s", ">"),
    ("ferry b/s", ">"),
    ("ratio", ">"),
    ("torch CPU ms/b", ">"),
    ("ferry CPU ms/b", ">"),
    ("torch MiB", ">"),
    ("ferry MiB", ">"),
    ("torch 1st ms", ">"),
    ("ferry 1st ms", ">"),
    ("memcpy b/s", ">"),
    ("ferry/memcpy", ">"),
)


def workers_label(row: Row) -> str:
    """``"0"``, ``"2 proc"`` or ``"2 thread"``."""
    if row.worker_type is None:
        return str(row.workers)
    return f"{row.workers} {'thread' if row.worker_type == 'thread' else 'proc'}"


def _number(value: float | None) -> str:
    """Four significant digits, thousands separated; ``-`` when missing."""
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def _cells(row: Row) -> list[str]:
    def pick(summary: Summary | None, name: str, scale: float = 1.0) -> str:
        value = getattr(summary, name) if summary is not None else None
        return _number(None if value is None else value * scale)

    ratio = row.ratio
    fraction = row.ferry_fraction_of_memcpy
    return [
        row.workload,
        workers_label(row),
        pick(row.torch, "batches_per_s"),
        pick(row.ferry, "batches_per_s"),
        "-" if ratio is None else f"{ratio:.2f}x",
        pick(row.torch, "cpu_s_per_batch", 1e3),
        pick(row.ferry, "cpu_s_per_batch", 1e3),
        pick(row.torch, "peak_rss_bytes", 1 / _MIB),
        pick(row.ferry, "peak_rss_bytes", 1 / _MIB),
        pick(row.torch, "first_batch_s", 1e3),
        pick(row.ferry, "first_batch_s", 1e3),
        _number(row.memcpy_batches_per_s),
        "-" if fraction is None else f"{fraction:.1%}",
    ]


def format_table(rows: Sequence[Row], legend: bool = True) -> str:
    """The results as a fixed-width text table; a failed row is followed by ``error: ...``."""
    cells = [_cells(row) for row in rows]
    render = column_renderer(_COLUMNS, cells)
    lines = [render([title for title, _ in _COLUMNS])]
    lines.append("-" * len(lines[0]))
    for row, line in zip(rows, cells, strict=True):
        lines.append(render(line))
        for error in row.errors:
            text = f"error: {error}"
            if len(text) > _ERROR_WIDTH:
                text = text[: _ERROR_WIDTH - 3] + "..."
            lines.append(f"    {text}")
    if legend:
        lines.extend(["", LEGEND])
    return "\n".join(lines)


def metadata(argv: Sequence[str], config: Config | ScalingConfig) -> dict[str, Any]:
    """Where and how the results were made, for the ``--json`` file."""
    import ferry

    try:
        usable_cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable_cpus = os.cpu_count() or 0
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "ferry_version": getattr(ferry, "__version__", "unknown"),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "usable_cpus": usable_cpus,
        "command_line": " ".join([Path(sys.executable).name, "-m", "ferry", *argv]),
        "config": dataclasses.asdict(config),
        "cpu_method": (
            "time.process_time() + utime+stime of descendants from /proc/<pid>/stat, at the "
            "first and last batch; workers reaped in between via RUSAGE_CHILDREN"
            if HAVE_PROC
            else "time.process_time() + RUSAGE_CHILDREN of workers reaped in the window (no /proc)"
        ),
        "memory_method": (
            "peak of RSS(main + descendants) from /proc/<pid>/statm, sampled every 10 ms"
            if HAVE_PROC
            else "ru_maxrss of the main process (no /proc)"
        ),
    }


def _row_record(row: Row) -> dict[str, Any]:
    def side(summary: Summary | None) -> dict[str, Any] | None:
        return None if summary is None else dataclasses.asdict(summary)

    return {
        "workload": row.workload,
        "workers": row.workers,
        "worker_type": row.worker_type,
        "batch_size": row.batch_size,
        "batches": row.batches,
        "torch": side(row.torch),
        "ferry": side(row.ferry),
        "ratio": row.ratio,
        "memcpy_batches_per_s": row.memcpy_batches_per_s,
        "ferry_fraction_of_memcpy": row.ferry_fraction_of_memcpy,
        "latency_s": row.latency_s,
        "error": row.error,
        "errors": list(row.errors),
        "tracebacks": list(row.details),
    }


def to_json(rows: Sequence[Row], meta: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` document: ``{"meta": {...}, "rows": [one record per table row]}``, and
    ``"latency": [one record per loader of a latency row]`` when there are such rows."""
    document: dict[str, Any] = {"meta": meta, "rows": [_row_record(row) for row in rows]}
    lines = latency_lines(rows)
    if lines:
        document["latency"] = [
            {
                **dataclasses.asdict(line),
                "share_of_bound": line.share_of_bound,
                "bound_by": line.bound_by,
            }
            for line in lines
        ]
    return document


def write_plot(rows: Sequence[Row], path: Path) -> None:
    """A PNG of two panels, one bar group per row: ferry's speed over torch's on a log axis (so
    that 0.97x and 1.5x do not look alike; a line marks 1x), then both loaders' batches/s, also
    on a log axis. Failed rows are red and have no bar."""
    plt = require_matplotlib()
    from matplotlib.ticker import FuncFormatter

    labels = [f"{row.workload}\n{workers_label(row)}" for row in rows]
    where = list(range(len(rows)))
    figure, (top, bottom) = plt.subplots(
        2, 1, figsize=(max(7.0, 0.85 * len(rows)), 8.0), sharex=True
    )
    ratios = [row.ratio for row in rows]
    shown = [r for r in ratios if r]
    colors = ["tab:orange" if row.worker_type == "thread" else "tab:blue" for row in rows]
    # Bars grow from 1x, up for faster and down for slower than torch.
    bars = top.bar(where, [(r or 1.0) - 1.0 for r in ratios], color=colors, bottom=1.0)
    for bar, ratio in zip(bars, ratios, strict=True):
        x = bar.get_x() + bar.get_width() / 2
        if ratio is None:
            top.annotate("error", (x, 1.0), ha="center", va="bottom", color="tab:red")
        else:
            top.annotate(
                f"{ratio:.2f}x",
                (x, ratio),
                ha="center",
                va="bottom" if ratio >= 1 else "top",
                fontsize=8,
            )
    top.set_yscale("log")
    low, high = min([*shown, 1.0]), max([*shown, 1.0])
    top.set_ylim(low / 1.5, high * 1.6)
    top.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}x"))
    top.axhline(1.0, color="gray", linewidth=1, linestyle="--")
    top.set_ylabel("ferry / torch batches/s (log)")
    top.set_title("ferry vs torch.utils.data (higher is better)")
    width = 0.4
    torch_rates = [row.torch.batches_per_s if row.torch else 0.0 for row in rows]
    ferry_rates = [row.ferry.batches_per_s if row.ferry else 0.0 for row in rows]
    bottom.bar([x - width / 2 for x in where], torch_rates, width, label="torch", color="gray")
    bottom.bar([x + width / 2 for x in where], ferry_rates, width, label="ferry", color=colors)
    bottom.set_yscale("log")
    bottom.set_ylabel("batches/s (log)")
    bottom.legend(loc="upper right", fontsize=8)
    bottom.set_xticks(where, labels, fontsize=8)
    figure.text(
        0.01,
        0.005,
        "orange: ferry's thread workers, compared with torch's process workers (torch has no\n"
        "threads); blue: ferry's process workers, or no workers. Both axes are logarithmic.",
        fontsize=8,
    )
    figure.tight_layout(rect=(0, 0.05, 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)
