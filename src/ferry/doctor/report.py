"""How the doctor's findings are shown: the text report, the ``--json`` file, the ``--plot``."""

from __future__ import annotations

import datetime
import platform
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import ferry
from ferry._cli import require_matplotlib
from ferry.doctor.advice import Advice, Findings, nothing_to_gain, stage_shares
from ferry.doctor.measure import Measurement
from ferry.doctor.options import describe, plain_options
from ferry.doctor.progress import Bound
from ferry.doctor.tries import Try, speedup

__all__ = ["Report", "format_report", "to_json", "write_plot"]

_WIDTH = 100
_STAGES = ("sampler", "fetch", "collate", "hand_off", "wait", "pin")

LEGEND = """\
batches/s: steady state (warm-up left out). first batch: from iter() to the first batch.
epoch: estimated, the first batch then the rest of len(loader) at the steady rate.
speed-up: the first row's epoch time over this row's (batches/s when the length is unknown)."""


@dataclass(frozen=True)
class Report:
    """Everything one doctor session measured and concluded."""

    spec: str  # MODULE:FUNCTION as given
    kind: str  # "ferry" or "torch": whose loader the function returned
    bound: Bound
    findings: Findings  # the ferry loader's run (the equivalent one, for a torch loader)
    advice: list[Advice]
    torch_run: Measurement | None = None  # a torch loader, measured as given
    tries: list[Try] | None = None  # None: --try was not asked for
    transfer: bool = False  # the loop copied each batch to the GPU
    notes: list[str] = field(default_factory=list)  # what could not be measured

    def baselines(self) -> list[tuple[str, Measurement]]:
        """The rows the tries are compared with, the first one being the loader as given."""
        if self.torch_run is not None:
            return [("torch, as given", self.torch_run), ("ferry, same options", self.findings.run)]
        return [("as given", self.findings.run)]


def _wrap(text: str, indent: str = "  ") -> str:
    return textwrap.fill(
        text, _WIDTH, initial_indent=indent, subsequent_indent=indent + "  ", break_on_hyphens=False
    )


def _run_line(run: Measurement, bound: Bound) -> str:
    if run.ended:
        extent = "the whole epoch"
    elif run.epoch_batches:
        extent = f"{bound}; the epoch has {run.epoch_batches}"
    else:
        extent = f"{bound}; the epoch's length is unknown"
    steady = (
        f"figures from batch {run.warmup + 1} on (the warm-up before is left out)"
        if run.warmup
        else "figures of the whole run (too short to leave the warm-up out)"
    )
    return (
        f"run: {run.batches} batches ({extent}); first batch after "
        f"{run.first_batch_s:.3f} s; {steady}"
    )


def _loop_line(step_s: float, transfer: bool) -> str:
    parts = ["next()"]
    if transfer:
        parts.append("a copy of the batch to the GPU")
    if step_s:
        parts.append(f"a {step_s * 1e3:g} ms sleep standing for the training step")
    else:
        return (
            "loop: " + ", then ".join(parts) + " and nothing else (--step-ms adds a training step)"
        )
    return "loop: " + ", then ".join(parts)


def _verdict(f: Findings) -> list[str]:
    stats = f.stats
    counts = f"{stats.waited} of {stats.batches} batches were not ready when asked"
    if f.loader_bound:
        head = (
            f"Bottleneck: the loader. The loop waited in next() {f.loop_waits:.0%} of the wall "
            f"time ({counts})."
        )
    else:
        busy = f", and the workers were busy {f.workers_busy:.0%} of it" if stats.workers else ""
        head = (
            f"Bottleneck: the training loop. The loop waited in next() only {f.loop_waits:.0%} "
            f"of the wall time ({counts}){busy}: the loader is waiting for the loop."
        )
    shares = stage_shares(stats)
    work = ", ".join(f"{stage} {share:.0%}" for stage, share in shares.items() if share >= 0.01)
    small = [stage for stage, share in shares.items() if share < 0.01]
    if small:
        work += f"; {', '.join(small)} under 1%"
    lines = [head, f"The loader's work: {work}."]
    if f.threads is not None:
        probe = f.threads
        lines.append(
            f"Threads: two worker threads made {probe.speedup:.2f}x the batches of one "
            f"({probe.two_threads:.1f} against {probe.one_thread:.1f} batches/s)."
        )
    tuning = getattr(stats, "tuning", "")
    if tuning and tuning not in str(stats):  # said already when the stats table says it
        lines.append(f"Autotuning: {tuning}")
    return [_wrap(line, "") for line in lines]


def _number(value: float | None, digits: str = ".3g") -> str:
    return "-" if value is None else format(value, digits)


def _tries_table(report: Report) -> list[str]:
    assert report.tries is not None
    rows: list[tuple[str, Measurement | None, str | None]] = [
        (label, run, None) for label, run in report.baselines()
    ]
    rows += [(t.setting, t.run, t.error) for t in report.tries]
    baseline = rows[0][1]
    assert baseline is not None
    titles = ("setting", "batches/s", "first batch s", "epoch s", "speed-up")
    cells = []
    for label, run, error in rows:
        if run is None:
            cells.append((label, "-", "-", "-", f"error: {error}"))
            continue
        ratio = speedup(run, baseline)
        cells.append(
            (
                label,
                f"{run.batches_per_s:.1f}",
                f"{run.first_batch_s:.3f}",
                _number(run.epoch_s, ".2f"),
                "-" if ratio is None else f"{ratio:.2f}x",
            )
        )
    table = [titles, *cells]
    widths = [max(len(line[i]) for line in table) for i in range(len(titles))]
    return [
        "  "
        + f"{line[0]:<{widths[0]}}"
        + "".join(f"  {cell:>{width}}" for cell, width in zip(line[1:], widths[1:], strict=True))
        for line in table
    ]


def format_report(report: Report) -> str:
    """The report as text: what was run, the statistics, the bottleneck, advice, tries."""
    f = report.findings
    lines = [f"ferry doctor: {report.spec}"]
    lines.append(f"loader: ferry.DataLoader({describe(f.options)})")
    if report.torch_run is not None:
        run = report.torch_run
        lines.append(
            _wrap(
                f"torch.utils.data.DataLoader as given: {run.batches_per_s:.1f} batches/s, first "
                f"batch after {run.first_batch_s:.3f} s. The figures below are of the equivalent "
                "ferry.DataLoader, built from its options (shown above).",
                "",
            )
        )
    lines += [_wrap(_run_line(f.run, report.bound), ""), _loop_line(f.step_s, report.transfer), ""]
    lines += [str(f.stats), ""]
    lines += _verdict(f)
    lines += [_wrap(note, "") for note in report.notes]
    lines.append("")
    if report.advice:
        lines.append("Advice:")
        lines += [_wrap(f"- {advice}") for advice in report.advice]
    else:
        lines.append(
            _wrap(f"Advice: nothing to gain from the loader's options: {nothing_to_gain(f)}.", "")
        )
    if report.tries is not None:
        lines.append("")
        if report.tries:
            lines.append(
                f"Tried (a new ferry.DataLoader with the options changed, {report.bound} each):"
            )
            lines += _tries_table(report)
            lines += ["", LEGEND]
        else:
            lines.append("Tried: nothing (no advice changes a loader option).")
    return "\n".join(lines)


def _metadata(argv: Sequence[str], cpus: int) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "ferry_version": ferry.__version__,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
        "usable_cpus": cpus,
        "cuda": torch.cuda.is_available(),
        "command_line": " ".join([Path(sys.executable).name, "-m", "ferry", *argv]),
    }


def _try_record(report: Report, entry: Try) -> dict[str, Any]:
    baseline = report.baselines()[0][1]
    return {
        "setting": entry.setting,
        "changes": entry.changes,
        "run": None if entry.run is None else entry.run.as_dict(),
        "speedup": None if entry.run is None else speedup(entry.run, baseline),
        "error": entry.error,
    }


def to_json(report: Report, argv: Sequence[str]) -> dict[str, Any]:
    """The report as plain data: the runs (with ``LoaderStats.as_dict()``), the bottleneck,
    the advice and the tries."""
    f = report.findings
    probe = f.threads
    return {
        "meta": _metadata(argv, f.cpus),
        "spec": report.spec,
        "kind": report.kind,
        "options": plain_options(f.options),
        "bound": {"batches": report.bound.batches, "seconds": report.bound.seconds},
        "step_s": f.step_s,
        "torch_run": None if report.torch_run is None else report.torch_run.as_dict(),
        "run": f.run.as_dict(),
        "bottleneck": f.stats.bottleneck,
        "loop_waits": f.loop_waits,
        "stage_shares": stage_shares(f.stats),
        "thread_probe": None
        if probe is None
        else {"one_thread": probe.one_thread, "two_threads": probe.two_threads},
        "tuning": getattr(f.stats, "tuning", ""),
        "notes": report.notes,
        "advice": [
            {
                "option": a.option,
                "current": a.current,
                "suggested": a.suggested,
                "reason": a.reason,
                "changes": a.changes,
            }
            for a in report.advice
        ],
        "nothing_to_gain": None if report.advice else nothing_to_gain(f),
        "tries": None if report.tries is None else [_try_record(report, t) for t in report.tries],
    }


def write_plot(report: Report, path: Path) -> None:
    """A PNG: the milliseconds per batch of each stage; beside it, with tries, their speed-ups."""
    plt = require_matplotlib()
    stats = report.findings.stats
    tried = [(t.setting, t.run) for t in report.tries or () if t.run is not None]
    panels = 2 if tried else 1
    figure, axes = plt.subplots(1, panels, figsize=(6.0 * panels, 4.5), squeeze=False)
    stages = axes[0][0]
    per_batch = [1e3 * getattr(stats, f"{s}_s") / max(stats.batches, 1) for s in _STAGES]
    stages.bar(range(len(_STAGES)), per_batch, color="tab:blue")
    stages.set_xticks(range(len(_STAGES)), _STAGES)
    stages.set_ylabel("ms per batch (worker stages summed over workers)")
    stages.set_title(f"where the time goes: the bottleneck is the {stats.bottleneck}")
    if tried:
        chart = axes[0][1]
        rows = [*report.baselines(), *tried]
        baseline = rows[0][1]
        ratios = [speedup(run, baseline) or 0.0 for _, run in rows]
        bars = chart.bar(range(len(rows)), ratios, color="tab:green")
        for bar, ratio in zip(bars, ratios, strict=True):
            x = bar.get_x() + bar.get_width() / 2
            chart.annotate(f"{ratio:.2f}x", (x, ratio), ha="center", va="bottom")
        chart.axhline(1.0, color="gray", linewidth=1, linestyle="--")
        labels = [label.replace(", ", "\n") for label, _ in rows]  # one option a line
        chart.set_xticks(range(len(rows)), labels, fontsize=7)
        chart.set_ylabel("speed-up over the loader as given")
        chart.set_title("settings tried (higher is better)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
