"""How the scaling mode's results are shown: a text table, a markdown file and a JSON document.

Each loader's rate (samples/s, median of its measured epochs) stands beside the roof of its row
as a percentage, and ferry's beside torch's as a ratio (both the median of the rounds' ratios).
The markdown and JSON are written after every row (see ``ferry.bench.cli``), so a run cut short
leaves what it measured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ferry.bench.results import column_renderer
from ferry.bench.scaling import SCALING_WORKLOADS, ScalingRow

__all__ = ["LEGEND", "format_scaling", "scaling_cells", "scaling_json", "scaling_markdown"]

LEGEND = """\
samples/s: from iter(loader) to the last batch, whole epochs after a warm-up epoch (persistent
workers, shuffled), median of the measured epochs; the sides alternate epoch by epoch.
roof: the same __getitem__ and collate on the same indices in N plain processes, no loader,
their rates summed: the most this machine makes of the workload with N processes; one pass
in each round, before the loaders' epochs (median shown).
bound: N times the slowest of those processes' rates: a loader that gives each worker an equal
share of the epoch (torch's round-robin, ferry's in order) ends the epoch with its slowest
worker, so where the CPUs differ in speed (vCPUs of a VM) this is its most, below the roof.
% roof, % bound, x torch: the median over the rounds of the loader's epoch over that round's
roof, bound or torch epoch (paired, so the machine's drift between rounds cancels); x torch
compares thread workers with torch's process workers (torch has no threads).
balanced (--balanced): ferry's process workers with balance_workers=True, the next batch to the
worker that would finish it first; it can beat the bound, not on a short epoch
(--batches-per-worker makes it longer).
unmoved (--unmoved): ferry's process workers with move_workers=False, placed by the scheduler
alone, as torch's are (ferry's default moves them round the CPUs while an epoch runs)."""

TITLES = (
    "workload",
    "workers",
    "roof/s",
    "bound/s",
    "torch/s",
    "torch %roof",
    "ferry/s",
    "ferry %roof",
    "ferry %bound",
    "ferry x torch",
    "threads/s",
    "threads %roof",
    "threads x torch",
    "balanced/s",
    "balanced %roof",
    "balanced x torch",
    "unmoved/s",
    "unmoved %roof",
    "unmoved x torch",
)
# The sides whose three columns end TITLES, in order; each shown only where a row ran it.
_OPTIONAL = ("ferry balanced", "ferry unmoved")
_ALIGN = ("<", "<") + (">",) * (len(TITLES) - 2)


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _share(value: float | None) -> str:
    # One decimal: a target of 90% must not read as met at 89.6%.
    return "-" if value is None else f"{value:.1%}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def scaling_cells(row: ScalingRow) -> list[str]:
    """The cells of ``row`` in the order of :data:`TITLES`."""
    cells = [row.workload, str(row.workers), _rate(row.roof), _rate(row.equal_share_bound)]
    for label in ("torch", "ferry", "ferry threads", *_OPTIONAL):
        side = row.side(label)
        cells.append(_rate(side.samples_per_s if side else None))
        cells.append(_share(row.share_of_roof(label)))
        if label == "ferry":
            cells.append(_share(row.share_of_bound(label)))
        if label != "torch":
            cells.append(_ratio(row.over_torch(label)))
    return cells


def _notes(row: ScalingRow) -> list[str]:
    notes = []
    if row.skipped:
        notes.append(f"not run: {row.skipped}")
    if row.error:
        notes.append(f"failed: {row.error}")
    if row.roof_error:
        notes.append(f"roof: {row.roof_error}")
    notes.extend(f"{side.label}: {side.error}" for side in row.sides if side.error)
    return notes


def _sorted(rows: Sequence[ScalingRow]) -> list[ScalingRow]:
    order = {name: i for i, name in enumerate(SCALING_WORKLOADS)}
    return sorted(rows, key=lambda row: (order.get(row.workload, len(order)), row.workers))


def _columns(rows: Sequence[ScalingRow]) -> list[int]:
    """Which of :data:`TITLES` to show (their indices): an optional side's only if a row ran
    it."""
    base = len(TITLES) - 3 * len(_OPTIONAL)
    shown = list(range(base))
    for i, label in enumerate(_OPTIONAL):
        if any(row.side(label) for row in rows):
            shown.extend(range(base + 3 * i, base + 3 * i + 3))
    return shown


def _pick(values: Sequence[str], shown: list[int]) -> list[str]:
    return [values[i] for i in shown]


def format_scaling(rows: Sequence[ScalingRow], legend: bool = True) -> str:
    """The rows as a fixed-width text table, by workload then worker count; a row's failures
    follow it, one a line."""
    ordered = _sorted(rows)
    shown = _columns(rows)
    titles = _pick(TITLES, shown)
    cells = [_pick(scaling_cells(row), shown) for row in ordered]
    render = column_renderer(tuple(zip(titles, _pick(_ALIGN, shown), strict=True)), cells)
    lines = [render(titles)]
    lines.append("-" * len(lines[0]))
    for row, line in zip(ordered, cells, strict=True):
        lines.append(render(line))
        lines.extend(f"    {note}" for note in _notes(row))
    if legend:
        lines.extend(["", LEGEND])
    return "\n".join(lines)


def scaling_markdown(rows: Sequence[ScalingRow], meta: dict[str, Any]) -> str:
    """A markdown page: where and how it ran, the table, the failures, the legend."""
    feed = "GPU feed" if rows and rows[0].feed == "gpu" else "CPU feed"
    shown = _columns(rows)
    out = [
        f"# ferry bench --scaling ({feed})",
        "",
        *(f"- **{key}:** {value}" for key, value in meta.items() if not isinstance(value, dict)),
        "",
        "| " + " | ".join(_pick(TITLES, shown)) + " |",
        "| " + " | ".join("---" if a == "<" else "---:" for a in _pick(_ALIGN, shown)) + " |",
    ]
    notes: list[str] = []
    for row in _sorted(rows):
        out.append("| " + " | ".join(_pick(scaling_cells(row), shown)) + " |")
        notes.extend(f"- {row.workload} at {row.workers}: {note}" for note in _notes(row))
    if notes:
        out.extend(["", *notes])
    workloads = {row.workload for row in rows}
    out.append("")
    out.extend(
        f"- `{w.name}`: {w.summary}" for w in SCALING_WORKLOADS.values() if w.name in workloads
    )
    out.extend(["", LEGEND, ""])
    return "\n".join(out)


def scaling_json(rows: Sequence[ScalingRow], meta: dict[str, Any]) -> dict[str, Any]:
    """``{"meta": ..., "scaling": [one record per row]}``: the row's fields and its equal-share
    bound, each side's epochs and median, its shares of the roof and of the bound and its ratio
    to torch."""
    records = []
    for row in rows:
        record = dataclasses.asdict(row)
        record["equal_share_bound"] = row.equal_share_bound
        for side, entry in zip(row.sides, record["sides"], strict=True):
            entry["samples_per_s"] = side.samples_per_s
            entry["share_of_roof"] = row.share_of_roof(side.label)
            entry["share_of_bound"] = row.share_of_bound(side.label)
            entry["over_torch"] = row.over_torch(side.label)
        records.append(record)
    return {"meta": meta, "scaling": records}
