"""One bounded run of a loader: how fast it delivers batches, and where its time goes.

Choices, and why:

- **Warm-up left out.** The figures of a run (batches/s, the stage table) cover its steady
  state: from the batch by which every worker has delivered once (batch ``num_workers``, or the
  first without workers) to the last. Before that, every batch waits on worker start-up, a
  one-off cost that would otherwise be spread over a run of a few hundred batches and blur
  where the time of a long epoch goes. Start-up is reported on its own, as the time to the
  first batch. A run too short to have a steady state (fewer than 3 batches after the warm-up)
  is reported whole.
- **Persistent workers started first.** A loader with ``persistent_workers=True`` pays its
  start-up in the first epoch only, so it is measured in a second epoch: a one-batch epoch
  starts its workers, then the measured epoch reuses them.
- **The training loop** is a ``next()`` call per batch and, when asked (``--step-ms``), a sleep
  standing for the training step. With CUDA present each batch is also copied to the GPU, as a
  training step would, so pinned memory is measured where it pays off.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from statistics import median
from time import perf_counter, sleep
from typing import Any

import torch

from ferry._cli import batch_nbytes
from ferry._torch_types import is_ferry_instance
from ferry.doctor.options import build_loader, with_changes
from ferry.doctor.progress import Bound, Console
from ferry.loader import DataLoader
from ferry.stats import LoaderStats, WorkerStats

__all__ = [
    "EmptyLoader",
    "Measurement",
    "ThreadProbe",
    "cuda_transfer",
    "measure",
    "probe_threads",
]

_MIN_STEADY_BATCHES = 3
# LoaderStats' numbers are sums over the epoch, except these.
_NOT_SUMS = frozenset({"num_workers"})


class EmptyLoader(Exception):
    """The loader yielded no batch."""


@dataclass(frozen=True)
class Measurement:
    """One run of a loader, bounded by a :class:`~ferry.doctor.progress.Bound`."""

    label: str
    batches: int  # taken in all, warm-up included
    warmup: int  # of those, left out of the steady-state figures
    first_batch_s: float  # from iter() to the first batch in hand
    steady_s: float  # the steady state: from the end of the warm-up to the last batch
    ended: bool  # the epoch ended before the bound was reached
    epoch_batches: int | None  # len(loader), or the batches of an epoch that ended; None: unknown
    batch_bytes: int  # bytes of the tensors of the first batch
    wait_median_s: float  # next() per batch in the steady state, median
    wait_max_s: float  # and longest
    stats: LoaderStats | None  # ferry loaders: the steady state's statistics

    @property
    def steady_batches(self) -> int:
        return self.batches - self.warmup

    @property
    def batches_per_s(self) -> float:
        return self.steady_batches / self.steady_s if self.steady_s > 0 else 0.0

    @property
    def startup_s(self) -> float:
        """How much longer the first batch took than a steady one: the start-up."""
        per_batch = 1 / self.batches_per_s if self.batches_per_s else 0.0
        return max(self.first_batch_s - per_batch, 0.0)

    @property
    def epoch_s(self) -> float | None:
        """An epoch's estimated time: the first batch, then the rest at the steady rate."""
        if self.epoch_batches is None or not self.batches_per_s:
            return None
        return self.first_batch_s + (self.epoch_batches - 1) / self.batches_per_s

    def as_dict(self) -> dict[str, Any]:
        plain = dataclasses.asdict(self)
        plain["stats"] = None if self.stats is None else self.stats.as_dict()
        plain.update(
            batches_per_s=self.batches_per_s, startup_s=self.startup_s, epoch_s=self.epoch_s
        )
        return plain


def _between(early: LoaderStats, late: LoaderStats) -> LoaderStats:
    """The statistics of the part of an epoch between two readings of ``loader.stats()``."""
    sums = {
        field.name: getattr(late, field.name) - getattr(early, field.name)
        for field in dataclasses.fields(late)
        if field.name not in _NOT_SUMS
        and isinstance(getattr(late, field.name), (int, float))
        and not isinstance(getattr(late, field.name), bool)
    }
    wall = max(sums["wall_s"], 1e-9)
    workers = tuple(
        WorkerStats(
            now.worker_id,
            now.batches - then.batches,
            now.busy_s - then.busy_s,
            min((now.busy_s - then.busy_s) / wall, 1.0),
        )
        for then, now in zip(early.workers, late.workers, strict=True)
    )
    return dataclasses.replace(late, workers=workers, **sums)


def _epoch_length(loader: Any) -> int | None:
    try:
        return len(loader)
    except (TypeError, NotImplementedError):  # a stream without __len__
        return None


def _start_persistent_workers(loader: Any) -> None:
    """A one-batch epoch: the workers it starts stay up for the measured epoch."""
    iterator = iter(loader)
    next(iterator, None)


def _shut_down(loader: Any, iterator: Iterator[Any]) -> None:
    """Stop the workers of an iterator left mid-epoch now, not whenever it is collected.

    Both ferry's and torch's worker iterators have ``_shutdown_workers``; a loader with
    persistent workers also lets go of its kept iterator (``_iterator = None``, as Lightning
    resets loaders), so nothing outlives the measurement.
    """
    stop = getattr(iterator, "_shutdown_workers", None)
    if callable(stop):
        stop()
    if getattr(loader, "persistent_workers", False):
        loader._iterator = None


def measure(
    loader: Any,
    label: str,
    bound: Bound,
    console: Console,
    *,
    step_s: float = 0.0,
    transfer: Callable[[Any], None] | None = None,
) -> Measurement:
    """Iterate ``loader`` (ferry's or torch's) within ``bound``; see the module docstring.

    Raises :class:`EmptyLoader` when it yields nothing, and whatever the loader raises.
    """
    with_stats = is_ferry_instance(loader, DataLoader)
    if loader.persistent_workers and loader.num_workers > 0:
        _start_persistent_workers(loader)
    warmup = max(1, loader.num_workers)
    waits: list[float] = []
    mark: tuple[float, LoaderStats | None] | None = None  # (time, stats) at the warm-up's end
    first_batch_s, batch_bytes, ended = 0.0, 0, False
    console.start(label, bound)
    started = perf_counter()
    iterator = iter(loader)
    try:
        while True:
            asked = perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                ended = True
                break
            got = perf_counter()
            waits.append(got - asked)
            if len(waits) == 1:
                first_batch_s, batch_bytes = got - started, batch_nbytes(batch)
            if transfer is not None:
                transfer(batch)
            del batch
            if step_s:
                sleep(step_s)
            now = perf_counter()
            if len(waits) == warmup:
                mark = (now, loader.stats() if with_stats else None)
            console.update(len(waits), now - started)
            if bound.reached(len(waits), now - started):
                break
        finished = perf_counter()
        final = loader.stats() if with_stats else None
    finally:
        console.finish()
        _shut_down(loader, iterator)
    batches = len(waits)
    if not batches:
        raise EmptyLoader(f"{label}: the loader yielded no batch")
    if mark is None or batches - warmup < _MIN_STEADY_BATCHES:
        warmup, mark = 0, (started, None)
    steady = waits[warmup:]
    stats = final
    if final is not None and mark[1] is not None:
        stats = _between(mark[1], final)
    return Measurement(
        label=label,
        batches=batches,
        warmup=warmup,
        first_batch_s=first_batch_s,
        steady_s=finished - mark[0],
        ended=ended,
        epoch_batches=batches if ended else _epoch_length(loader),
        batch_bytes=batch_bytes,
        wait_median_s=median(steady),
        wait_max_s=max(steady),
        stats=stats,
    )


@dataclass(frozen=True)
class ThreadProbe:
    """Batches/s of the loader with one worker thread and with two: whether ``__getitem__``
    runs in parallel in threads (it releases the GIL) or takes turns (it holds it)."""

    one_thread: float
    two_threads: float

    @property
    def speedup(self) -> float:
        return self.two_threads / self.one_thread if self.one_thread else 0.0


def probe_threads(
    options: Mapping[str, Any], work_per_batch_s: float, bound: Bound, console: Console
) -> ThreadProbe:
    """Measure the loader with one thread worker, then two, each for about a tenth of
    ``bound`` (at most 3 s, at least 8 batches: enough to tell 1x from 2x)."""
    budget_s = min(bound.seconds / 10, 3.0) if bound.seconds else 3.0
    batches = min(max(math.ceil(budget_s / max(work_per_batch_s, 1e-6)), 8), bound.batches)
    probe_bound = Bound(batches, 2 * budget_s)
    rates = []
    for threads in (1, 2):
        changes = {"num_workers": threads, "worker_type": "thread", "persistent_workers": False}
        loader = build_loader(with_changes(options, changes))
        label = f"probing the GIL with {threads} worker thread{'s' if threads > 1 else ''}"
        rates.append(measure(loader, label, probe_bound, console).batches_per_s)
        del loader
    return ThreadProbe(*rates)


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for item in batch:
            yield from _tensors(item)


def cuda_transfer() -> Callable[[Any], None] | None:
    """With CUDA present, what a training step does first: copy the batch's tensors to the GPU
    (asynchronously, which only pinned memory allows) and wait for the copies. None without."""
    if not torch.cuda.is_available():
        return None

    def transfer(batch: Any) -> None:
        for tensor in _tensors(batch):
            tensor.to("cuda", non_blocking=True)
        torch.cuda.synchronize()

    return transfer
