"""What ``iter(loader)`` returns: the common part of every engine, and the inline engine.

:class:`LoaderIterator` owns what does not depend on where batches are made: the epoch's keys
(from the sampler), the workers' base seed, counting and the length check for iterable
datasets, and pinning. An engine supplies ``_next_batch()``.

The order of random draws matches torch: the sampler is asked for its iterator first, then the
base seed is drawn from the loader's generator (or torch's global RNG), and a shuffling
sampler draws its own seed only when the first batch is asked for.

Iterators work from an :class:`~ferry._engine.plan.EpochPlan` and hold no reference to their
loader (see that module for why).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ferry._engine.alloc import using_allocator
from ferry._engine.fetch import make_fetcher, one_call_gather
from ferry._engine.pin import pin_batch
from ferry._engine.plan import EpochPlan

__all__ = ["InlineIterator", "LoaderIterator"]


class LoaderIterator:
    """Base of the loader's iterators (see the module docstring)."""

    def __init__(self, plan: EpochPlan) -> None:
        self._plan = plan
        self._iterable_style = plan.iterable_style
        self._num_yielded = 0
        self._length_warned = False
        self._gathers = (
            one_call_gather(plan.dataset, plan.auto_collation, plan.collate_fn) is not None
        )
        self._keys = plan.keys(self._gathers)
        self._base_seed = int(
            torch.empty((), dtype=torch.int64).random_(generator=plan.generator).item()
        )

    def __iter__(self) -> LoaderIterator:
        return self

    def __len__(self) -> int:
        # As torch: the length of the index sampler (an endless one for a stream: TypeError).
        return len(self._plan.index_sampler)

    def __next__(self) -> Any:
        batch = self._next_batch()
        self._num_yielded += 1
        # Only a len() asked before the epoch began counts (list(loader) asks one after).
        reported = self._plan.reported_length
        if reported is not None and self._num_yielded > reported and not self._length_warned:
            self._length_warned = True
            warnings.warn(
                f"len() of this DataLoader said {reported} batches (from len(dataset) of "
                f"{type(self._plan.dataset).__name__}), but it has now yielded "
                f"{self._num_yielded}. If the dataset runs in several workers, check that each "
                "worker reads its own share of the stream (see ferry.get_worker_info).",
                UserWarning,
                stacklevel=2,
            )
        if self._plan.pin:
            batch = pin_batch(batch, self._plan.pin_memory_device)
        return batch

    def _next_batch(self) -> Any:
        raise NotImplementedError

    def _shutdown_workers(self) -> None:
        """Stop this iterator's workers now, if it has any (it yields nothing after)."""

    def _restart(self, plan: EpochPlan) -> None:
        """Begin the next epoch on the same iterator (persistent workers)."""
        raise NotImplementedError(f"{type(self).__name__} does not outlive its epoch")

    def __getstate__(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} holds a live epoch (and maybe workers) and cannot be pickled"
        )


class InlineIterator(LoaderIterator):
    """``num_workers=0``: every batch is fetched in the caller's thread."""

    def __init__(self, plan: EpochPlan) -> None:
        if plan.timeout > 0:
            raise AssertionError(
                f"timeout={plan.timeout} applies to waiting for workers and needs "
                "num_workers > 0; with num_workers=0 leave timeout at 0"
            )
        super().__init__(plan)
        self._allocator = plan.buffer_pool
        # Made after the base seed is drawn: an iterable dataset's stream opens here, as in
        # torch, so its __iter__ (and any random draw in it) runs at iter(loader).
        self._fetcher = make_fetcher(
            plan.dataset, plan.iterable_style, plan.auto_collation, plan.collate_fn, plan.drop_last
        )

    def _next_batch(self) -> Any:
        key = next(self._keys)
        with using_allocator(self._allocator):
            return self._fetcher.fetch(key)
