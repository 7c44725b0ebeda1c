"""Runs the benchmark: each workload through torch's loader and ferry's, alternating, repeated.

For every (workload, worker count) group, each repetition runs every side once in turn (torch,
ferry, then ferry with thread workers when there are workers), so slow drift of the machine hits
all sides alike. The first ``warmup`` repetitions are discarded; each reported figure is the
median over the remaining ones, taken figure by figure.

One run builds a fresh loader, times ``iter(loader)`` to the first batch in hand, then iterates
the rest of the epoch (the dataset holds exactly ``batches * batch_size`` samples) and drops the
iterator on the last batch. Batches/s and CPU/batch are steady-state figures over the window
from the first batch to the last, so start-up is reported once, as time to first batch, and is
not mixed into the throughput; nor is shutdown. Under ``--quick`` the warm-up runs stop after a
quarter of the batches, to keep the smoke test short. Each run also keeps its rate from
``iter()`` to the last batch (the epoch rate, start-up included) and the concurrency the loader
had (:func:`~ferry.bench.latency.loader_concurrency`), for the latency report. Where the
workload names each batch's sample indices, the run fails unless each came exactly once.

A failing side (an unsupported option, a crash, a hang past ``--timeout``) fails its row only.
"""

from __future__ import annotations

import gc
import importlib
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ferry._cli import batch_nbytes
from ferry.bench.latency import loader_concurrency
from ferry.bench.measure import (
    CpuSnapshot,
    MemorySampler,
    batch_digest,
    check_keys,
    deadline,
    memcpy_batches_per_s,
)
from ferry.bench.results import Row, RunMetrics, Summary, measured, median
from ferry.bench.workloads import WORKLOADS, LoaderAPI, Workload

__all__ = ["Config", "Group", "load_api", "plan", "run_suite"]

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Config:
    """What to run; built by the command line (see ``ferry.bench.cli``).

    Attributes:
        workloads: names from :data:`~ferry.bench.workloads.WORKLOADS`, in order.
        workers: the worker counts to run each workload with.
        reps: measured repetitions per side; ``warmup`` more are run first and discarded.
        quick: the small configuration (fewer batches, smaller data).
        batch_size: overrides every workload's batch size when set.
        timeout_s: a run taking longer fails its row (0: no limit).
        candidate: ``"ferry"``, or ``"torch"`` to benchmark torch against itself (A/A check).
        seed: seeds the loaders' generators, so both sides see the same order.
        io: the I/O-latency workloads at their full size (``--io``), not their short one.
    """

    workloads: tuple[str, ...] = tuple(WORKLOADS)
    workers: tuple[int, ...] = (0, 2)
    reps: int = 3
    warmup: int = 1
    quick: bool = False
    batch_size: int | None = None
    timeout_s: float = 300.0
    candidate: str = "ferry"
    seed: int = 0
    io: bool = False

    def batches(self, workload: Workload) -> int:
        """Batches per run of ``workload``."""
        if self.quick:
            return workload.quick_batches
        if workload.short_batches is not None and not self.io:
            return workload.short_batches
        return workload.batches

    def warmup_batches(self, workload: Workload) -> int:
        """Batches per warm-up run: a whole run, or a quarter of one under ``--quick``."""
        batches = self.batches(workload)
        return max(2, batches // 4) if self.quick else batches

    def batch_size_of(self, workload: Workload) -> int:
        """The batch size ``workload`` runs with."""
        if self.batch_size:
            return self.batch_size
        if self.quick and workload.quick_batch_size:
            return workload.quick_batch_size
        return workload.batch_size


def load_api(name: str) -> LoaderAPI:
    """The loader, TensorDataset and get_worker_info of ``"torch"`` or ``"ferry"``."""
    if name == "torch":
        # ferry never imports torch.utils.data at module level (the library must not depend on
        # it); the benchmark is the one place that needs torch's loader, as the baseline.
        module: Any = importlib.import_module("torch.utils.data")
    elif name == "ferry":
        module = importlib.import_module("ferry")
    else:
        raise ValueError(f"loader must be 'torch' or 'ferry', got {name!r}")
    return LoaderAPI(name, module.DataLoader, module.TensorDataset, module.get_worker_info)


@dataclass
class _Side:
    """One loader of a group, with its runs so far (warm-up included)."""

    label: str  # "torch", "ferry" or "ferry threads"
    api_name: str
    options: dict[str, Any]
    dataset: Any = None
    runs: list[RunMetrics] = field(default_factory=list)
    digest: str | None = None
    nbytes: int | None = None
    error: str | None = None
    detail: str | None = None

    def fail(self, stage: str, exc: BaseException) -> str:
        """Record ``exc`` as this side's error (one line) and its traceback; return the line."""
        message = str(exc).strip().splitlines()
        self.error = f"{stage}: {type(exc).__name__}" + (f": {message[0]}" if message else "")
        self.detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return self.error


@dataclass(frozen=True)
class Group:
    """A workload at one worker count: the runs that share torch's baseline."""

    workload: Workload
    workers: int
    sides: tuple[tuple[str, str, tuple[tuple[str, Any], ...]], ...]  # (label, api, options)


def plan(config: Config) -> list[Group]:
    """The groups ``config`` runs, in order; thread workers only where ferry has them."""
    groups = []
    for name in config.workloads:
        for workers in config.workers:
            if workers == 0 and _inline_only_waits(WORKLOADS[name], config):
                continue
            sides: list[tuple[str, str, tuple[tuple[str, Any], ...]]] = [
                ("torch", "torch", ()),
                ("ferry", config.candidate, ()),
            ]
            if workers > 0 and config.candidate == "ferry":
                sides.append(("ferry threads", "ferry", (("worker_type", "thread"),)))
            groups.append(Group(WORKLOADS[name], workers, tuple(sides)))
    return groups


def _inline_only_waits(workload: Workload, config: Config) -> bool:
    """A full run with worker counts besides 0 leaves out the inline loader on an I/O-latency
    workload: one read at a time, both loaders measure only the latency (samples x L: 51 s a
    run at 50 ms) and tell nothing apart. ``--workers 0`` alone, or ``--quick``, runs it."""
    return workload.latency_s is not None and not config.quick and set(config.workers) != {0}


def _run_once(
    side: _Side,
    workload: Workload,
    workers: int,
    config: Config,
    *,
    limit: int,
    want_digest: bool,
) -> RunMetrics:
    """One run of ``side``'s loader: one epoch, or its first ``limit`` batches; see the module
    docstring for the timed window."""
    api = load_api(side.api_name)
    loader = api.DataLoader(
        side.dataset,
        batch_size=config.batch_size_of(workload),
        shuffle=workload.shuffle,
        num_workers=workers,
        generator=torch.Generator().manual_seed(config.seed),
        **side.options,
    )
    gc.collect()  # so garbage from the previous run is not collected inside this one
    iterator: Any = None
    keys, seen = workload.keys, list[int]()
    with deadline(config.timeout_s), MemorySampler() as memory:
        try:
            cpu_before, start = CpuSnapshot.now(), time.perf_counter()
            iterator = iter(loader)
            batch = next(iterator)
            first_batch_s = time.perf_counter() - start
            if keys is not None:
                seen.extend(keys(batch))
            if want_digest:
                side.digest, side.nbytes = batch_digest(batch), batch_nbytes(batch)
            del batch
            memory.sample()
            window_start = window_end = time.perf_counter()
            cpu_start, cpu_end = CpuSnapshot.now(), None
            count = 1
            for batch in iterator:
                count += 1
                window_end = time.perf_counter()
                if keys is not None:
                    seen.extend(keys(batch))
                if count >= limit:
                    # The last batch: read the workers' clocks while they are alive, and stop
                    # before the loader's end-of-epoch work (it may join its workers then).
                    cpu_end = CpuSnapshot.now()
                    memory.sample()
                    break
            window_s = window_end - window_start
            cpu_end = cpu_end or CpuSnapshot.now()
            cpu_s = (cpu_start if count > 1 else cpu_before).until(cpu_end)
        finally:
            iterator = batch = None  # shuts the workers down, still under the deadline
    if keys is not None:
        samples = config.batches(workload) * config.batch_size_of(workload)
        check_keys(seen, samples, whole_epoch=count >= config.batches(workload))
    concurrency = loader_concurrency(loader, workers)
    epoch_rate = count / max(window_end - start, 1e-9)
    if count == 1:  # a one-batch epoch has no window: report the first batch alone
        rate = 1 / first_batch_s
        return RunMetrics(1, rate, cpu_s, memory.peak, first_batch_s, rate, concurrency)
    return RunMetrics(
        batches=count,
        batches_per_s=(count - 1) / max(window_s, 1e-9),
        cpu_s_per_batch=cpu_s / (count - 1),
        peak_rss_bytes=memory.peak,
        first_batch_s=first_batch_s,
        epoch_batches_per_s=epoch_rate,
        concurrency=concurrency,
    )


def _describe(run: RunMetrics) -> str:
    return (
        f"{run.batches_per_s:10.1f} batches/s  {run.cpu_s_per_batch * 1e3:8.3f} ms CPU/batch  "
        f"first batch {run.first_batch_s * 1e3:8.1f} ms"
    )


@dataclass
class _Suite:
    """The state of one benchmark: its settings, the progress count, the data made so far."""

    config: Config
    progress: Progress
    total: int
    done: int = 0
    prepared: dict[str, Any] = field(default_factory=dict)

    def report(self, text: str) -> None:
        self.done += 1
        self.progress(f"[{self.done:>3}/{self.total}] {text}")

    def data(self, workload: Workload, samples: int) -> Any:
        """``workload``'s data, made once and kept for its next group (only the latest kept)."""
        if workload.name not in self.prepared:
            self.prepared.clear()
            self.prepared[workload.name] = workload.prepare(samples, self.config.quick)
        return self.prepared[workload.name]


def _run_group(group: Group, suite: _Suite) -> list[Row]:
    config = suite.config
    workload, workers = group.workload, group.workers
    batch_size, batches = config.batch_size_of(workload), config.batches(workload)
    samples = batches * batch_size
    sides = [_Side(label, api, dict(options)) for label, api, options in group.sides]
    data = None
    try:
        data = suite.data(workload, samples)
    except Exception as exc:
        for side in sides:
            side.fail("preparing the data", exc)
    for side in sides:
        if side.error is None:
            try:
                side.dataset = workload.dataset(data, samples, load_api(side.api_name))
            except Exception as exc:
                side.fail("building the dataset", exc)
    memcpy_rates: list[float] = []
    rounds = config.warmup + config.reps
    for rep in range(rounds):
        tag = "warm-up" if rep < config.warmup else f"rep {rep - config.warmup + 1}/{config.reps}"
        for side in sides:
            where = f"{workload.name:<7} workers={workers} {side.label:<13} {tag:<9}"
            if side.error is not None:
                suite.report(f"{where} skipped ({side.error[:60]})")
                continue
            try:
                limit = batches if rep >= config.warmup else config.warmup_batches(workload)
                run = _run_once(
                    side, workload, workers, config, limit=limit, want_digest=not side.runs
                )
            except Exception as exc:
                suite.report(f"{where} FAILED: {side.fail('run', exc)}")
                continue
            side.runs.append(run)
            suite.report(f"{where} {_describe(run)}")
        nbytes = sides[0].nbytes or next((s.nbytes for s in sides if s.nbytes), None)
        if rep >= config.warmup and nbytes:
            memcpy_rates.append(memcpy_batches_per_s(nbytes))
    torch_side = sides[0]
    for side in sides[1:]:
        mismatch = side.digest and torch_side.digest and side.digest != torch_side.digest
        if mismatch and side.error is None:
            side.error = "the first batch differs from torch's for the same seed"
    rows = []
    for side in sides[1:]:
        errors = [f"{s.label}: {s.error}" for s in (torch_side, side) if s.error]
        rows.append(
            Row(
                workload=workload.name,
                workers=workers,
                worker_type=side.options.get("worker_type", "process") if workers else None,
                batch_size=batch_size,
                batches=batches,
                torch=Summary.of(measured(torch_side.runs, config.warmup)),
                ferry=Summary.of(measured(side.runs, config.warmup)),
                memcpy_batches_per_s=median(memcpy_rates) if memcpy_rates else None,
                errors=tuple(errors),
                details=tuple(s.detail for s in (torch_side, side) if s.detail),
                latency_s=workload.latency_s,
            )
        )
    return rows


def run_suite(config: Config, progress: Progress) -> list[Row]:
    """Run every group of ``config``, reporting each run through ``progress``; one row per
    (workload, workers, worker type)."""
    groups = plan(config)
    total = sum(len(g.sides) for g in groups) * (config.warmup + config.reps)
    suite = _Suite(config, progress, total)
    return [row for group in groups for row in _run_group(group, suite)]
