"""The resume rows of the benchmark: time to the first batch when resuming mid-epoch.

A map-style epoch resumed at batch *k* should reach its first batch as fast as a fresh epoch
reaches batch 0, whatever *k*: ferry restores the sampler from its state and slices the
epoch's keys, fetching nothing twice. torch's loader cannot resume; the usual stand-in is to
iterate and drop *k* batches, shown for comparison. Each resumed first batch is checked
against batch *k* of an uninterrupted run (the row fails if it differs).

Also measured: how long ``state_dict()`` takes mid-epoch with 8 process workers (it asks no
worker; the position is kept in the main process as batches are handed out).
"""

from __future__ import annotations

import json
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ferry.bench.measure import batch_digest

__all__ = ["ResumeRow", "format_resume", "run_resume", "time_state_dict"]

Progress = Callable[[str], None]

# 250 batches of 256 (62 under --quick): torch's stand-in, iterating and dropping k batches,
# then takes about 0.5 s at k = 90% on 2 cores, against 6 s at the 2,000 batches of the past.
_SAMPLES = 256 * 250
_BATCH = 256


@dataclass(frozen=True)
class ResumeRow:
    """Time to the first batch (medians, seconds) for one worker count and resume point."""

    workers: int
    at_batch: int
    batches: int
    ferry_resumed_s: float
    ferry_fresh_s: float
    torch_fresh_s: float
    torch_skip_s: float
    error: str | None = None


def _dataset(api: Any, samples: int) -> Any:
    generator = torch.Generator().manual_seed(0)
    return api.TensorDataset(torch.randn(samples, 32, generator=generator))


def _loader(module: Any, dataset: Any, workers: int) -> Any:
    return module.DataLoader(
        dataset,
        batch_size=_BATCH,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(0),
    )


def _first(loader: Any, skip: int = 0) -> tuple[float, Any]:
    """Seconds from ``iter(loader)`` to batch ``skip`` in hand (dropping those before)."""
    start = time.perf_counter()
    iterator = iter(loader)
    for _ in range(skip):
        next(iterator)
    batch = next(iterator)
    elapsed = time.perf_counter() - start
    del iterator
    return elapsed, batch


def run_resume(quick: bool, reps: int, progress: Progress) -> list[ResumeRow]:
    """The resume rows for 0 and 2 process workers, resuming at 10%, 50% and 90%."""
    import torch.utils.data as tud

    import ferry

    samples = _SAMPLES // 4 if quick else _SAMPLES
    batches = samples // _BATCH
    ours, theirs = _dataset(ferry, samples), _dataset(tud, samples)
    rows = []
    for workers in (0, 2):
        for fraction in (0.1, 0.5, 0.9):
            at = int(batches * fraction)
            # The state after batch at - 1, taken from an interrupted run.
            loader = _loader(ferry, ours, workers)
            iterator = iter(loader)
            for _ in range(at):
                next(iterator)
            expected = batch_digest(next(iterator))
            del iterator
            saver = _loader(ferry, ours, workers)
            iterator = iter(saver)
            for _ in range(at):
                next(iterator)
            state = json.loads(json.dumps(saver.state_dict()))
            del iterator
            resumed, fresh, torch_fresh, torch_skip = [], [], [], []
            error = None
            for _ in range(reps):
                loader = _loader(ferry, ours, workers)
                loader.load_state_dict(state)
                elapsed, batch = _first(loader)
                resumed.append(elapsed)
                if batch_digest(batch) != expected:
                    error = f"the resumed first batch is not batch {at} of the uninterrupted run"
                fresh.append(_first(_loader(ferry, ours, workers))[0])
                torch_fresh.append(_first(_loader(tud, theirs, workers))[0])
                torch_skip.append(_first(_loader(tud, theirs, workers), skip=at)[0])
            row = ResumeRow(
                workers,
                at,
                batches,
                statistics.median(resumed),
                statistics.median(fresh),
                statistics.median(torch_fresh),
                statistics.median(torch_skip),
                error,
            )
            progress(
                f"resume  workers={workers} at batch {at}/{batches}: ferry resumed "
                f"{row.ferry_resumed_s * 1e3:.1f} ms, fresh {row.ferry_fresh_s * 1e3:.1f} ms; "
                f"torch skipping {row.torch_skip_s * 1e3:.1f} ms"
            )
            rows.append(row)
    return rows


def time_state_dict(workers: int = 8, calls: int = 200) -> float:
    """Median seconds of one ``state_dict()`` call mid-epoch with ``workers`` process workers."""
    import ferry

    with warnings.catch_warnings():
        # More workers than this machine's CPUs is the point here, not a mistake (the loader
        # and each new iterator say so, as torch's do).
        warnings.simplefilter("ignore", UserWarning)
        loader = _loader(ferry, _dataset(ferry, _BATCH * 64), workers)
        iterator = iter(loader)
    for _ in range(3 * workers):
        next(iterator)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        loader.state_dict()
        times.append(time.perf_counter() - start)
    del iterator
    return statistics.median(times)


def format_resume(rows: list[ResumeRow], state_dict_s: float | None) -> str:
    """The resume rows as a text table."""
    lines = [
        "Resume: time to the first batch, resuming a shuffled TensorDataset epoch at batch k "
        f"(batch size {_BATCH})",
        f"{'workers':<8}{'k':>12}{'ferry resumed ms':>18}{'ferry fresh ms':>16}"
        f"{'torch fresh ms':>16}{'torch skip k ms':>17}",
    ]
    for row in rows:
        lines.append(
            f"{row.workers:<8}{f'{row.at_batch}/{row.batches}':>12}"
            f"{row.ferry_resumed_s * 1e3:>18.1f}{row.ferry_fresh_s * 1e3:>16.1f}"
            f"{row.torch_fresh_s * 1e3:>16.1f}{row.torch_skip_s * 1e3:>17.1f}"
            + (f"  FAILED: {row.error}" if row.error else "")
        )
    lines.append(
        "torch skip k: torch cannot resume; iterating and dropping k batches is its stand-in."
    )
    if state_dict_s is not None:
        lines.append(
            f"state_dict() mid-epoch with 8 process workers: {state_dict_s * 1e6:.0f} us (median)"
        )
    return "\n".join(lines)
