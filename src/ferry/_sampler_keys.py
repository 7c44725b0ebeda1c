"""How the loader reads ferry's built-in samplers: whether a sampler (or batch sampler) is one
iterating as ferry wrote it, its keys as ``int64`` tensors (no Python ``int`` per key), its
keys started from a :class:`~ferry.samplers.SamplerRun` (a resume), and what drawing its first
key leaves in memory. Kept apart from :mod:`ferry.samplers`, which holds the samplers users
see."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch

from ferry._batching import is_batch_record, rebatch
from ferry._torch_types import is_ferry_instance
from ferry.samplers import (
    _REPLACEMENT_DRAW,
    _SEQUENTIAL_CHUNK,
    BatchSampler,
    RandomSampler,
    SamplerRun,
    SequentialSampler,
    SubsetRandomSampler,
    TensorChunkSampler,
)

__all__ = [
    "first_draw_bytes",
    "index_batches",
    "index_chunks",
    "is_builtin_batch_sampler",
    "is_builtin_sampler",
    "run_keys",
]

# Bytes a drawn key can take: an int64 in a tensor, and a Python int in a list (28 bytes and a
# pointer), where the keys are not taken as tensors.
_KEY_BYTES = 8 + 28 + 8


def is_builtin_sampler(sampler: object) -> bool:
    """Whether ``sampler`` is one of ferry's samplers iterating as ferry wrote it, so its
    iteration can be started from a :class:`SamplerRun` (a subclass that overrides
    ``__iter__`` decides its keys itself)."""
    iter_fn = getattr(type(sampler), "__iter__", None)
    return (
        (is_ferry_instance(sampler, SequentialSampler) and iter_fn is SequentialSampler.__iter__)
        or (
            is_ferry_instance(sampler, TensorChunkSampler)
            and iter_fn is TensorChunkSampler.__iter__
        )
        or (
            is_ferry_instance(sampler, SubsetRandomSampler)
            and iter_fn is SubsetRandomSampler.__iter__
        )
    )


def is_builtin_batch_sampler(batch_sampler: object) -> bool:
    """Whether ``batch_sampler`` batches as :class:`BatchSampler` does: a record of torch's
    exact class, or ferry's class (a subclass that keeps ferry's ``__iter__``)."""
    return is_batch_record(batch_sampler) or (
        is_ferry_instance(batch_sampler, BatchSampler)
        and type(batch_sampler).__iter__ is BatchSampler.__iter__
    )


def index_chunks(sampler: object, run: SamplerRun | None = None) -> Iterator[torch.Tensor] | None:
    """The sampler's keys as 1-D ``int64`` tensors, or None when it cannot give them so.

    Draws from the generator exactly as iterating the sampler would, lazily: nothing is drawn
    until the first chunk is asked for. A subclass that overrides ``__iter__`` decides its keys
    itself, so it gets None. ``run`` starts (or resumes) the iteration.
    """
    if not is_builtin_sampler(sampler) or is_ferry_instance(sampler, SubsetRandomSampler):
        return None
    assert isinstance(sampler, (SequentialSampler, TensorChunkSampler))
    return sampler._run_chunks(run if run is not None else SamplerRun())


def index_batches(
    batch_sampler: object, run: SamplerRun | None = None
) -> Iterator[torch.Tensor] | None:
    """The batches of a built-in :class:`BatchSampler` as ``int64`` tensors, or None.

    Yields the same batches as iterating ``batch_sampler`` (same keys, same RNG draws), without
    creating a Python ``int`` per key. None when the batch sampler, or the sampler it wraps, is
    not one whose sequence is known to come from tensor chunks. ``run`` starts (or resumes) the
    wrapped sampler's iteration; its ``skip`` counts keys, not batches.
    """
    if not is_builtin_batch_sampler(batch_sampler):
        return None
    assert isinstance(batch_sampler, BatchSampler)
    chunks = index_chunks(batch_sampler.sampler, run)
    if chunks is None:
        return None
    return rebatch(chunks, batch_sampler.batch_size, batch_sampler.drop_last)


def first_draw_bytes(sampler: object) -> int | None:
    """At most how many bytes a built-in sampler's iteration holds once it has given its first
    key: the keys drawn with it (a chunk of a sequence, 32 draws with replacement, else the
    whole order at once). None for a user's sampler, which may hold anything."""
    if not is_builtin_sampler(sampler):
        return None
    assert isinstance(sampler, Sized)
    if is_ferry_instance(sampler, SequentialSampler):
        keys = min(len(sampler), _SEQUENTIAL_CHUNK)
    elif is_ferry_instance(sampler, RandomSampler) and sampler.replacement:
        keys = _REPLACEMENT_DRAW
    else:
        keys = len(sampler)
        # (a DistributedSampler orders the whole dataset, then keeps its rank's share)
        data = getattr(sampler, "dataset", None)
        if isinstance(data, Sized):
            keys = max(keys, len(data))
    return keys * _KEY_BYTES


def run_keys(sampler: object, run: SamplerRun) -> Iterator[Any]:
    """The keys of a built-in sampler (:func:`is_builtin_sampler`), as iterating it yields
    them, started (or resumed) as ``run`` says."""
    assert isinstance(sampler, (SequentialSampler, TensorChunkSampler, SubsetRandomSampler))
    return sampler._run_keys(run)
