"""How a loader's sampling options combine, as torch's ``DataLoader`` combines them: which are
mutually exclusive (with torch's phrases, which code matches), and the sampler and batch sampler
a loader makes when it is not given them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ferry.samplers import BatchSampler, RandomSampler, Sampler, SequentialSampler, _StreamSampler

__all__ = ["resolve_sampling"]


def resolve_sampling(  # noqa: PLR0917 - the loader's own options, in its order
    dataset: Any,
    iterable: bool,
    batch_size: int | None,
    shuffle: bool | None,
    sampler: Sampler[Any] | Iterable[Any] | None,
    batch_sampler: Sampler[Any] | Iterable[Any] | None,
    drop_last: bool,
    generator: torch.Generator | None,
) -> tuple[Sampler[Any] | Iterable[Any], Sampler[Any] | Iterable[Any] | None, int | None, bool]:
    """``(sampler, batch_sampler, batch_size, drop_last)`` as the loader keeps them; raises
    ValueError for options that exclude each other."""
    if iterable:
        if shuffle not in (False, None):
            raise ValueError(
                "DataLoader with IterableDataset: expected unspecified shuffle option, but "
                f"got shuffle={shuffle}; the stream decides its own order, so shuffle "
                "inside the dataset"
            )
        if sampler is not None:
            raise ValueError(
                "DataLoader with IterableDataset: expected unspecified sampler option, but "
                f"got sampler={sampler}; a stream has no keys to sample, it chooses its "
                "samples itself"
            )
        if batch_sampler is not None:
            raise ValueError(
                "DataLoader with IterableDataset: expected unspecified batch_sampler option, "
                f"but got batch_sampler={batch_sampler}; a stream has no keys to sample, "
                "use batch_size to batch it"
            )
    else:
        shuffle = bool(shuffle)

    if sampler is not None and shuffle:
        raise ValueError(
            "sampler option is mutually exclusive with shuffle: the sampler decides the "
            "order, so leave shuffle unset or False"
        )
    if batch_sampler is not None:
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise ValueError(
                "batch_sampler option is mutually exclusive with batch_size, shuffle, "
                "sampler, and drop_last (the batch sampler decides all four), got "
                f"batch_size={batch_size!r}, shuffle={shuffle!r}, sampler={sampler!r}, "
                f"drop_last={drop_last!r}"
            )
        batch_size = None
        drop_last = False
    elif batch_size is None and drop_last:
        raise ValueError(
            "batch_size=None option disables auto-batching and is mutually exclusive with "
            "drop_last: there is no batch to drop, so leave drop_last=False"
        )

    if sampler is None:
        if iterable:
            sampler = _StreamSampler()
        elif shuffle:
            sampler = RandomSampler(dataset, generator=generator)
        else:
            sampler = SequentialSampler(dataset)
    if batch_size is not None and batch_sampler is None:
        batch_sampler = BatchSampler(sampler, batch_size, drop_last)
    return sampler, batch_sampler, batch_size, drop_last
