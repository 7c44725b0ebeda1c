"""Samplers: the order in which a map-style dataset is read.

Every built-in sampler yields exactly the sequence torch's sampler of the same name yields for
the same arguments and the same ``torch.Generator`` state, because each one draws from the
generator in the same calls, sizes and order.

Besides the public per-index iteration, the built-in samplers can hand out their indices as
whole ``int64`` tensors, which a :class:`BatchSampler` turns into batch tensors
(:mod:`ferry._sampler_keys`). The loader uses that path when the dataset can gather a batch
from a tensor of indices in one call, so no Python ``int`` is created per sample.

Example::

    >>> g = torch.Generator().manual_seed(0)
    >>> list(BatchSampler(RandomSampler(range(6), generator=g), batch_size=4, drop_last=False))
    [[2, 0, 1, 3], [4, 5]]
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any, TypeVar

import torch

from ferry._batching import batched, batches_in
from ferry._core.rng import generator_state
from ferry._sampler_state import (
    SamplerRun,
    _GeneratorState,
    _Progress,
    _run_generator,
    skip_chunks,
)
from ferry._torch_types import (
    TorchBatchSampler,
    TorchRandomSampler,
    TorchSampler,
    TorchSequentialSampler,
    TorchStreamSampler,
    TorchSubsetRandomSampler,
    TorchTwin,
    TorchWeightedRandomSampler,
    is_ferry_instance,
)
from ferry._validate import check_bool, check_positive_int

__all__ = [
    "BatchSampler",
    "RandomSampler",
    "Sampler",
    "SamplerRun",
    "SequentialSampler",
    "SubsetRandomSampler",
    "TensorChunkSampler",
    "WeightedRandomSampler",
]

T_co = TypeVar("T_co", covariant=True)

# torch draws indices with replacement 32 at a time; drawing in the same sizes is what makes the
# sequence identical for the same generator state.
_REPLACEMENT_DRAW = 32
_SEQUENTIAL_CHUNK = 1 << 16


def pending_start(sampler: object) -> dict[str, Any] | None:
    """The start a built-in sampler's next iteration would record, if it is known now: the
    state of its own generator. None when the next iteration draws from torch's global RNG
    (whose state is the user's to restore)."""
    generator = getattr(sampler, "generator", None)
    if isinstance(generator, torch.Generator) and not is_ferry_instance(sampler, SequentialSampler):
        return {"generator": generator_state(generator)}
    return None


class Sampler(TorchTwin, TorchSampler[T_co], twin=TorchSampler):
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
    tensors themselves (:func:`ferry._sampler_keys.index_chunks`), as long as a subclass does
    not override ``__iter__``.
    """

    # Whether ``iter(sampler)`` draws its keys at once, as torch's sampler of the same name
    # does in its ``__iter__`` (not at the first ``next``): then a ``set_epoch`` or an error
    # comes when torch's would. DistributedSampler's does; torch's others are generators.
    _drawn_at_iter = False

    def __iter__(self) -> Iterator[int]:
        progress = self._begin_iteration()
        if self._drawn_at_iter:
            chunks = list(self._run_chunks(progress.run))
            return self._run_keys(progress.run, progress, iter(chunks))
        return self._run_keys(progress.run, progress)

    def _begin_iteration(self) -> _Progress:
        """How ``iter(self)`` starts: afresh (a stateful sampler may resume a loaded state)."""
        return _Progress(SamplerRun())

    def _run_keys(
        self,
        run: SamplerRun,
        progress: _Progress | None = None,
        chunks: Iterator[torch.Tensor] | None = None,
    ) -> Iterator[int]:
        """The keys of one iteration, as ints, started (or resumed) as ``run`` says (from
        ``chunks`` when already drawn); counted in ``progress`` when given (for
        ``iter(sampler)``; the loader counts its own)."""
        try:
            for chunk in self._run_chunks(run) if chunks is None else chunks:
                keys = chunk.tolist()
                yield from keys if progress is None else progress.enter(keys)
        finally:
            if progress is not None:
                progress.close()

    def _index_chunks(self) -> Iterator[torch.Tensor]:
        return self._run_chunks(SamplerRun())

    def _run_chunks(self, run: SamplerRun) -> Iterator[torch.Tensor]:
        """The keys of one iteration as tensors, started (or resumed) as ``run`` says.

        A subclass that defines only ``_index_chunks`` has no start to record: a resume skips
        into a fresh iteration of it.
        """
        if type(self)._index_chunks is TensorChunkSampler._index_chunks:
            raise NotImplementedError(f"{type(self).__name__} must define _index_chunks")
        return skip_chunks(self._index_chunks(), run.skip)


class SequentialSampler(Sampler[int], TorchSequentialSampler, twin=TorchSequentialSampler):
    """Yields ``0, 1, ..., len(data_source) - 1``."""

    data_source: Sized

    def __init__(self, data_source: Sized) -> None:
        self.data_source = data_source

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.data_source)))

    def __len__(self) -> int:
        return len(self.data_source)

    def _index_chunks(self) -> Iterator[torch.Tensor]:
        return self._run_chunks(SamplerRun())

    def _run_chunks(self, run: SamplerRun) -> Iterator[torch.Tensor]:
        # Bounded chunks: a dataset of a billion rows must not cost 8 GB of indices up front.
        run.start = {}
        total = len(self.data_source)
        for start in range(min(run.skip, total), total, _SEQUENTIAL_CHUNK):
            yield torch.arange(start, min(start + _SEQUENTIAL_CHUNK, total), dtype=torch.int64)

    def _run_keys(self, run: SamplerRun) -> Iterator[int]:
        run.start = {}
        return iter(range(min(run.skip, len(self.data_source)), len(self.data_source)))


class RandomSampler(
    _GeneratorState, TensorChunkSampler, TorchRandomSampler, twin=TorchRandomSampler
):
    """Yields indices in random order: a permutation, or draws with replacement.

    Without replacement, ``num_samples`` larger than the dataset yields whole permutations one
    after another, then the head of one more. With ``generator=None`` a fresh generator is
    seeded from torch's global RNG at the start of each iteration.

    Stateful, as torchdata's samplers are: :meth:`state_dict` is ``{"yielded": k,
    "generator": <uint8 tensor>}`` (the generator's state when the iteration began) or, with
    ``generator=None``, ``{"yielded": k, "seed": s}`` (the seed drawn from torch's global
    RNG); :meth:`load_state_dict` makes the next ``iter(sampler)`` continue after ``k``.

    Example::

        >>> sampler = RandomSampler(range(4), generator=torch.Generator().manual_seed(0))
        >>> list(sampler)
        [0, 1, 3, 2]
    """

    _state_keys = ("generator", "seed")
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
        check_bool("replacement", replacement, error=TypeError)
        count = self.num_samples
        if not isinstance(count, int) or count <= 0:
            raise ValueError(
                f"num_samples should be a positive integer value, but got num_samples={count}"
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

    def _run_chunks(self, run: SamplerRun) -> Iterator[torch.Tensor]:
        return skip_chunks(self._draw_chunks(run), run.skip)

    def _draw_chunks(self, run: SamplerRun) -> Iterator[torch.Tensor]:
        n = len(self.data_source)
        generator = _run_generator(run, self.generator, global_draw=False)
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


class SubsetRandomSampler(
    _GeneratorState, Sampler[Any], TorchSubsetRandomSampler, twin=TorchSubsetRandomSampler
):
    """Yields the given indices in random order (without replacement).

    Stateful, as torchdata's samplers are: :meth:`state_dict` is ``{"yielded": k,
    "generator": <uint8 tensor>}``, the state of the generator the iteration drew its order
    from (with ``generator=None``, torch's global one) when it began; :meth:`load_state_dict`
    makes the next ``iter(sampler)`` continue after ``k``.

    Example::

        >>> sampler = SubsetRandomSampler([10, 20, 30], generator=torch.Generator().manual_seed(0))
        >>> list(sampler)
        [30, 10, 20]
    """

    indices: Sequence[Any]

    def __init__(self, indices: Sequence[Any], generator: torch.Generator | None = None) -> None:
        self.indices = indices
        self.generator = generator

    def __iter__(self) -> Iterator[Any]:
        progress = self._begin_iteration()
        return self._run_keys(progress.run, progress)

    def _run_keys(self, run: SamplerRun, progress: _Progress | None = None) -> Iterator[Any]:
        generator = _run_generator(run, self.generator, global_draw=True)
        order = torch.randperm(len(self.indices), generator=generator)
        if run.consume_global:
            torch.randperm(len(self.indices))
        positions = order[run.skip :].tolist()
        try:
            for position in positions if progress is None else progress.enter(positions):
                yield self.indices[position]
        finally:
            if progress is not None:
                progress.close()

    def __len__(self) -> int:
        return len(self.indices)


class WeightedRandomSampler(
    _GeneratorState, TensorChunkSampler, TorchWeightedRandomSampler, twin=TorchWeightedRandomSampler
):
    """Yields ``num_samples`` indices in ``[0, len(weights))`` drawn with the given weights.

    Weights need not sum to one. Without replacement an index is drawn at most once, so
    ``num_samples`` may not exceed the number of non-zero weights.

    Stateful, as torchdata's samplers are: :meth:`state_dict` is ``{"yielded": k,
    "generator": <uint8 tensor>}``, the state of the generator the iteration drew from (with
    ``generator=None``, torch's global one) when it began; :meth:`load_state_dict` makes the
    next ``iter(sampler)`` continue after ``k``.

    Example::

        >>> g = torch.Generator().manual_seed(4)
        >>> list(WeightedRandomSampler([0.0, 1.0, 3.0], num_samples=4, generator=g))
        [2, 2, 1, 2]
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
                "weights should be a 1d sequence but given weights have shape "
                f"{tuple(weights_tensor.shape)}: pass one weight per index"
            )
        self.weights = weights_tensor
        self.num_samples = num_samples
        self.replacement = replacement
        self.generator = generator

    def __len__(self) -> int:
        return self.num_samples

    def _run_chunks(self, run: SamplerRun) -> Iterator[torch.Tensor]:
        generator = _run_generator(run, self.generator, global_draw=True)
        drawn = torch.multinomial(
            self.weights, self.num_samples, self.replacement, generator=generator
        )
        if run.consume_global:
            torch.multinomial(self.weights, self.num_samples, self.replacement)
        yield drawn[run.skip :]


class BatchSampler(Sampler[list[Any]], TorchBatchSampler, twin=TorchBatchSampler):
    """Groups the keys of another sampler (or any iterable) into lists of ``batch_size``.

    The last, shorter batch is kept unless ``drop_last`` is true.

    ``BatchSampler(...)`` itself gives an object of torch's exact
    ``torch.utils.data.BatchSampler`` class, used by ferry only as a record of
    ``(sampler, batch_size, drop_last)``: Lightning and Fabric test
    ``type(batch_sampler) is BatchSampler`` to decide whether they may swap the sampler inside
    a loader (for a ``DistributedSampler``), and take the slower "custom batch sampler" path
    for any other class. ferry's loader batches such a record itself (torch's code does not run
    there); iterated directly, it yields what torch's does, because it is torch's. The loader
    builds the same record when given ``batch_size``. A subclass of this class (a custom batch
    sampler) is a ferry object as usual, iterating as below unless it overrides ``__iter__``.

    Example::

        >>> list(BatchSampler(range(7), batch_size=3, drop_last=False))
        [[0, 1, 2], [3, 4, 5], [6]]
    """

    sampler: Sampler[Any] | Iterable[Any]
    batch_size: int
    drop_last: bool

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is not BatchSampler:
            return super().__new__(cls)
        # ferry's __init__ fills the record, so that a call with the wrong arguments fails
        # with torch's own words ("BatchSampler.__init__() missing 1 required ...").
        # (torch's exact class, made without running its constructor)
        record: Any = object.__new__(TorchBatchSampler)
        BatchSampler.__init__(record, *args, **kwargs)
        return record

    def __init__(
        self, sampler: Sampler[Any] | Iterable[Any], batch_size: int, drop_last: bool
    ) -> None:
        check_positive_int("batch_size", batch_size, error=ValueError)
        check_bool("drop_last", drop_last, error=ValueError)
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[list[Any]]:
        # A generator, as torch's: the wrapped sampler's iter() runs at the first batch.
        yield from batched(iter(self.sampler), self.batch_size, self.drop_last)

    def __len__(self) -> int:
        return batches_in(len(self.sampler), self.batch_size, self.drop_last)  # type: ignore[arg-type]


# inspect.signature(BatchSampler) reads __new__ first: it reports __init__'s parameters.
BatchSampler.__new__.__signature__ = inspect.signature(BatchSampler.__init__)  # type: ignore[attr-defined]


class _StreamSampler(Sampler[None], TorchStreamSampler):
    """The sampler of an iterable-style dataset: one ``None`` per sample, without end.

    Kept so ``loader.sampler``/``loader.batch_sampler`` exist as in torch, and of the class
    torch's is (``_InfiniteConstantSampler``); the stream itself decides where the epoch ends.
    """

    def __iter__(self) -> Iterator[None]:
        while True:
            yield None
