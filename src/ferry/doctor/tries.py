"""``--try``: measure the advised settings side by side with the loader as given."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ferry.doctor.advice import Advice
from ferry.doctor.measure import Measurement, measure
from ferry.doctor.options import build_loader, with_changes
from ferry.doctor.progress import Bound, Console

__all__ = ["Try", "run_tries", "speedup", "variants"]


@dataclass(frozen=True)
class Try:
    """One setting measured: its run, or the error that stopped it."""

    setting: str
    changes: dict[str, Any]
    run: Measurement | None
    error: str | None = None


def speedup(run: Measurement, baseline: Measurement) -> float | None:
    """How much faster ``run`` is than ``baseline``: the ratio of their estimated epoch times
    (start-up included), or of their batches/s when the epoch length is unknown."""
    if run.epoch_s and baseline.epoch_s:
        return baseline.epoch_s / run.epoch_s
    if baseline.batches_per_s:
        return run.batches_per_s / baseline.batches_per_s
    return None


def _label(changes: Mapping[str, Any]) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in changes.items())


def variants(advice: Sequence[Advice]) -> list[tuple[str, dict[str, Any]]]:
    """The settings to try: each advice that changes loader options, then all of them together
    (when that is another setting); a label and the changes of each."""
    singles = [dict(a.changes) for a in advice if a.changes]
    combined: dict[str, Any] = {}
    for changes in singles:
        combined.update(changes)
    tried: list[dict[str, Any]] = []
    for changes in [*singles, combined]:
        if changes and changes not in tried:
            tried.append(changes)
    return [(_label(changes), changes) for changes in tried]


def _measure_setting(
    options: Mapping[str, Any],
    changes: Mapping[str, Any],
    label: str,
    bound: Bound,
    console: Console,
    *,
    step_s: float,
    transfer: Callable[[Any], None] | None,
) -> Measurement:
    loader = build_loader(with_changes(options, changes))  # goes with this frame
    return measure(loader, label, bound, console, step_s=step_s, transfer=transfer)


def run_tries(
    options: Mapping[str, Any],
    advice: Sequence[Advice],
    bound: Bound,
    console: Console,
    *,
    step_s: float = 0.0,
    transfer: Callable[[Any], None] | None = None,
) -> list[Try]:
    """Measure every :func:`variants` setting: a new ``ferry.DataLoader`` from ``options`` with
    the changes applied, within ``bound`` and in the same loop as the loader as given (see
    :func:`~ferry.doctor.measure.measure`). A setting that fails is reported with its error,
    and the others still run."""
    tries = []
    for setting, changes in variants(advice):
        label = f"trying {setting}"
        try:
            run = _measure_setting(
                options, changes, label, bound, console, step_s=step_s, transfer=transfer
            )
        except Exception as exc:
            console.say(f"{setting} failed:\n{traceback.format_exc().rstrip()}")
            tries.append(Try(setting, changes, None, f"{type(exc).__name__}: {exc}"))
        else:
            tries.append(Try(setting, changes, run))
    return tries
