"""Batches of keys: how a batch sampler groups keys (lists, or ``int64`` tensors on the fast path),
how many batches it makes, and the record of torch's exact ``BatchSampler`` class that
``ferry.BatchSampler(...)`` gives (see :class:`ferry.samplers.BatchSampler` for why).

Pure functions over keys and records; the samplers themselves are in :mod:`ferry.samplers`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch

from ferry._torch_types import TorchBatchSampler

__all__ = ["batch_count", "batched", "is_batch_record", "rebatch"]


def is_batch_record(batch_sampler: object) -> bool:
    """Whether ``batch_sampler`` is an object of torch's exact ``BatchSampler`` class: a record
    of ``(sampler, batch_size, drop_last)`` that ferry batches by itself (see
    :class:`BatchSampler`)."""
    return type(batch_sampler) is TorchBatchSampler


def batch_count(index_sampler: Any) -> int:
    """``len()`` of a loader's index sampler; a batch record's is counted here, not by torch's
    code: ``ceil`` (or ``floor`` with ``drop_last``) of its sampler's length over the size."""
    if not is_batch_record(index_sampler):
        return len(index_sampler)
    record = index_sampler
    return batches_in(len(record.sampler), record.batch_size, record.drop_last)


def batches_in(count: int, size: int, drop_last: bool) -> int:
    return count // size if drop_last else -(-count // size)


def batched(keys: Iterator[Any], size: int, drop_last: bool) -> Iterator[list[Any]]:
    """``keys`` in lists of ``size``, as :class:`BatchSampler` groups them."""
    while batch := list(itertools.islice(keys, size)):
        if len(batch) < size and drop_last:
            return
        yield batch


def rebatch(chunks: Iterator[torch.Tensor], size: int, drop_last: bool) -> Iterator[torch.Tensor]:
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
