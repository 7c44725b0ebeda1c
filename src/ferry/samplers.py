"""Samplers: the order in which a map-style dataset is read.

Every built-in sampler yields exactly the sequence torch's sampler of the same name yields for
the same arguments and the same ``torch.Generator`` state, because each one draws from the
generator in the same calls, sizes and order.

Besides the public per-index iteration, the built-in samplers can hand out their indices as
whole ``int64`` tensors (:func:`index_chunks`); :class:`BatchSampler` turns those into batch
tensors (:func:`index_batches`). The loader uses that path when the dataset can gather a batch
from a tensor of indices in one call, so no Python ``int`` is created per sample.

Example::

    >>> g = torch.Generator().manual_seed(0)
    >>> list(BatchSampler(RandomSampler(range(6), generator=g), batch_size=4, drop_last=False))
    [[2, 0, 1, 3], [4, 5]]
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any, TypeVar

import torch

from ferry._torch_types import (
    TorchBatchSampler,
    TorchRandomSampler,
    TorchSampler,
    TorchSequentialSampler,
    TorchSubsetRandomSampler,
    TorchWeightedRandomSampler,
)
from ferry._validate import check_bool, check_positive_int

__all__ = [
    "BatchSampler",
    "RandomSampler",
    "Sampler",
    "SequentialSampler",
    "SubsetRandomSampler",
    "TensorChunkSampler",
    "WeightedRandomSampler",
    "index_batches",
    "index_chunks",
]

T_co = TypeVar("T_co", covariant=True)

# torch draws indices with replacement 32 at a time; drawing in the same sizes is what makes the
# sequence identical for the same generator state.
_REPLACEMENT_DRAW = 32
_SEQUENTIAL_CHUNK = 1 << 16


class Sampler(TorchSampler[T_co]):
    """Base class of samplers: an iterable of dataset keys (or of batches of keys).

    A subclass of ``torch.utils.data.Sampler`` (so ``isinstance`` checks written for torch accept
    it), with ferry's own behaviour.

    Subclasses define ``__iter__`` and, when the length is known, ``__len__``.

    Example::

        >>> class EvenSampler(Sampler[int]):
        ...     def __init__(self, n: int) -> None:
        ...         self.n = n
        ...     def __iter__(self):
        ...         return iter(range(0, self.n, 2))
        >>> list(EvenSampler(5))
        [0, 2, 4]
    """

    def __init__(self, data_source: Sized | None = None) -> None:
        if data_source is not None:
            warnings.warn(
                "Sampler(data_source) is ignored: the base class keeps no reference to the data "
                "source; store it in your subclass if you need it",
                UserWarning,
                stacklevel=2,
            )

    def __iter__(self) -> Iterator[T_co]:
        raise NotImplementedError(f"{type(self).__name__} must define __iter__")


class TensorChunkSampler(Sampler[int]):
    """Base of samplers whose keys are made as 1-D ``int64`` tensors by ``_index_chunks``.

    Iterating yields those tensors' elements as Python ints; the loader may instead take the
    tensors themselves (:func:`index_chunks`), as long as a subclass does not override
    ``__iter__``.
    """

    def __iter__(self) -> Iterator[int]:
        for chunk in self._index_chunks():
            yield from chunk.tolist()

    def _index_chunks(self) -> Iterator[torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} must define _index_chunks")


def _fresh_generator() -> torch.Generator:
    """A generator seeded from torch's global RNG, consuming one draw of it (as torch does)."""
    seed = int(torch.empty((), dtype=torch.int64).random_().item())
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


class SequentialSampler(Sampler[int], TorchSequentialSampler):
    """Yields ``0, 1, ..., len(data_source) - 1``."""

    data_source: Sized

    def __init__(self, data_source: Sized) -> None:
        self.data_source = data_source

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.data_source)))

    def __len__(self) -> int:
        return len(self.data_source)

    def _index_chunks(self) -> Iterator[torch.Tensor]:
        # Bounded chunks: a dataset of a billion rows must not cost 8 GB of indices up front.
        total = len(self.data_source)
        for start in range(0, total, _SEQUENTIAL_CHUNK):
            yield torch.arange(start, min(start + _SEQUENTIAL_CHUNK, total), dtype=torch.int64)


class RandomSampler(TensorChunkSampler, TorchRandomSampler):
    """Yields indices in random order: a permutation, or draws with replacement.

    Without replacement, ``num_samples`` larger than the dataset yields whole permutations one
    after another, then the head of one more. With ``generator=None`` a fresh generator is
    seeded from torch's global RNG at the start of each iteration.
    """

    data_source: Sized
    replacement: bool

    def __init__(
        self,
        data_source: Sized,
        replacement: bool = False,
        num_samples: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.data_source = data_source
        self.replacement = replacement
        self._num_samples = num_samples
        self.generator = generator
        if not isinstance(replacement, bool):
            raise TypeError(f"replacement must be a bool, got {replacement!r}")
        count = self.num_samples
        if not isinstance(count, int) or count <= 0:
            raise ValueError(
                f"num_samples must be a positive integer, got {count!r}"
                + (" (the dataset is empty)" if num_samples is None else "")
            )

    @property
    def num_samples(self) -> int:
        """How many indices one iteration yields (the dataset's length unless given)."""
        if self._num_samples is None:
            return len(self.data_source)
        return self._num_samples

    def __len__(self) -> int:
        return self.num_samples

    def _index_chunks(self) -> Iterator[torch.Tensor]:
        n = len(self.data_source)
        generator = self.generator if self.generator is not None else _fresh_generator()
        count = self.num_samples
        if self.replacement:
            for _ in range(count // _REPLACEMENT_DRAW):
                yield torch.randint(
                    high=n, size=(_REPLACEMENT_DRAW,), dtype=torch.int64, generator=generator
                )
            yield torch.randint(
                high=n, size=(count % _REPLACEMENT_DRAW,), dtype=torch.int64, generator=generator
            )
            return
        for _ in range(count // n):
            yield torch.randperm(n, generator=generator)
        # Drawn even when empty, as torch does: it advances the generator for the next epoch.
        yield torch.randperm(n, generator=generator)[: count % n]


class SubsetRandomSampler(Sampler[Any], TorchSubsetRandomSampler):
    """Yields the given indices in random order (without replacement)."""

    indices: Sequence[Any]

    def __init__(self, indices: Sequence[Any], generator: torch.Generator | None = None) -> None:
        self.indices = indices
        self.generator = generator

    def __iter__(self) -> Iterator[Any]:
        for position in torch.randperm(len(self.indices), generator=self.generator).tolist():
            yield self.indices[position]

    def __len__(self) -> int:
        return len(self.indices)


class WeightedRandomSampler(TensorChunkSampler, TorchWeightedRandomSampler):
    """Yields ``num_samples`` indices in ``[0, len(weights))`` drawn with the given weights.

    Weights need not sum to one. Without replacement an index is drawn at most once, so
    ``num_samples`` may not exceed the number of non-zero weights.
    """

    weights: torch.Tensor
    num_samples: int
    replacement: bool

    def __init__(
        self,
        weights: Sequence[float] | torch.Tensor,
        num_samples: int,
        replacement: bool = True,
        generator: torch.Generator | None = None,
    ) -> None:
        check_positive_int("num_samples", num_samples, error=ValueError)
        check_bool("replacement", replacement, error=ValueError)
        weights_tensor = torch.as_tensor(weights, dtype=torch.double)
        if weights_tensor.dim() != 1:
            raise ValueError(
                "weights must be a one-dimensional sequence, got shape "
                f"{tuple(weights_tensor.shape)}"
            )
        self.weights = weights_tensor
        self.num_samples = num_samples
        self.replacement = replacement
        self.generator = generator

    def __len__(self) -> int:
        return self.num_samples

    def _index_chunks(self) -> Iterator[torch.Tensor]:
        yield torch.multinomial(
            self.weights, self.num_samples, self.replacement, generator=self.generator
        )


class BatchSampler(Sampler[list[Any]], TorchBatchSampler):
    """Groups the keys of another sampler (or any iterable) into lists of ``batch_size``.

    The last, shorter batch is kept unless ``drop_last`` is true.

    Example::

        >>> list(BatchSampler(range(7), batch_size=3, drop_last=False))
        [[0, 1, 2], [3, 4, 5], [6]]
    """

    sampler: Sampler[Any] | Iterable[Any]
    batch_size: int
    drop_last: bool

    def __init__(
        self, sampler: Sampler[Any] | Iterable[Any], batch_size: int, drop_last: bool
    ) -> None:
        check_positive_int("batch_size", batch_size, error=ValueError)
        check_bool("drop_last", drop_last, error=ValueError)
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[list[Any]]:
        keys = iter(self.sampler)
        size = self.batch_size
        while batch := list(itertools.islice(keys, size)):
            if len(batch) < size and self.drop_last:
                return
            yield batch

    def __len__(self) -> int:
        count = len(self.sampler)  # type: ignore[arg-type]
        if self.drop_last:
            return count // self.batch_size
        return (count + self.batch_size - 1) // self.batch_size


def index_chunks(sampler: object) -> Iterator[torch.Tensor] | None:
    """The sampler's keys as 1-D ``int64`` tensors, or None when it cannot give them so.

    Draws from the generator exactly as iterating the sampler would, lazily: nothing is drawn
    until the first chunk is asked for. A subclass that overrides ``__iter__`` decides its keys
    itself, so it gets None.
    """
    iter_fn = getattr(type(sampler), "__iter__", None)
    if isinstance(sampler, SequentialSampler) and iter_fn is SequentialSampler.__iter__:
        return sampler._index_chunks()
    if isinstance(sampler, TensorChunkSampler) and iter_fn is TensorChunkSampler.__iter__:
        return sampler._index_chunks()
    return None


def index_batches(batch_sampler: object) -> Iterator[torch.Tensor] | None:
    """The batches of a built-in :class:`BatchSampler` as ``int64`` tensors, or None.

    Yields the same batches as iterating ``batch_sampler`` (same keys, same RNG draws), without
    creating a Python ``int`` per key. None when the batch sampler, or the sampler it wraps, is
    not one whose sequence is known to come from tensor chunks.
    """
    if not isinstance(batch_sampler, BatchSampler):
        return None
    if type(batch_sampler).__iter__ is not BatchSampler.__iter__:
        return None
    chunks = index_chunks(batch_sampler.sampler)
    if chunks is None:
        return None
    return _rebatch(chunks, batch_sampler.batch_size, batch_sampler.drop_last)


def _rebatch(chunks: Iterator[torch.Tensor], size: int, drop_last: bool) -> Iterator[torch.Tensor]:
    pending: list[torch.Tensor] = []
    pending_len = 0
    for chunk in chunks:
        start, end = 0, chunk.numel()
        while start < end:
            piece = chunk[start : start + size - pending_len]
            start += piece.numel()
            if not pending and piece.numel() == size:
                yield piece
                continue
            pending.append(piece)
            pending_len += piece.numel()
            if pending_len == size:
                yield torch.cat(pending)
                pending, pending_len = [], 0
    if pending and not drop_last:
        yield torch.cat(pending)
