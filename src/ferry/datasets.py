"""Datasets: map-style and iterable-style bases, the wrappers, and :func:`random_split`.

The built-in map-style datasets implement ``__getitems__(indices)`` (one call for a whole
batch); :class:`TensorDataset` and the wrappers around it also gather a batch from a tensor of
indices in one indexing call per tensor (``_ferry_gather``), which the loader uses together with
:func:`ferry.collate.default_collate` so rows are never split and re-stacked.

Example::

    >>> ds = TensorDataset(torch.arange(6).view(3, 2), torch.tensor([0, 1, 0]))
    >>> ds[1]
    (tensor([2, 3]), tensor(1))
    >>> train, val = random_split(ds, [2, 1], generator=torch.Generator().manual_seed(0))
"""

from __future__ import annotations

import bisect
import itertools
import math
import numbers
import warnings
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar, overload

import torch

from ferry._torch_types import (
    TorchChainDataset,
    TorchConcatDataset,
    TorchDataset,
    TorchIterableDataset,
    TorchStackDataset,
    TorchSubset,
    TorchTensorDataset,
    TorchTwin,
    is_ferry_instance,
)
from ferry.collate import default_collate

__all__ = [
    "ChainDataset",
    "ConcatDataset",
    "Dataset",
    "IterableDataset",
    "StackDataset",
    "Subset",
    "TensorDataset",
    "is_iterable_style",
    "fetch_many",
    "random_split",
    "tensor_gather",
]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Dataset(TorchTwin, TorchDataset[T_co], twin=TorchDataset):
    """Base of map-style datasets: keys (usually ``0..len-1``) map to samples.

    A subclass of ``torch.utils.data.Dataset`` (so ``isinstance`` checks written for torch accept
    it), with ferry's own behaviour.

    Subclasses define ``__getitem__``, usually ``__len__``, and optionally
    ``__getitems__(indices) -> list`` to fetch a whole batch in one call.
    ``a + b`` concatenates two datasets.

    Example::

        >>> class Squares(Dataset[int]):
        ...     def __len__(self):
        ...         return 4
        ...     def __getitem__(self, i):
        ...         return i * i
        >>> list(Squares() + Squares())[:5]
        [0, 1, 4, 9, 0]
    """

    def __getitem__(self, index: Any) -> T_co:
        raise NotImplementedError(
            f"Subclasses of Dataset should implement __getitem__: {type(self).__name__} does not"
        )

    def __add__(self, other: TorchDataset[T_co]) -> ConcatDataset[T_co]:
        return ConcatDataset([self, other])


class IterableDataset(Dataset[T_co], TorchIterableDataset[T_co], twin=TorchIterableDataset):
    """Base of iterable-style datasets: a stream of samples from ``__iter__``.

    ``__iter__`` is abstract: a subclass without it cannot be instantiated. With several
    workers each worker iterates its own copy; use :func:`ferry.get_worker_info` inside
    ``__iter__`` to give each a disjoint share. ``a + b`` chains two streams.
    """

    @abstractmethod
    def __iter__(self) -> Iterator[T_co]:
        """The samples, in order (each worker's copy gives its share)."""
        # (Declared here, not left to torch: torch 2.1's class defines a concrete one that
        # raises NotImplementedError, which would make subclasses without one instantiable.)
        raise NotImplementedError

    def __add__(self, other: Dataset[T_co]) -> ChainDataset:  # type: ignore[override]
        return ChainDataset([self, other])


def is_iterable_style(dataset: object) -> bool:
    """True for iterable-style datasets.

    That is: instances of torch's ``IterableDataset`` (ferry's :class:`IterableDataset` is one),
    and objects that have ``__iter__`` but neither ``__getitem__`` nor ``__getitems__``.
    """
    if isinstance(dataset, TorchIterableDataset):
        return True
    if hasattr(dataset, "__getitem__") or hasattr(dataset, "__getitems__"):
        return False
    return hasattr(dataset, "__iter__")


def fetch_many(dataset: Any, indices: Sequence[Any]) -> Sequence[Any]:
    """``dataset.__getitems__(indices)`` when it exists, else one ``__getitem__`` per key."""
    getitems = getattr(dataset, "__getitems__", None)
    if callable(getitems):
        return getitems(indices)  # type: ignore[no-any-return]
    return [dataset[i] for i in indices]


class TensorDataset(Dataset[tuple[torch.Tensor, ...]], TorchTensorDataset, twin=TorchTensorDataset):
    """Rows of tensors that share their first dimension: sample ``i`` is ``(t[i] for t)``.

    ferry's loader gathers a batch with one indexing call per tensor, not one per row, where
    that is the batch torch would stack (see :func:`tensor_gather`). Like torch's, it has no
    ``__getitems__``: whoever reads it row by row gets torch's rows.
    """

    tensors: tuple[torch.Tensor, ...]

    def __init__(self, *tensors: torch.Tensor) -> None:
        if tensors:
            sizes = [t.size(0) for t in tensors]
            if any(size != sizes[0] for size in sizes):
                raise AssertionError(
                    "Size mismatch between tensors: every tensor of a TensorDataset must have the "
                    f"same first dimension, got sizes {sizes}"
                )
        self.tensors = tensors

    def __getitem__(self, index: Any) -> tuple[torch.Tensor, ...]:
        return tuple(t[index] for t in self.tensors)

    def __len__(self) -> int:
        return self.tensors[0].size(0)

    def _ferry_gather(self, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Contiguous, as stacking the rows makes it (indexing keeps a channels_last layout).
        return tuple(_dense(t[index]) for t in self.tensors)


class StackDataset(Dataset[T_co], TorchStackDataset[Any], twin=TorchStackDataset):
    """Samples of several same-length datasets side by side.

    Positional datasets give tuple samples, keyword datasets give dict samples.

    Example::

        >>> StackDataset(range(3), "abc")[1]
        (1, 'b')
        >>> StackDataset(n=range(3), c="abc")[2]
        {'n': 2, 'c': 'c'}
    """

    datasets: tuple[Any, ...] | dict[str, Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args and kwargs:
            raise ValueError(
                "Supported either ``tuple``- (via ``args``) or``dict``- (via ``kwargs``) like "
                "input/output, but both types are given. StackDataset makes tuple samples from "
                "datasets passed positionally, dict samples from datasets passed by keyword: "
                "pass every dataset the same way"
            )
        parts = list(args or kwargs.values())
        if not parts:
            raise ValueError("At least one dataset should be passed to StackDataset, got none")
        lengths = [len(d) for d in parts]
        if any(n != lengths[0] for n in lengths):
            raise ValueError(
                "Size mismatch between datasets: every dataset of a StackDataset must have the "
                f"same length, got lengths {lengths}"
            )
        self._length = lengths[0]
        self.datasets = args if args else kwargs

    def __getitem__(self, index: Any) -> Any:
        if isinstance(self.datasets, dict):
            return {key: d[index] for key, d in self.datasets.items()}
        return tuple(d[index] for d in self.datasets)

    def __getitems__(self, indices: Sequence[Any]) -> list[Any]:
        parts = self.datasets.values() if isinstance(self.datasets, dict) else self.datasets
        columns = []
        for d in parts:
            items = fetch_many(d, indices)
            if len(items) != len(indices):
                raise ValueError(
                    f"Nested dataset's output size mismatch. Expected {len(indices)}, got "
                    f"{len(items)}: {type(d).__name__}.__getitems__ must return one sample per "
                    "index"
                )
            columns.append(items)
        if isinstance(self.datasets, dict):
            keys = list(self.datasets)
            return [dict(zip(keys, row, strict=True)) for row in zip(*columns, strict=True)]
        return list(zip(*columns, strict=True))

    def __len__(self) -> int:
        return self._length


class ConcatDataset(Dataset[T_co], TorchConcatDataset[T_co], twin=TorchConcatDataset):
    """Several map-style datasets read one after another; negative indices count from the end."""

    datasets: list[Any]
    cumulative_sizes: list[int]

    def __init__(self, datasets: Iterable[Any]) -> None:
        self.datasets = list(datasets)
        if not self.datasets:
            raise AssertionError(
                "datasets should not be an empty iterable: ConcatDataset needs at least one"
            )
        for d in self.datasets:
            if is_iterable_style(d):
                raise AssertionError(
                    "ConcatDataset does not support IterableDataset: got the iterable-style "
                    f"{type(d).__name__} (use ChainDataset for streams)"
                )
        self.cumulative_sizes = self.cumsum(self.datasets)

    @staticmethod
    def cumsum(sequence: Iterable[Any]) -> list[int]:
        """Running totals of the lengths of ``sequence``'s datasets."""
        return list(itertools.accumulate(len(d) for d in sequence))

    @property
    def cummulative_sizes(self) -> list[int]:
        """Misspelled alias kept for code written against old torch releases."""
        warnings.warn(
            "`cummulative_sizes` attribute is renamed to `cumulative_sizes`: the misspelled "
            "alias is deprecated",
            FutureWarning,
            stacklevel=2,
        )
        return self.cumulative_sizes

    def __len__(self) -> int:
        return self.cumulative_sizes[-1]

    def _locate(self, index: int) -> tuple[int, int]:
        if index < 0:
            if -index > len(self):
                raise ValueError(
                    f"absolute value of index should not exceed dataset length: index {index} is "
                    f"out of range for a ConcatDataset of length {len(self)}"
                )
            index += len(self)
        part = bisect.bisect_right(self.cumulative_sizes, index)
        offset = self.cumulative_sizes[part - 1] if part else 0
        return part, index - offset

    def __getitem__(self, idx: int) -> T_co:
        part, local = self._locate(idx)
        return self.datasets[part][local]  # type: ignore[no-any-return]


class ChainDataset(IterableDataset, TorchChainDataset, twin=TorchChainDataset):  # type: ignore[type-arg]
    """Several iterable-style datasets streamed one after another."""

    datasets: Iterable[Any]

    def __init__(self, datasets: Iterable[Any]) -> None:
        self.datasets = datasets

    def _checked(self) -> Iterator[Any]:
        for d in self.datasets:
            if not is_iterable_style(d):
                raise AssertionError(
                    "ChainDataset only supports IterableDataset: got the map-style "
                    f"{type(d).__name__} (use ConcatDataset for map-style datasets)"
                )
            yield d

    def __iter__(self) -> Iterator[Any]:
        for d in self._checked():
            yield from d

    def __len__(self) -> int:
        return sum(len(d) for d in self._checked())


class Subset(Dataset[T_co], TorchSubset[T_co], twin=TorchSubset):
    """The samples of ``dataset`` at ``indices``, in that order."""

    dataset: Any
    # Wider than torch's annotation (Sequence[int]), as wide as what torch accepts.
    indices: Sequence[Any] | torch.Tensor  # type: ignore[assignment]

    def __init__(self, dataset: Any, indices: Sequence[Any] | torch.Tensor) -> None:
        cls = type(self)
        if _overrides_getitem(self, Subset) and cls.__getitems__ is Subset.__getitems__:
            # The loader fetches batches through __getitems__, which would skip the override.
            raise NotImplementedError(
                f"{cls.__name__} overrides __getitem__ but not __getitems__: the DataLoader "
                "fetches whole batches through __getitems__ and would skip your __getitem__. "
                "Define __getitems__(self, indices) too, e.g. returning "
                "[self[i] for i in indices]."
            )
        self.dataset = dataset
        self.indices = indices

    @overload
    def __getitem__(self, idx: list[int]) -> list[T_co]: ...
    @overload
    def __getitem__(self, idx: int) -> T_co: ...
    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, list):
            return self.dataset[[self.indices[i] for i in idx]]
        return self.dataset[self.indices[idx]]

    # A Sequence, not necessarily a list: the inner dataset's batch may be a RowBatch.
    def __getitems__(self, indices: Sequence[int]) -> Sequence[Any]:  # type: ignore[override]
        return fetch_many(self.dataset, [self.indices[i] for i in indices])

    def __len__(self) -> int:
        return len(self.indices)

    def _ferry_gather(self, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inner = tensor_gather(self.dataset)
        if inner is None:
            raise TypeError(f"{type(self.dataset).__name__} has no one-call tensor gather")
        # Read self.indices every time: the user may replace it between epochs.
        indices = self.indices
        if isinstance(indices, torch.Tensor) and indices.dtype in _INDEX_DTYPES:
            return inner(indices[index])
        keys = [indices[i] for i in index.tolist()]
        if all(type(k) is int or _integer_scalar(k) for k in keys):
            return inner(torch.tensor(keys, dtype=torch.int64))
        # Slices, lists, bools, a mask...: each row read as torch reads it, then stacked.
        return tuple(default_collate([self.dataset[k] for k in keys]))


# Index tensors that pick rows (a bool or uint8 tensor is a mask, read row by row as torch does).
_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8)


def _integer_scalar(key: object) -> bool:
    """A key that picks one row as an int does (numpy's integers), not a bool."""
    return isinstance(key, numbers.Integral) and not isinstance(key, bool)


def _dense(gathered: torch.Tensor) -> torch.Tensor:
    return gathered if gathered.is_contiguous() else gathered.contiguous()


def _overrides_getitem(dataset: object, base: type) -> bool:
    """Whether a subclass replaced ``base.__getitem__``: batched paths must then defer to it."""
    return getattr(type(dataset), "__getitem__", None) is not getattr(base, "__getitem__", None)


def tensor_gather(dataset: object) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None:
    """The dataset's one-call batch gather from an ``int64`` index tensor, or None.

    Only for the built-in :class:`TensorDataset` and :class:`Subset` s of it whose sample access
    is not overridden by a subclass: the gathered columns are then exactly the default-collated
    batch of the rows at those indices.
    """
    if is_ferry_instance(dataset, TensorDataset):
        plain = not _overrides_getitem(dataset, TensorDataset)
        plain = plain and getattr(type(dataset), "__getitems__", None) is None
        # (sparse layouts, and tensors that record autograd: the rows, stacked, fail or
        # record as in torch)
        plain = plain and all(
            t.layout == torch.strided and not t.requires_grad for t in dataset.tensors
        )
        return dataset._ferry_gather if plain and dataset.tensors else None
    if (
        is_ferry_instance(dataset, Subset)
        and not _overrides_getitem(dataset, Subset)
        and type(dataset).__getitems__ is Subset.__getitems__
        and tensor_gather(dataset.dataset) is not None
    ):
        return dataset._ferry_gather
    return None


def random_split(
    dataset: Any,
    lengths: Sequence[int | float],
    generator: torch.Generator = torch.default_generator,
) -> list[Subset[Any]]:
    """Split ``dataset`` into non-overlapping random :class:`Subset` s.

    ``lengths`` are sizes summing to ``len(dataset)``, or fractions summing to 1: each fraction
    gets ``floor(fraction * len)`` samples, and what remains is handed out one at a time to the
    splits in turn, from the first. The split is the one torch makes for the same generator.

    Example::

        >>> a, b = random_split(range(10), [0.7, 0.3], generator=torch.Generator().manual_seed(0))
        >>> len(a), len(b)
        (7, 3)
    """
    total = len(dataset)
    sizes: Sequence[int | float] = list(lengths)
    if math.isclose(sum(sizes), 1) and sum(sizes) <= 1:
        counts = []
        for position, fraction in enumerate(sizes):
            if not 0 <= fraction <= 1:
                raise ValueError(
                    f"Fraction at index {position} is not between 0 and 1: random_split got "
                    f"{fraction} in {list(lengths)}"
                )
            counts.append(math.floor(total * fraction))
        for turn in range(total - sum(counts)):
            counts[turn % len(counts)] += 1
        for position, count in enumerate(counts):
            if count == 0:
                warnings.warn(
                    f"Length of split at index {position} is 0. This might result in an empty "
                    f"dataset: random_split of {total} samples by the fractions {list(lengths)} "
                    "leaves this split no sample.",
                    UserWarning,
                    stacklevel=2,
                )
        sizes = counts
    if sum(sizes) != total:
        raise ValueError(
            "Sum of input lengths does not equal the length of the input dataset! random_split "
            f"got {list(lengths)}, summing to {sum(lengths)}, for a dataset of length {total}: "
            "give lengths that sum to it, or fractions that sum to 1"
        )
    for position, size in enumerate(sizes):
        if int(size) != size:
            raise TypeError(
                f"random_split: lengths must be whole numbers of samples (summing to the "
                f"dataset's length, {total}) or fractions summing to 1; got {size} at index "
                f"{position} of {list(lengths)}: a split cannot hold part of a sample"
            )
    order = torch.randperm(total, generator=generator).tolist()
    ends = itertools.accumulate(int(s) for s in sizes)
    return [
        Subset(dataset, order[end - int(size) : end]) for end, size in zip(ends, sizes, strict=True)
    ]
