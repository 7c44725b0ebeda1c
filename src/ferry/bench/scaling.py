"""The scaling mode of ``python -m ferry bench``: loaders at 1, 2, 4, ... workers against the roof.

A row is one workload at N workers. It starts the roof's processes (:mod:`ferry.bench.roof`):
the dataset's own work on the epoch's indices in N plain processes, no loader. Then it builds
one loader per side, torch's, ferry's with process workers and ferry's with thread workers,
each as a training loop has it: ``shuffle=True``, ``persistent_workers=True``, the same seeded
generator. Round 0 runs one warm-up epoch of each side in turn (workers start, caches fill);
each of the next ``reps`` rounds runs one pass of the roof, then one whole epoch of each side
in turn, so drift of the machine hits the roof and all sides alike. A side's figure is the
median of its measured epochs, in samples/s from ``iter(loader)`` to the last batch (and,
under the GPU feed, to the GPU having finished with it). Its share of the roof, of the bound
and its ratio to torch are each the median over the rounds of that round's ratio (paired), so
that a machine slower in one round than in the next (a VM whose host is busy: the GPU host's
rates moved by a fifth within a minute) does not make one side look faster than another.

The GPU feed (``--feed gpu``; the default where CUDA is present) adds what a training loop on a
GPU does with each batch: ``pin_memory=True``, ``prefetch_factor=4``, each batch moved with
``.to("cuda", non_blocking=True)`` and normalized there (a float conversion, a subtraction and
a division per channel); the epoch ends when the device has finished. The roof stays the CPU's.

An epoch holds ``batches_per_worker`` batches for each worker (at least ``min_batches``), so
each worker does the same number of batches at every N, and the roof's processes equal shares.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ferry.bench.measure import batch_digest, deadline
from ferry.bench.results import median
from ferry.bench.roof import RoofPool, roof_of
from ferry.bench.runner import load_api
from ferry.bench.workloads import (
    ImagePool,
    JpegCrops,
    LoaderAPI,
    _prepare_images,
    _prepare_photos,
)

__all__ = [
    "SCALING_WORKLOADS",
    "ScalingConfig",
    "ScalingRow",
    "ScalingWorkload",
    "SideResult",
    "default_worker_counts",
    "epoch_batches",
    "run_scaling",
]

Progress = Callable[[str], None]
SIDES: tuple[tuple[str, str, tuple[tuple[str, Any], ...]], ...] = (
    ("torch", "torch", ()),
    ("ferry", "ferry", ()),
    ("ferry threads", "ferry", (("worker_type", "thread"),)),
    ("ferry balanced", "ferry", (("balance_workers", True),)),
    ("ferry unmoved", "ferry", (("move_workers", False),)),
)


@dataclass(frozen=True)
class ScalingWorkload:
    """A workload of the scaling mode (see :mod:`ferry.bench.workloads` for the datasets)."""

    name: str
    summary: str
    batch_size: int
    batches_per_worker: int
    min_batches: int
    prepare: Callable[[int, bool], Any]
    build: Callable[[Any, int], Any]
    quick_batch_size: int


SCALING_WORKLOADS: dict[str, ScalingWorkload] = {
    w.name: w
    for w in [
        ScalingWorkload(
            name="jpeg",
            summary="photo-sized JPEG: Pillow decode, random crop, resize 224, flip; batch 128",
            batch_size=128,
            batches_per_worker=4,
            min_batches=4,
            prepare=_prepare_photos,
            build=JpegCrops,
            quick_batch_size=4,
        ),
        ScalingWorkload(
            name="uint8",
            summary="uint8 3x224x224 images already decoded (a pool in memory); batch 256",
            batch_size=256,
            batches_per_worker=6,
            min_batches=12,
            prepare=_prepare_images,
            build=ImagePool,
            quick_batch_size=8,
        ),
    ]
}


@dataclass(frozen=True)
class ScalingConfig:
    """What the scaling mode runs; built by the command line (``--scaling``).

    Attributes:
        workloads: names from :data:`SCALING_WORKLOADS`.
        workers: the worker counts, in the order they run (rows are reported sorted).
        reps: rounds measured after the warm-up round: in each, one pass of the roof and one
            epoch of each side.
        feed: ``"cpu"`` or ``"gpu"`` (see the module docstring).
        quick: tiny batches, for tests and smoke runs.
        threads: also run ferry's thread workers.
        balanced: also run ferry's process workers with ``balance_workers=True``.
        unmoved: also run ferry's process workers with ``move_workers=False``.
        batches_per_worker: batches a worker makes in an epoch (None: the workload's own, a
            few; more shows what balancing gives a long epoch).
        timeout_s: an epoch (or the roof) taking longer fails its side (0: no limit).
        budget_s: no row starts, and no round, once this many seconds have passed (None: no
            budget); rows left out are reported as not run.
        seed: seeds the loaders' generators and the roof's permutation.
    """

    workloads: tuple[str, ...] = tuple(SCALING_WORKLOADS)
    workers: tuple[int, ...] = (1, 2)
    reps: int = 3
    feed: str = "cpu"
    quick: bool = False
    threads: bool = True
    balanced: bool = False
    unmoved: bool = False
    batches_per_worker: int | None = None
    timeout_s: float = 300.0
    budget_s: float | None = None
    seed: int = 0

    def batch_size_of(self, workload: ScalingWorkload) -> int:
        """The batch size ``workload`` runs with."""
        return workload.quick_batch_size if self.quick else workload.batch_size


def default_worker_counts(cpus: int) -> tuple[int, ...]:
    """1, 2, 4, ... below ``cpus``, then ``cpus`` itself: ``(1, 2, 4, 8, 16)`` for 16."""
    counts, count = [], 1
    while count < cpus:
        counts.append(count)
        count *= 2
    return (*counts, max(cpus, 1))


def epoch_batches(workload: ScalingWorkload, workers: int, per_worker: int | None = None) -> int:
    """Batches in one epoch of ``workload`` at ``workers``: a whole number per worker
    (``per_worker``, or the workload's own, at least its ``min_batches`` in all)."""
    if per_worker is not None:
        return per_worker * workers
    per_worker = workload.batches_per_worker
    return max(per_worker * workers, -(-workload.min_batches // workers) * workers)


@dataclass(frozen=True)
class SideResult:
    """One loader of a row: its measured epochs (samples/s) and its error, if any."""

    label: str  # "torch", "ferry" or "ferry threads"
    epochs: tuple[float, ...] = ()
    error: str | None = None

    @property
    def samples_per_s(self) -> float | None:
        """The median of the measured epochs; None when none was measured."""
        return median(self.epochs) if self.epochs else None


@dataclass(frozen=True)
class ScalingRow:
    """A workload at one worker count: the roof and every side's rate."""

    workload: str
    workers: int
    batch_size: int
    batches: int
    feed: str
    roof: float | None  # samples/s: the median of the rounds' roofs
    roof_per_process: tuple[float, ...] = ()  # each process's median rate
    roof_error: str | None = None
    sides: tuple[SideResult, ...] = ()
    skipped: str | None = None  # why the row did not run (the budget)
    error: str | None = None  # why the row failed as a whole (its data could not be made)
    # Each measured round's roof pass: every process's rate. A side's epochs[k] ran in the
    # round of roof_rounds[k] (both start at the first measured round and stop at a failure).
    roof_rounds: tuple[tuple[float, ...], ...] = ()

    def side(self, label: str) -> SideResult | None:
        """The side called ``label``, if the row ran it."""
        return next((s for s in self.sides if s.label == label), None)

    @property
    def equal_share_bound(self) -> float | None:
        """N times the slowest roof process's rate (samples/s): the most a loader that gives
        each of its N workers an equal share of the epoch (torch's round-robin; ferry's in
        order) can make here, since its epoch ends with its slowest worker. Below the roof by
        as much as the machine's CPUs differ in speed (on a VM, 1.4x between vCPUs was seen).
        The median of the rounds' bounds where the roof ran in rounds."""
        if self.roof_rounds:
            return median(_bounds(self.roof_rounds))
        rates = self.roof_per_process
        return len(rates) * min(rates) if rates else None

    def share_of_roof(self, label: str) -> float | None:
        """The side's rate over the roof (paired by round where the roof ran in rounds)."""
        return self._paired(label, [sum(r) for r in self.roof_rounds], self.roof)

    def share_of_bound(self, label: str) -> float | None:
        """The side's rate over :attr:`equal_share_bound` (paired likewise)."""
        return self._paired(label, _bounds(self.roof_rounds), self.equal_share_bound)

    def over_torch(self, label: str) -> float | None:
        """The side's rate over torch's: the median of each round's ratio."""
        torch_side = self.side("torch")
        return self._paired(
            label,
            torch_side.epochs if torch_side else (),
            torch_side.samples_per_s if torch_side else None,
        )

    def _paired(self, label: str, base: Sequence[float], overall: float | None) -> float | None:
        """The median over the rounds of the side's epoch over ``base`` of the same round;
        the side's median over ``overall`` where no round pairs."""
        side = self.side(label)
        if side is None or not side.epochs:
            return None
        ratios = [rate / of for rate, of in zip(side.epochs, base, strict=False) if of]
        if ratios:
            return median(ratios)
        rate = side.samples_per_s
        return None if rate is None or not overall else rate / overall


def _bounds(rounds: Sequence[Sequence[float]]) -> list[float]:
    """Each round's equal-share bound: its process count times its slowest process's rate."""
    return [len(rates) * min(rates) for rates in rounds if rates]


def _gpu_step() -> Callable[[Any], Any]:
    """The per-batch work of the GPU feed: copy to the device, normalize per channel there."""
    mean = torch.tensor([0.485, 0.456, 0.406], device="cuda").view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device="cuda").view(1, 3, 1, 1) * 255

    def step(batch: Any) -> Any:
        return (batch.to("cuda", non_blocking=True).float() - mean) / std

    return step


@dataclass
class _Side:
    label: str
    api: LoaderAPI
    options: dict[str, Any]
    loader: Any = None
    epochs: list[float] = field(default_factory=list)
    digest: str | None = None
    error: str | None = None


def _epoch(side: _Side, step: Callable[[Any], Any] | None, timeout_s: float) -> float:
    """One whole epoch of ``side``'s loader; samples/s from ``iter()`` to the last batch done."""
    samples, out = 0, None
    with deadline(timeout_s):
        start = time.perf_counter()
        for batch in side.loader:
            if side.digest is None:
                side.digest = batch_digest(batch)
            samples += len(batch)
            if step is not None:
                out = step(batch)
        if step is not None:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    del out
    return samples / max(elapsed, 1e-9)


def _fail(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}" + (f": {lines[0]}" if lines else "")


class _Clock:
    """The budget: seconds since the run started, against ``budget_s``."""

    def __init__(self, budget_s: float | None) -> None:
        self.start = time.perf_counter()
        self.budget_s = budget_s

    def spent(self) -> bool:
        return self.budget_s is not None and time.perf_counter() - self.start >= self.budget_s


def _run_row(
    workload: ScalingWorkload, workers: int, config: ScalingConfig, data: Any, clock: _Clock
) -> ScalingRow:
    batch_size = config.batch_size_of(workload)
    batches = epoch_batches(workload, workers, config.batches_per_worker)
    samples = batch_size * batches
    dataset = workload.build(data, samples)
    order = torch.randperm(samples, generator=torch.Generator().manual_seed(config.seed))
    index_batches = order.view(batches, batch_size).tolist()
    roof_error: str | None = None
    roof_rounds: list[tuple[float, ...]] = []
    pool: RoofPool | None = None
    try:
        pool = RoofPool(dataset, index_batches, workers, timeout_s=config.timeout_s)
    except Exception as exc:
        roof_error = _fail(exc)
    gpu = config.feed == "gpu"
    step = _gpu_step() if gpu else None
    options: dict[str, Any] = {"pin_memory": True, "prefetch_factor": 4} if gpu else {}
    left_out = {
        "ferry threads": not config.threads,
        "ferry balanced": not config.balanced,
        "ferry unmoved": not config.unmoved,
    }
    sides = [
        _Side(label, load_api(api), dict(extra))
        for label, api, extra in SIDES
        if not left_out.get(label, False)
    ]
    for side in sides:
        try:
            side.loader = side.api.DataLoader(
                dataset,
                batch_size=batch_size,
                shuffle=True,
                num_workers=workers,
                persistent_workers=True,
                generator=torch.Generator().manual_seed(config.seed),
                **options,
                **side.options,
            )
        except Exception as exc:
            side.error = f"building the loader: {_fail(exc)}"
    try:
        for round_ in range(1 + config.reps):
            if round_ > 1 and clock.spent():
                break  # keep what was measured; the budget is spent
            if round_ > 0 and pool is not None:
                try:
                    roof_rounds.append(pool.measure())
                except Exception as exc:  # the pool closed itself
                    roof_error, pool = f"round {round_}: {_fail(exc)}", None
            for side in sides:
                if side.error is not None:
                    continue
                try:
                    rate = _epoch(side, step, config.timeout_s)
                except Exception as exc:
                    side.error = f"epoch {round_}: {_fail(exc)}"
                    side.loader = None
                    gc.collect()
                    continue
                if round_ > 0:
                    side.epochs.append(rate)
    finally:
        if pool is not None:
            pool.close()
        for side in sides:
            side.loader = None
        gc.collect()
    torch_digest = sides[0].digest
    for side in sides[1:]:
        if side.error is None and side.digest and torch_digest and side.digest != torch_digest:
            side.error = "the first batch differs from torch's for the same seed"
    roof, per_process = roof_of(roof_rounds) if roof_rounds else (None, ())
    return ScalingRow(
        workload=workload.name,
        workers=workers,
        batch_size=batch_size,
        batches=batches,
        feed=config.feed,
        roof=roof,
        roof_per_process=per_process,
        roof_error=roof_error,
        sides=tuple(SideResult(s.label, tuple(s.epochs), s.error) for s in sides),
        roof_rounds=tuple(roof_rounds),
    )


def _describe(row: ScalingRow) -> str:
    parts = [f"roof {row.roof:,.0f}/s" if row.roof else f"roof failed ({row.roof_error})"]
    for side in row.sides:
        rate, share = side.samples_per_s, row.share_of_roof(side.label)
        if rate is None:
            parts.append(f"{side.label} failed ({side.error})")
        else:
            parts.append(f"{side.label} {rate:,.0f}/s" + (f" ({share:.1%})" if share else ""))
    return "; ".join(parts)


def run_scaling(
    config: ScalingConfig,
    progress: Progress,
    on_row: Callable[[Sequence[ScalingRow]], None] | None = None,
) -> list[ScalingRow]:
    """Run every (worker count, workload) row of ``config``, worker counts outermost, so that
    the first counts given run first under a budget; ``on_row`` gets the rows so far after each
    one (to write partial results). Rows left out by the budget are returned as skipped."""
    clock = _Clock(config.budget_s)
    data: dict[str, Any] = {}
    rows: list[ScalingRow] = []
    for workers in config.workers:
        for name in config.workloads:
            workload = SCALING_WORKLOADS[name]
            batch_size = config.batch_size_of(workload)
            batches = epoch_batches(workload, workers, config.batches_per_worker)
            if clock.spent():
                row = ScalingRow(
                    name, workers, batch_size, batches, config.feed, None, skipped="budget spent"
                )
                progress(f"scaling {name:<6} workers={workers:<3} not run: the budget is spent")
            else:
                started = time.perf_counter()
                try:
                    if name not in data:
                        data[name] = workload.prepare(batch_size * batches, config.quick)
                    row = _run_row(workload, workers, config, data[name], clock)
                    outcome = _describe(row)
                except Exception as exc:
                    row = ScalingRow(
                        name, workers, batch_size, batches, config.feed, None, error=_fail(exc)
                    )
                    outcome = f"FAILED: {row.error}"
                progress(
                    f"scaling {name:<6} workers={workers:<3} {outcome} "
                    f"[{time.perf_counter() - started:.1f} s]"
                )
            rows.append(row)
            if on_row is not None:
                on_row(rows)
    return rows
