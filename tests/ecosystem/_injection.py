"""Loaders as users build them, and what Lightning and Fabric make of them when they inject a
``DistributedSampler`` (shared by ``test_lightning_injection.py`` and its 2-rank Fabric program).

Every loader is built with ``impl``'s classes (``"torch"``: ``torch.utils.data``, ``"ferry"``),
and :func:`describe` reads back, as plain data, what users and Lightning read off a loader after
the set-up: the types of its sampler and batch sampler, ``batch_size``, ``drop_last``, the
sampler's ``epoch``/``shuffle`` after ``set_epoch``, and the batches of two epochs. The two
implementations must give the same description.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.data as tud

import ferry

IMPLS: dict[str, Any] = {"torch": tud, "ferry": ferry}
ROWS = 22


def dataset(impl: str) -> Any:
    return IMPLS[impl].TensorDataset(torch.arange(ROWS))


def _custom_batch_sampler(impl: str) -> type:
    """A custom batch sampler (a subclass of ``impl``'s BatchSampler that decides its batches
    itself): each batch in reverse order. The same ``__qualname__`` in both implementations."""
    base = IMPLS[impl].BatchSampler

    class ReversedBatches(base):  # type: ignore[misc, valid-type]
        def __iter__(self) -> Iterator[list[int]]:
            for batch in base.__iter__(self) if impl == "ferry" else super().__iter__():
                yield batch[::-1]

    return ReversedBatches


def _derived_loader(impl: str) -> type:
    """A loader subclass whose ``__init__`` derives ``batch_size`` from its own argument."""
    base = IMPLS[impl].DataLoader

    class PerDevice(base):  # type: ignore[misc, valid-type]
        def __init__(  # noqa: PLR0917 - as a user writes it
            self,
            dataset: Any,
            global_batch: int = 8,
            devices: int = 2,
            sampler: Any = None,
            shuffle: bool | None = None,
            batch_sampler: Any = None,
        ) -> None:
            self.global_batch, self.devices = global_batch, devices
            super().__init__(
                dataset,
                batch_size=global_batch // devices,
                sampler=sampler,
                shuffle=shuffle,
                batch_sampler=batch_sampler,
            )

    return PerDevice


# Made at import, as user classes are: Lightning records the constructor arguments of the
# subclasses that exist when it starts a stage.
CUSTOM_BATCH_SAMPLER = {impl: _custom_batch_sampler(impl) for impl in IMPLS}
PER_DEVICE = {impl: _derived_loader(impl) for impl in IMPLS}


def _variants() -> dict[str, Callable[[str], Any]]:
    def loader(impl: str, **kwargs: Any) -> Any:
        return IMPLS[impl].DataLoader(dataset(impl), **kwargs)

    def explicit(impl: str) -> Any:
        data = dataset(impl)
        mod = IMPLS[impl]
        return mod.DataLoader(
            data, batch_sampler=mod.BatchSampler(mod.SequentialSampler(data), 4, False)
        )

    def custom(impl: str) -> Any:
        data = dataset(impl)
        sampler = IMPLS[impl].SequentialSampler(data)
        return IMPLS[impl].DataLoader(
            data, batch_sampler=CUSTOM_BATCH_SAMPLER[impl](sampler, 4, True)
        )

    def workers(impl: str) -> Any:
        options: dict[str, Any] = {"batch_size": 3, "shuffle": True, "num_workers": 2}
        if impl == "ferry":
            options["worker_type"] = "thread"
        return loader(impl, **options)

    return {
        "batch_size": lambda impl: loader(impl, batch_size=4),
        "shuffle": lambda impl: loader(impl, batch_size=4, shuffle=True),
        "drop_last": lambda impl: loader(impl, batch_size=4, drop_last=True),
        "explicit_batch_sampler": explicit,
        "custom_batch_sampler": custom,
        "derived_subclass": lambda impl: PER_DEVICE[impl](dataset(impl), global_batch=6),
        "thread_workers": workers,
    }


VARIANTS = _variants()


def _type_name(obj: Any) -> str | None:
    """The type of ``obj`` as both implementations must show it: torch's and ferry's classes of
    the same name read alike (``ferry.SequentialSampler`` is torch's type too), except torch's
    exact ``BatchSampler``, which Lightning tells apart by identity."""
    if obj is None:
        return None
    cls = type(obj)
    if cls is tud.BatchSampler:
        return "torch.utils.data.BatchSampler (exact)"
    return cls.__qualname__.rsplit(".", 1)[-1]


def describe(loader: Any, epochs: int = 2) -> dict[str, Any]:
    """What users and Lightning read off ``loader`` (a Fabric wrapper is looked through)."""
    inner = getattr(loader, "_dataloader", loader)
    sampler = inner.sampler
    out: dict[str, Any] = {
        "loader": _type_name(inner),
        "sampler": _type_name(sampler),
        "batch_sampler": _type_name(inner.batch_sampler),
        "batch_sampler.sampler": _type_name(getattr(inner.batch_sampler, "sampler", None)),
        "batch_size": inner.batch_size,
        "drop_last": inner.drop_last,
        "len": len(inner),
        "is_distributed": isinstance(sampler, tud.DistributedSampler),
        "epochs": [],
    }
    for epoch in range(epochs):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
            out[f"epoch{epoch}"] = (sampler.epoch, sampler.shuffle)
        out["epochs"].append([batch[0].tolist() for batch in loader])
    return out
