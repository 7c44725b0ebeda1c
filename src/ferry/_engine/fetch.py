"""The one fetch path: a key from the epoch plan in, a collated batch out.

Every engine (inline, thread workers, process workers) calls the same fetcher; they differ only
in where it runs and how the batch travels back. A *key* is what the plan hands out for one
batch:

* map-style, automatic batching: a list of dataset keys, or an ``int64`` tensor of indices when
  the dataset can gather a batch from a tensor in one call (:func:`ferry.datasets.tensor_gather`);
* map-style, batching off: one dataset key;
* iterable-style: how many samples to take from the stream (None when batching is off).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from time import perf_counter
from typing import Any

import torch

from ferry.collate import RowBatch, default_collate, default_map_is_pristine
from ferry.datasets import fetch_many, tensor_gather

__all__ = ["IterableFetcher", "MapFetcher", "make_fetcher", "one_call_gather"]


def one_call_gather(
    dataset: Any, auto_collation: bool, collate_fn: Callable[..., Any]
) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None:
    """The dataset's one-call batch gather, when the loader may use it for whole batches:
    batching is on and the collate is the built-in :func:`default_collate` with its built-in
    map, so the gathered columns are exactly the batch torch would build."""
    if not auto_collation or collate_fn is not default_collate or not default_map_is_pristine():
        return None
    return tensor_gather(dataset)


class _TimedFetch:
    """After each fetch, ``fetch_s`` and ``collate_s`` hold the seconds it spent in the dataset
    and in ``collate_fn`` (for the statistics, :mod:`ferry.stats`)."""

    collate_fn: Callable[..., Any]
    fetch_s = 0.0
    collate_s = 0.0

    def _collate(self, samples: Any, started: float) -> Any:
        """``collate_fn(samples)``, the samples having been fetched since ``started``."""
        fetched = perf_counter()
        batch = self.collate_fn(samples)
        self.fetch_s, self.collate_s = fetched - started, perf_counter() - fetched
        return batch


class MapFetcher(_TimedFetch):
    """Fetches batches of a map-style dataset by key (timed: see :class:`_TimedFetch`)."""

    def __init__(self, dataset: Any, auto_collation: bool, collate_fn: Callable[..., Any]) -> None:
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self._default = collate_fn is default_collate
        self.gather = one_call_gather(dataset, auto_collation, collate_fn)

    def fetch(self, key: Any) -> Any:
        start = perf_counter()
        if not self.auto_collation:
            samples = self.dataset[key]
        elif isinstance(key, torch.Tensor) and self.gather is not None:
            # Already the collated batch: the columns of the rows at these indices.
            batch = list(self.gather(key))
            self.fetch_s, self.collate_s = perf_counter() - start, 0.0
            return batch
        else:
            samples = fetch_many(self.dataset, key)
            if type(samples) is RowBatch and not self._default:
                samples = list(samples)  # a user's collate_fn gets the plain list torch gives
        return self._collate(samples, start)


class IterableFetcher(_TimedFetch):
    """Takes batches from the stream of an iterable-style dataset.

    The stream is opened when the fetcher is made (as torch opens it when the iterator is
    made). A short last batch is dropped when ``drop_last``; once the stream has ended every
    later fetch raises StopIteration without touching it. Timed: see :class:`_TimedFetch`.
    """

    def __init__(
        self, dataset: Any, auto_collation: bool, collate_fn: Callable[..., Any], drop_last: bool
    ) -> None:
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.stream: Iterator[Any] = iter(dataset)
        self.items = 0  # samples taken from the stream so far
        self._ended = False

    def fetch(self, count: int | None) -> Any:
        if self._ended:
            raise StopIteration
        start = perf_counter()
        if not self.auto_collation:
            try:
                sample = next(self.stream)
            except StopIteration:
                self._ended = True
                raise
            self.items += 1
            return self._collate(sample, start)
        assert count is not None
        samples = []
        for _ in range(count):
            try:
                samples.append(next(self.stream))
            except StopIteration:
                self._ended = True
                break
        self.items += len(samples)
        if not samples or (self.drop_last and len(samples) < count):
            raise StopIteration
        return self._collate(samples, start)

    def drop(self, count: int) -> None:
        """Read and drop ``count`` samples (a resume of a stream that has no state)."""
        for _ in range(count):
            try:
                next(self.stream)
            except StopIteration:
                self._ended = True
                return
            self.items += 1


def make_fetcher(
    dataset: Any,
    iterable: bool,
    auto_collation: bool,
    collate_fn: Callable[..., Any],
    drop_last: bool,
) -> MapFetcher | IterableFetcher:
    if iterable:
        return IterableFetcher(dataset, auto_collation, collate_fn, drop_last)
    return MapFetcher(dataset, auto_collation, collate_fn)
