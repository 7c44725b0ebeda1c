"""What an iterator needs from its loader, taken when the iterator is made.

An iterator keeps no reference to its :class:`~ferry.DataLoader`: a loader with persistent
workers holds its iterator, and a reference back would make a cycle that keeps the workers
alive after the user drops the loader, until a garbage-collection pass. The loader hands each
new epoch a fresh :class:`EpochPlan` instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ferry._core.alloc import BufferPool
from ferry._engine.failures import FailurePolicy

__all__ = ["EpochPlan"]


@dataclass(frozen=True)
class EpochPlan:
    """A loader's options and parts, as one epoch sees them."""

    dataset: Any
    iterable_style: bool
    sampler: Any
    batch_sampler: Any
    batch_size: int | None
    collate_fn: Callable[[Any], Any]
    drop_last: bool
    generator: torch.Generator | None
    num_workers: int
    prefetch_factor: int | None
    timeout: float
    worker_init_fn: Callable[[int], None] | None
    multiprocessing_context: Any
    persistent_workers: bool
    in_order: bool
    worker_type: str
    pin: bool
    pin_memory_device: str
    buffer_pool: BufferPool
    # len(loader) of an iterable-style dataset, if asked before this epoch began.
    reported_length: int | None
    # The accelerator batches are pinned for ("cuda", ...; None when not pinning), which
    # torch's iterators call _pin_memory_device.
    pin_accelerator: str | None = None
    # How often the user's stateful parts (sampler, dataset, stream) are asked for their state.
    snapshot_every: int = 1
    # on_error, max_errors, max_worker_restarts, stall_warning
    failures: FailurePolicy = field(default_factory=FailurePolicy)
    # num_workers="auto" with process workers: each reads a batch's samples at once on a pool
    # of its own where they wait (reads.py, alone) ...
    reads_at_once: bool = False
    # ... and they may give way to thread workers within the epoch when the reads are measured
    # to wait (see ThreadMove.move in tuning/switch.py): not once the loader found such
    # threads bound by the GIL (Tuner.gil_bound).
    threads_if_waiting: bool = False
    # ... and the workers after the first are held back until worker 0's first read is judged
    # (see HeldWorkers): not once an earlier epoch of the loader judged its reads to compute.
    hold_workers: bool = False
    # balance_workers=True: the worker that would finish it first makes the next batch
    # (see schedule.py).
    balance_workers: bool = False
    # move_workers (resolved: None became whether it can): process workers trade CPUs while an
    # epoch runs (crew/placement.py).
    move_workers: bool = False

    @property
    def auto_collation(self) -> bool:
        return self.batch_sampler is not None

    @property
    def index_sampler(self) -> Any:
        return self.batch_sampler if self.batch_sampler is not None else self.sampler
