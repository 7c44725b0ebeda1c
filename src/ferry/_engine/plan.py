"""What an iterator needs from its loader, taken when the iterator is made.

An iterator keeps no reference to its :class:`~ferry.DataLoader`: a loader with persistent
workers holds its iterator, and a reference back would make a cycle that keeps the workers
alive after the user drops the loader, until a garbage-collection pass. The loader hands each
new epoch a fresh :class:`EpochPlan` instead.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ferry._engine.alloc import BufferPool
from ferry.samplers import index_batches

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

    @property
    def auto_collation(self) -> bool:
        return self.batch_sampler is not None

    @property
    def index_sampler(self) -> Any:
        return self.batch_sampler if self.batch_sampler is not None else self.sampler

    def keys(self, tensor_batches: bool) -> Iterator[Any]:
        """The keys of one epoch, one per batch to fetch (see :mod:`ferry._engine.fetch`).

        ``iter()`` is called on the sampler here, eagerly, as torch does when an iterator is
        made. With ``tensor_batches``, a built-in batch sampler hands out index tensors.
        """
        if self.iterable_style:
            return itertools.repeat(self.batch_size)
        if self.batch_sampler is None:
            return iter(self.sampler)
        if tensor_batches:
            batches = index_batches(self.batch_sampler)
            if batches is not None:
                return batches
        return iter(self.batch_sampler)
