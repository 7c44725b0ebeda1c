"""The latency report: rows whose samples wait ``L`` each, set beside the rates they allow.

A loader that can have ``C`` sample reads in flight at once delivers at most ``C / L``
samples/s when every read waits ``L`` (a network read, here a ``time.sleep``), however fast the
CPU is: the **C/L bound**. ``C`` is what the configuration can overlap. torch's workers each
read a batch's samples one after another, so ``C`` is ``num_workers`` (``num_workers=0``: 1);
so are ferry's today. A loader that reports its own concurrency (``loader.stats().as_dict()``
with a ``"concurrency"`` entry, as per-sample parallel reads or a tuner would) is taken at its
word: see :func:`loader_concurrency`.

The **CPU bound** is what the CPU the run spent per sample allows: cores x batch size / CPU
per batch, where the cores are 1 for ``num_workers=0`` and for thread workers (the GIL runs one
thread's Python at a time) and ``min(num_workers + 1, usable CPUs)`` for process workers. A row
is bound by the smaller of the two; its measured rate says how close it came.

The measured rate is the epoch rate: samples from ``iter()`` to the last batch over that time,
start-up included, as the C/L bound is a rate over the whole epoch too.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ferry.bench.results import Row, Summary, column_renderer

__all__ = [
    "LatencyLine",
    "concurrency_bound",
    "cpu_bound",
    "format_latency",
    "latency_lines",
    "loader_concurrency",
    "usable_cpus",
]

LEGEND = """\
samples/s: from iter() to the last batch (start-up included), median of the measured runs.
C: sample reads the loader can have in flight (num_workers, 1 without workers, unless the
loader reports its own). C/L bound: C / L samples/s. CPU bound: cores x batch / CPU per batch,
1 core inline and for thread workers (GIL), workers + 1 for process workers (at most the CPUs).
bound by: the smaller bound. of C/L: the measured rate as a share of the C/L bound."""


def loader_concurrency(loader: Any, num_workers: int) -> int:
    """How many sample reads ``loader`` could have in flight in its last epoch.

    The loader's own figure when it reports one (``loader.stats().as_dict()["concurrency"]``),
    else the worker count it ran with (``stats()["num_workers"]``, which resolves ``"auto"``,
    or ``num_workers``), and 1 without workers.
    """
    reported: dict[str, Any] = {}
    stats = getattr(loader, "stats", None)
    if callable(stats):
        try:
            reported = dict(stats().as_dict())
        except Exception:  # a loader without an epoch yet, or another stats() altogether
            reported = {}
    for key in ("concurrency", "num_workers"):
        value = reported.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return max(num_workers, 1)


def concurrency_bound(concurrency: int, latency_s: float) -> float:
    """Samples/s that ``concurrency`` reads in flight allow when each waits ``latency_s``."""
    if concurrency < 1 or latency_s <= 0:
        raise ValueError(f"need concurrency >= 1 and latency > 0, got {concurrency}, {latency_s}")
    return concurrency / latency_s


def cpu_bound(cpu_s_per_batch: float, batch_size: int, cores: int) -> float | None:
    """Samples/s that ``cores`` busy cores allow at the measured CPU per batch; None when no
    CPU was measured."""
    if cpu_s_per_batch <= 0:
        return None
    return cores * batch_size / cpu_s_per_batch


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class LatencyLine:
    """One loader of a latency row: its rate beside its bounds."""

    workload: str
    workers: str  # "0", "2 proc", "2 thread"
    side: str  # "torch" or "ferry"
    latency_s: float
    concurrency: int
    concurrency_bound: float
    samples_per_s: float | None
    cpu_bound: float | None

    @property
    def share_of_bound(self) -> float | None:
        """The measured rate over the C/L bound."""
        if self.samples_per_s is None:
            return None
        return self.samples_per_s / self.concurrency_bound

    @property
    def bound_by(self) -> str:
        """``"C/L"`` or ``"CPU"``: the smaller of the two bounds."""
        if self.cpu_bound is not None and self.cpu_bound < self.concurrency_bound:
            return "CPU"
        return "C/L"


def _line(row: Row, side: str, summary: Summary | None, cpus: int) -> LatencyLine | None:
    if row.latency_s is None or summary is None:
        return None
    worker_type = "process" if side == "torch" else row.worker_type
    if row.workers == 0:
        label, cores = "0", 1
    elif worker_type == "thread":
        label, cores = f"{row.workers} thread", 1
    else:
        label, cores = f"{row.workers} proc", min(row.workers + 1, cpus)
    concurrency = summary.concurrency or max(row.workers, 1)
    rate = summary.epoch_batches_per_s
    return LatencyLine(
        workload=row.workload,
        workers=label,
        side=side,
        latency_s=row.latency_s,
        concurrency=concurrency,
        concurrency_bound=concurrency_bound(concurrency, row.latency_s),
        samples_per_s=None if rate is None else rate * row.batch_size,
        cpu_bound=cpu_bound(summary.cpu_s_per_batch, row.batch_size, cores),
    )


def latency_lines(rows: Sequence[Row], cpus: int | None = None) -> list[LatencyLine]:
    """A line per loader of each row with a latency; torch's once per worker count."""
    cpus = cpus or usable_cpus()
    lines: list[LatencyLine] = []
    torch_done: set[tuple[str, int]] = set()
    for row in rows:
        if (row.workload, row.workers) not in torch_done:
            torch_done.add((row.workload, row.workers))
            torch = _line(row, "torch", row.torch, cpus)
            lines.extend([torch] if torch else [])
        ferry = _line(row, "ferry", row.ferry, cpus)
        lines.extend([ferry] if ferry else [])
    return lines


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


_COLUMNS = (
    ("workload", "<"),
    ("workers", "<"),
    ("loader", "<"),
    ("L ms", ">"),
    ("C", ">"),
    ("C/L bound", ">"),
    ("samples/s", ">"),
    ("of C/L", ">"),
    ("CPU bound", ">"),
    ("bound by", "<"),
)


def format_latency(rows: Sequence[Row], cpus: int | None = None, legend: bool = True) -> str:
    """The latency table of ``rows`` (those with a latency); empty when there are none."""
    lines = latency_lines(rows, cpus)
    if not lines:
        return ""
    cells = [
        [
            line.workload,
            line.workers,
            line.side,
            f"{line.latency_s * 1e3:g}",
            str(line.concurrency),
            _number(line.concurrency_bound),
            _number(line.samples_per_s),
            "-" if line.share_of_bound is None else f"{line.share_of_bound:.0%}",
            _number(line.cpu_bound),
            line.bound_by,
        ]
        for line in lines
    ]
    render = column_renderer(_COLUMNS, cells)
    out = [render([title for title, _ in _COLUMNS])]
    out.append("-" * len(out[0]))
    out.extend(render(line) for line in cells)
    if legend:
        out.extend(["", LEGEND])
    return "\n".join(out)
