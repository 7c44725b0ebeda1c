"""The figures the benchmark produces: one run's, their medians, and a row of the report.

Every figure of a row is the median, figure by figure, of the measured runs (the warm-up runs
discarded): the run with the median batches/s need not be the one with the median memory.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Row", "RunMetrics", "Summary", "measured", "median"]


@dataclass(frozen=True)
class RunMetrics:
    """The figures of one run of one loader."""

    batches: int
    batches_per_s: float
    cpu_s_per_batch: float
    peak_rss_bytes: int
    first_batch_s: float
    epoch_batches_per_s: float | None = None  # batches over the time from iter() to the last
    concurrency: int | None = None  # samples the loader could have in flight (see latency.py)


@dataclass(frozen=True)
class Summary:
    """Medians over the measured runs of one side of a row."""

    batches_per_s: float
    cpu_s_per_batch: float
    peak_rss_bytes: int
    first_batch_s: float
    runs: int
    epoch_batches_per_s: float | None = None
    concurrency: int | None = None

    @classmethod
    def of(cls, runs: Sequence[RunMetrics]) -> Summary | None:
        """The per-figure medians of ``runs``; None when there are none."""
        if not runs:
            return None
        return cls(
            batches_per_s=median([r.batches_per_s for r in runs]),
            cpu_s_per_batch=median([r.cpu_s_per_batch for r in runs]),
            peak_rss_bytes=round(median([r.peak_rss_bytes for r in runs])),
            first_batch_s=median([r.first_batch_s for r in runs]),
            runs=len(runs),
            epoch_batches_per_s=_median_or_none([r.epoch_batches_per_s for r in runs]),
            concurrency=_median_or_none([r.concurrency for r in runs], whole=True),
        )


@dataclass(frozen=True)
class Row:
    """One line of the report: a workload, a worker setting, torch's and ferry's medians."""

    workload: str
    workers: int
    worker_type: str | None  # "process" or "thread"; None with 0 workers
    batch_size: int
    batches: int
    torch: Summary | None
    ferry: Summary | None
    memcpy_batches_per_s: float | None
    errors: tuple[str, ...] = ()  # one line per failed side: "ferry: run: TypeError: ..."
    details: tuple[str, ...] = ()  # full tracebacks of the errors, for --json
    latency_s: float | None = None  # the workload's wait per sample, when it has one

    @property
    def error(self) -> str | None:
        """The errors of the row on one line; None when it ran cleanly."""
        return "; ".join(self.errors) or None

    @property
    def ratio(self) -> float | None:
        """ferry's batches/s over torch's."""
        if self.torch is None or self.ferry is None:
            return None
        return self.ferry.batches_per_s / self.torch.batches_per_s

    @property
    def ferry_fraction_of_memcpy(self) -> float | None:
        """ferry's batches/s as a fraction of the memcpy bound."""
        if self.ferry is None or not self.memcpy_batches_per_s:
            return None
        return self.ferry.batches_per_s / self.memcpy_batches_per_s


def median(values: Sequence[float]) -> float:
    """The median of ``values`` (the mean of the middle two for an even count)."""
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def _median_or_none(values: Sequence[float | None], whole: bool = False) -> Any:
    """The median of the values that are known (rounded when ``whole``); None if none are."""
    known = [v for v in values if v is not None]
    if not known:
        return None
    middle = median(known)
    return round(middle) if whole else middle


def measured(runs: Sequence[RunMetrics], warmup: int) -> list[RunMetrics]:
    """``runs`` without the first ``warmup`` ones, which only warm caches and allocators."""
    return list(runs[warmup:])


def column_renderer(
    columns: Sequence[tuple[str, str]], cells: Sequence[Sequence[str]]
) -> Callable[[Sequence[str]], str]:
    """A function that lays out one line of a fixed-width table: each value aligned as its
    column's format says (``"<"``/``">"``), as wide as the column's title or widest cell, two
    spaces apart. Render the titles with it for the header."""
    widths = [
        max([len(title)] + [len(line[i]) for line in cells]) for i, (title, _) in enumerate(columns)
    ]

    def render(values: Sequence[str]) -> str:
        parts = [
            f"{value:{align}{width}}"
            for value, (_, align), width in zip(values, columns, widths, strict=True)
        ]
        return "  ".join(parts).rstrip()

    return render
