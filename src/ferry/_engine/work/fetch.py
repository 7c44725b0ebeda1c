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

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from time import perf_counter, thread_time
from typing import Any, NamedTuple

import torch

from ferry._core.alloc import Allocator, using_allocator
from ferry._engine.work.aio import AsyncReads
from ferry._engine.work.reads import Failed, SampleReads, busy_of
from ferry.collate import default_collate, default_map_is_pristine
from ferry.datasets import fetch_many, tensor_gather
from ferry.errors import SkippedSample

__all__ = [
    "DROPPED",
    "BatchDropped",
    "IterableFetcher",
    "MapFetcher",
    "Outcome",
    "SkippingMapFetcher",
    "Timing",
    "make_fetcher",
    "one_call_gather",
]


class Timing(NamedTuple):
    """Where a worker's time went on one batch, and the bytes that crossed (ferry.stats).

    A named tuple: it crosses with every batch, inside :class:`Done`, which sends it as a plain
    tuple and makes it a Timing again without running Python code (a slotted dataclass runs
    two functions to pickle, two to unpickle: about 2 us a batch on each side)."""

    fetch_s: float = 0.0
    collate_s: float = 0.0
    hand_off_s: float = 0.0  # pickling in the worker (its part of the hand-off)
    hand_off_bytes: int = 0  # the pickle plus the slab bytes of the batch

    @property
    def made_s(self) -> float:
        """Making the batch: fetch and collate."""
        return self.fetch_s + self.collate_s


# The batches whose CPU time a fetcher measures: the first CPU_FIRST, and more until they held
# JUDGED_READS samples (num_workers="auto" judges that many at least), then one in CPU_SAMPLE.
CPU_FIRST = 2
JUDGED_READS = 8
CPU_SAMPLE = 16

# What an engine hands on in place of a batch that BatchDropped ended.
DROPPED: Any = object()


class BatchDropped(Exception):
    """Every sample of a batch failed (``on_error="skip"``): there is no batch to hand out.
    The fetcher's :attr:`_TimedFetch.outcome` says which samples and why."""


def one_call_gather(
    dataset: Any, auto_collation: bool, collate_fn: Callable[..., Any]
) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None:
    """The dataset's one-call batch gather, when the loader may use it for whole batches:
    batching is on and the collate is the built-in :func:`default_collate` with its built-in
    map, so the gathered columns are exactly the batch torch would build."""
    if not auto_collation or collate_fn is not default_collate or not default_map_is_pristine():
        return None
    return tensor_gather(dataset)


Outcome = tuple[int, tuple[SkippedSample, ...]]  # (samples tried, those dropped)


class _TimedFetch:
    """After each fetch, ``fetch_s`` and ``collate_s`` hold the seconds it spent in the dataset
    and in ``collate_fn`` (for the statistics, :mod:`ferry.stats`).

    With ``skip_as`` set (``on_error="skip"``; the worker id to name in reports), a sample whose
    fetch raises is dropped instead, and after each fetch ``outcome`` says how many samples
    were tried and which were dropped.
    """

    collate_fn: Callable[..., Any]
    skip_as: int | None = None
    fetch_s = 0.0
    collate_s = 0.0
    # CPU seconds the fetching thread used for the last batch (map-style; with per-sample
    # parallel reads, only its own share): against fetch_s + collate_s, how much it waited.
    # Measured for the first batches and one in CPU_SAMPLE after (a CPU clock read is a system
    # call, 0.4 us, a real share of the cheapest batches); -1 for a batch not measured. The
    # first CPU_FIRST, and more until they held JUDGED_READS samples, which num_workers="auto"
    # judges (do the reads wait? switch.WaitJudge), also count the time the thread waited for
    # a CPU (reads.busy_of, about 10 us a read): on a machine with more runnable threads than
    # CPUs that wait is not a read that waits, and counted as one it would move CPU-bound work
    # to threads.
    cpu_s = -1.0
    # Of a measured batch whose reads ran at once on other threads: their wall and CPU
    # seconds, summed, and their count (SampleReads.last_parallel); None otherwise.
    parallel: tuple[float, float, int] | None = None
    _fetched = 0
    _judged = 0  # samples of the batches measured for the judge so far
    outcome: Outcome = (0, ())

    def _dropped(self, index: Any, exc: BaseException, stream: bool) -> SkippedSample:
        assert self.skip_as is not None
        return SkippedSample.of(index, stream, self.skip_as, os.getpid(), exc)

    def _collate(self, samples: Any, started: float) -> Any:
        """``collate_fn(samples)``, the samples having been fetched since ``started``."""
        fetched = perf_counter()
        batch = self.collate_fn(samples)
        self.fetch_s, self.collate_s = fetched - started, perf_counter() - fetched
        return batch


class MapFetcher(_TimedFetch):
    """Fetches batches of a map-style dataset by key (timed: see :class:`_TimedFetch`)."""

    def __init__(
        self,
        dataset: Any,
        auto_collation: bool,
        collate_fn: Callable[..., Any],
        skip_as: int | None = None,
        reads: SampleReads | AsyncReads | None = None,
        *,
        count: tuple[memoryview, int] | None = None,
    ) -> None:
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.skip_as = skip_as
        self.gather = one_call_gather(dataset, auto_collation, collate_fn)
        # Per-sample reads, in parallel when they wait (thread workers; see reads.py): only
        # for a dataset read one __getitem__ per key (a __getitems__ decides for itself). An
        # async dataset's reads (aio.py) take every read, __getitems__ and batching off too.
        per_sample = auto_collation and not callable(getattr(dataset, "__getitems__", None))
        self.reads = reads if per_sample or isinstance(reads, AsyncReads) else None
        self._one = reads.one if isinstance(reads, AsyncReads) else None
        # Samples counted as they are made (see make_fetcher): one __getitem__ per key only.
        self._count = count if per_sample and self.reads is None else None

    def fetch(self, key: Any) -> Any:
        self._fetched += 1
        judged = self._fetched <= CPU_FIRST or self._judged < JUDGED_READS
        if not judged and self._fetched % CPU_SAMPLE:
            self.cpu_s, self.parallel = -1.0, None
            return self._fetch(key)
        if judged:
            self._judged += len(key) if self.auto_collation and hasattr(key, "__len__") else 1
        clock = busy_of if judged else thread_time
        cpu = clock()
        try:
            return self._fetch(key)
        finally:
            self.cpu_s = clock() - cpu
            if isinstance(self.reads, SampleReads):
                self.parallel = self.reads.last_parallel()

    def _fetch(self, key: Any) -> Any:
        start = perf_counter()
        if not self.auto_collation:
            samples = self.dataset[key] if self._one is None else self._one(self.dataset, key)
        elif self.gather is not None and (isinstance(key, torch.Tensor) or _int_keys(key)):
            # Already the collated batch: the columns of the rows at these indices (the
            # built-in samplers' keys come as a tensor; a user's sampler's as ints).
            if not isinstance(key, torch.Tensor):
                key = torch.tensor(key, dtype=torch.int64)
            batch = list(self.gather(key))
            self.fetch_s, self.collate_s = perf_counter() - start, 0.0
            return batch
        elif self.reads is not None:
            samples = self.reads.read(self.dataset, _key_list(key))
        elif self._count is not None:
            samples = _fetch_counted(self.dataset, key, *self._count)
        else:
            samples = fetch_many(self.dataset, key)
        return self._collate(samples, start)


def _fetch_counted(dataset: Any, keys: Any, counts: memoryview, slot: int) -> list[Any]:
    """One ``__getitem__`` per key, each sample counted in ``counts[slot]`` as it is made."""
    samples = []
    for key in keys:
        samples.append(dataset[key])
        counts[slot] += 1
    return samples


def _int_keys(key: Any) -> bool:
    """Keys a one-call gather reads as the rows would be read: a non-empty list of ints."""
    return type(key) is list and bool(key) and all(type(k) is int for k in key)


def _key_list(key: Any) -> list[Any]:
    return key.tolist() if isinstance(key, torch.Tensor) else list(key)


class SkippingMapFetcher(MapFetcher):
    """A :class:`MapFetcher` for ``on_error="skip"`` (its own class, so the common path has no
    skip check)."""

    def _fetch(self, key: Any) -> Any:
        """``on_error="skip"``: the batch in one go first (the fast path, and the common case);
        if that raises, sample by sample, dropping the samples that raise. The batch then comes
        out short: filling it from later keys would shift every later batch's boundaries, and
        a resume's position, by the number of bad samples."""
        start = perf_counter()
        if self.reads is not None and self.auto_collation:
            return self._fetch_each(_key_list(key), start)
        try:
            batch = super()._fetch(key)
        except StopIteration:
            raise  # ends a map-style epoch, as in torch: not a bad sample
        except Exception as exc:
            if not self.auto_collation:
                self.outcome = (1, (self._dropped(key, exc, stream=False),))
                self.fetch_s, self.collate_s = perf_counter() - start, 0.0
                raise BatchDropped from None
        else:
            self.outcome = (len(key) if self.auto_collation else 1, ())
            return batch
        keys = key.tolist() if isinstance(key, torch.Tensor) else key
        samples, dropped = [], []
        for index in keys:
            try:
                samples.append(fetch_many(self.dataset, [index])[0])
            except StopIteration:
                raise
            except Exception as exc:
                dropped.append(self._dropped(index, exc, stream=False))
        return self._keep(len(keys), samples, dropped, start)

    def _fetch_each(self, keys: list[Any], start: float) -> Any:
        """Per-sample reads (thread workers): every key read once, the failing ones dropped."""
        assert self.reads is not None
        samples, dropped = [], []
        results = self.reads.read(self.dataset, keys, collect=True)
        for index, result in zip(keys, results, strict=True):
            if isinstance(result, Failed):
                dropped.append(self._dropped(index, result.error, stream=False))
            else:
                samples.append(result)
        return self._keep(len(keys), samples, dropped, start)

    def _keep(
        self, tried: int, samples: list[Any], dropped: list[SkippedSample], start: float
    ) -> Any:
        self.outcome = (tried, tuple(dropped))
        if not samples:
            self.fetch_s, self.collate_s = perf_counter() - start, 0.0
            raise BatchDropped
        # (a collate_fn that raises on the good samples raises: that is not a bad sample)
        return self._collate(samples, start)


class IterableFetcher(_TimedFetch):
    """Takes batches from the stream of an iterable-style dataset.

    The stream is opened when the fetcher is made (as torch opens it when the iterator is
    made). A short last batch is dropped when ``drop_last``; once the stream has ended every
    later fetch raises StopIteration without touching it. Timed: see :class:`_TimedFetch`.
    """

    def __init__(
        self,
        dataset: Any,
        auto_collation: bool,
        collate_fn: Callable[..., Any],
        drop_last: bool,
        skip_as: int | None = None,
    ) -> None:
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.skip_as = skip_as
        self.stream: Iterator[Any] = iter(dataset)
        self.items = 0  # samples taken from the stream so far (dropped ones included)
        self._ended = False

    def fetch(self, count: int | None) -> Any:
        if self._ended:
            raise StopIteration
        if self.skip_as is not None:
            return self._fetch_skipping(count)
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

    def _fetch_skipping(self, count: int | None) -> Any:
        """``on_error="skip"``: an item whose reading raises is dropped and the stream goes on
        (the batch is filled from the next items). A Python generator that raised is finished,
        so its stream ends there; an iterator object whose ``__next__`` raised is asked again.
        After many failures in a row (the batch size, at least 32), the batch is handed out as it
        is, so the main process can judge the error budget."""
        start = perf_counter()
        wanted = 1 if count is None else count
        samples: list[Any] = []
        dropped: list[SkippedSample] = []
        in_a_row, patience = 0, max(wanted, 32)
        while len(samples) < wanted and in_a_row < patience:
            try:
                sample = next(self.stream)
            except StopIteration:
                self._ended = True
                break
            except Exception as exc:
                dropped.append(self._dropped(self.items, exc, stream=True))
                in_a_row += 1
            else:
                samples.append(sample)
                in_a_row = 0
            self.items += 1
        self.outcome = (len(samples) + len(dropped), tuple(dropped))
        if not samples or (self.drop_last and self._ended and len(samples) < wanted):
            if dropped:  # reported; the next fetch ends the epoch
                self.fetch_s, self.collate_s = perf_counter() - start, 0.0
                raise BatchDropped
            raise StopIteration
        return self._collate(samples[0] if count is None else samples, start)

    @property
    def ended(self) -> bool:
        """Whether the stream has run out (every later fetch raises StopIteration)."""
        return self._ended

    def end(self) -> None:
        """Take the stream as run out (a resume where it had): no sample is read from it."""
        self._ended = True

    def drop(self, count: int) -> None:
        """Read and drop ``count`` samples (a resume of a stream that has no state); with
        ``on_error="skip"``, items that fail count as read (they were dropped the first time).
        A stream that has run out is not read."""
        if self._ended:
            return
        for _ in range(count):
            try:
                next(self.stream)
            except StopIteration:
                self._ended = True
                return
            except Exception:
                if self.skip_as is None:
                    raise
            self.items += 1


@dataclass(slots=True)
class Made:
    """One batch as it was made, inline or in a worker: what the statistics, the skip budget and
    the hand-off need of it."""

    batch: Any  # DROPPED: on_error="skip" dropped every sample
    fetch_s: float
    collate_s: float
    cpu_s: float  # -1: not measured (see CPU_SAMPLE)
    outcome: Outcome | None  # on_error="skip": (samples tried, samples dropped)
    parallel: tuple[float, float, int] | None = None  # (see _TimedFetch.parallel)

    def timing(self, hand_off_s: float = 0.0, hand_off_bytes: int = 0) -> Timing:
        """This batch's :class:`~ferry._engine.transport.messages.Timing`, with its hand-off."""
        return Timing(self.fetch_s, self.collate_s, hand_off_s, hand_off_bytes)


def make_batch(
    fetcher: MapFetcher | IterableFetcher, key: Any, allocator: Allocator | None, skip: bool
) -> Made:
    """Make the batch of ``key`` with ``fetcher``, collate's tensors coming from ``allocator``
    (pooled memory inline and in thread workers, shared-memory slabs in process workers): the
    one way a batch is made, by the inline engine and by every worker. A batch whose every
    sample ``on_error="skip"`` dropped is :data:`DROPPED`; any other error (a stream's end
    included) is raised."""
    try:
        with using_allocator(allocator):
            batch = fetcher.fetch(key)
    except BatchDropped:
        batch = DROPPED
    outcome = fetcher.outcome if skip else None
    return Made(batch, fetcher.fetch_s, fetcher.collate_s, fetcher.cpu_s, outcome, fetcher.parallel)


def make_fetcher(
    dataset: Any,
    iterable: bool,
    auto_collation: bool,
    collate_fn: Callable[..., Any],
    drop_last: bool,
    *,
    skip_as: int | None = None,
    reads: SampleReads | AsyncReads | None = None,
    count: tuple[memoryview, int] | None = None,
) -> MapFetcher | IterableFetcher:
    """The fetcher for a dataset; ``skip_as``: the worker id, with ``on_error="skip"``;
    ``reads``: per-sample reads shared by a loader's thread workers, or an async dataset's
    reads (map-style only); ``count``: where a process worker counts the samples it makes one
    by one, for the thread that moves workers round the CPUs (``placement.Tally``)."""
    if iterable:
        return IterableFetcher(dataset, auto_collation, collate_fn, drop_last, skip_as)
    if skip_as is not None:
        return SkippingMapFetcher(dataset, auto_collation, collate_fn, skip_as, reads)
    return MapFetcher(dataset, auto_collation, collate_fn, reads=reads, count=count)
