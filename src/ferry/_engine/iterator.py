"""What ``iter(loader)`` returns: the common part of every engine, and the inline engine.

:class:`LoaderIterator` owns what does not depend on where batches are made: the epoch plan
(keys from the sampler), the workers' base seed, counting and the length check for iterable
datasets, and pinning. An engine supplies ``_next_batch()``.

The order of random draws matches torch: the sampler is asked for its iterator first, then the
base seed is drawn from the loader's generator (or torch's global RNG), and a shuffling
sampler draws its own seed only when the first batch is asked for.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from ferry._engine.alloc import using_allocator
from ferry._engine.fetch import make_fetcher, one_call_gather
from ferry._engine.pin import accelerator_available, pin_batch
from ferry.samplers import index_batches

if TYPE_CHECKING:
    from ferry.loader import DataLoader

__all__ = ["InlineIterator", "LoaderIterator", "epoch_keys"]


def epoch_keys(loader: DataLoader[Any], tensor_batches: bool) -> Iterator[Any]:
    """The keys of one epoch, one per batch to fetch (see :mod:`ferry._engine.fetch`).

    ``iter()`` is called on the sampler here, eagerly, as torch does when an iterator is made.
    """
    if loader._iterable_style:
        return itertools.repeat(loader.batch_size)
    if loader.batch_sampler is None:
        return iter(loader.sampler)
    if tensor_batches:
        batches = index_batches(loader.batch_sampler)
        if batches is not None:
            return batches
    return iter(loader.batch_sampler)


class LoaderIterator:
    """Base of the loader's iterators (see the module docstring)."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        self._loader = loader
        self._iterable_style = loader._iterable_style
        self._pin_device = loader.pin_memory_device
        self._pin = loader.pin_memory and accelerator_available()
        if loader.pin_memory and not self._pin:
            loader._warn_no_accelerator()
        self._num_yielded = 0
        # Only a len() asked before the iterator was made counts (list(loader) asks one after).
        self._reported_length = loader._iterable_len_reported
        self._length_warned = False
        self._gathers = (
            one_call_gather(loader.dataset, loader._auto_collation, loader.collate_fn) is not None
        )
        self._keys = epoch_keys(loader, self._gathers)
        self._base_seed = int(
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item()
        )

    def __iter__(self) -> LoaderIterator:
        return self

    def __len__(self) -> int:
        # As torch: the length of the index sampler (an endless one for a stream: TypeError).
        return len(self._loader._index_sampler)  # type: ignore[arg-type]

    def __next__(self) -> Any:
        batch = self._next_batch()
        self._num_yielded += 1
        reported = self._reported_length
        if reported is not None and self._num_yielded > reported and not self._length_warned:
            self._length_warned = True
            warnings.warn(
                f"len() of this DataLoader said {reported} batches (from len(dataset) of "
                f"{type(self._loader.dataset).__name__}), but it has now yielded "
                f"{self._num_yielded}. If the dataset runs in several workers, check that each "
                "worker reads its own share of the stream (see ferry.get_worker_info).",
                UserWarning,
                stacklevel=2,
            )
        if self._pin:
            batch = pin_batch(batch, self._pin_device)
        return batch

    def _next_batch(self) -> Any:
        raise NotImplementedError

    def _restart(self) -> None:
        """Begin the next epoch on the same iterator (persistent workers)."""
        raise NotImplementedError(f"{type(self).__name__} does not outlive its epoch")

    def __getstate__(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} holds a live epoch (and maybe workers) and cannot be pickled"
        )


class InlineIterator(LoaderIterator):
    """``num_workers=0``: every batch is fetched in the caller's thread."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        if loader.timeout > 0:
            raise AssertionError(
                f"timeout={loader.timeout} applies to waiting for workers and needs "
                "num_workers > 0; with num_workers=0 leave timeout at 0"
            )
        super().__init__(loader)
        self._allocator = loader._buffer_pool()
        # Made after the base seed is drawn: an iterable dataset's stream opens here, as in
        # torch, so its __iter__ (and any random draw in it) runs at iter(loader).
        self._fetcher = make_fetcher(
            loader.dataset,
            loader._iterable_style,
            loader._auto_collation,
            loader.collate_fn,
            loader.drop_last,
        )

    def _next_batch(self) -> Any:
        key = next(self._keys)
        with using_allocator(self._allocator):
            return self._fetcher.fetch(key)
