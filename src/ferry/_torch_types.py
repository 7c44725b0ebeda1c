"""``torch.utils.data``'s public classes, as the base classes of ferry's: the one module of the
library that imports ``torch.utils.data``.

ferry's classes subclass these so that every ``isinstance`` check in the ecosystem (Lightning,
accelerate, transformers, torch's own ``DataLoader``) treats a ferry object as what it is: a
``DataLoader``, an ``IterableDataset``, a ``RandomSampler``, and what ``iter(loader)`` returns a
torch ``_BaseDataLoaderIter``. They are types only: each ferry class defines every attribute
its torch base defines, so no method, property or constructor of torch's implementation runs on
a ferry object. ``tests/test_torch_types.py`` checks both, and
lists the few inherited attributes that are harmless, each with its reason. The one torch object
ferry makes is a record: ``ferry.BatchSampler(...)`` is of torch's exact class, because
Lightning tests ``type(batch_sampler) is BatchSampler`` (see :class:`ferry.BatchSampler`).

The other direction holds too: ``isinstance(obj, ferry.X)`` and ``issubclass(C, ferry.X)`` are
true of torch's objects and classes wherever they are of ``torch.utils.data.X`` (see
:class:`TorchTwin`), since libraries hand a migrated program torch's objects (Lightning injects
torch's ``DistributedSampler``, accelerate's loaders are torch's). ferry's own code, where it
needs ferry's implementation, asks :func:`is_ferry_instance` instead.

``import torch`` has already imported ``torch.utils.data``, so this costs nothing at import time.
"""

from __future__ import annotations

from abc import ABCMeta
from typing import Any, TypeGuard, TypeVar, cast

from torch.utils.data import (
    BatchSampler as TorchBatchSampler,
)
from torch.utils.data import (
    ChainDataset as TorchChainDataset,
)
from torch.utils.data import (
    ConcatDataset as TorchConcatDataset,
)
from torch.utils.data import (
    DataLoader as TorchDataLoader,
)
from torch.utils.data import (
    Dataset as TorchDataset,
)
from torch.utils.data import (
    IterableDataset as TorchIterableDataset,
)
from torch.utils.data import (
    RandomSampler as TorchRandomSampler,
)
from torch.utils.data import (
    Sampler as TorchSampler,
)
from torch.utils.data import (
    SequentialSampler as TorchSequentialSampler,
)
from torch.utils.data import (
    StackDataset as TorchStackDataset,
)
from torch.utils.data import (
    Subset as TorchSubset,
)
from torch.utils.data import (
    SubsetRandomSampler as TorchSubsetRandomSampler,
)
from torch.utils.data import (
    TensorDataset as TorchTensorDataset,
)
from torch.utils.data import (
    WeightedRandomSampler as TorchWeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

try:
    # Private to torch, so imported defensively: the base of what iter(loader) returns, which
    # libraries test (Lightning's CombinedLoader leaves such iterators out when it is pickled).
    from torch.utils.data.dataloader import _BaseDataLoaderIter as TorchLoaderIterator
except ImportError:  # pragma: no cover - a torch without it: the type is ferry's alone

    class TorchLoaderIterator:  # type: ignore[no-redef]
        """Stands for torch's iterator base class where torch has none by that name."""


try:
    # Private to torch too: the sampler torch gives an iterable-style dataset's loader, which
    # code tests (torchdata's StatefulDataLoader does).
    from torch.utils.data.dataloader import (
        _InfiniteConstantSampler as TorchStreamSampler,
    )
except ImportError:  # pragma: no cover - a torch without it: the type is ferry's alone

    class TorchStreamSampler(TorchSampler[None]):  # type: ignore[no-redef]
        """Stands for torch's stream sampler where torch has none by that name."""


__all__ = [
    "TorchBatchSampler",
    "TorchChainDataset",
    "TorchConcatDataset",
    "TorchDataLoader",
    "TorchDataset",
    "TorchDistributedSampler",
    "TorchIterableDataset",
    "TorchLoaderIterator",
    "TorchRandomSampler",
    "TorchSampler",
    "TorchSequentialSampler",
    "TorchStackDataset",
    "TorchStreamSampler",
    "TorchSubset",
    "TorchSubsetRandomSampler",
    "TorchTensorDataset",
    "TorchTwin",
    "TorchWeightedRandomSampler",
    "is_ferry_instance",
]

T = TypeVar("T")

# ferry's public class -> the torch.utils.data class of the same name whose objects it accepts.
_TWINS: dict[type, type] = {}


class TorchTwin(metaclass=ABCMeta):  # noqa: B024 - an ABC for its isinstance hook, not to be abstract
    """Base of ferry's public classes: ``ferry.X`` accepts torch's objects as ``X`` does.

    A class declares its torch counterpart with ``class SequentialSampler(...,
    twin=TorchSequentialSampler)``; ``isinstance``/``issubclass`` against that class (not
    against a subclass of it, such as a user's sampler) are then true of every object and class
    of the counterpart, so a program that imports ``X`` from ferry instead of torch sees
    torch's objects as before::

        >>> isinstance(torch.utils.data.SequentialSampler(range(3)), ferry.SequentialSampler)
        True

    The metaclass is ``ABCMeta`` (that of torch's ``IterableDataset`` already), so a subclass
    may mix in ``abc.ABC`` or a ``Protocol`` as it could with torch's classes. It adds no
    behaviour: the objects of a class are what they were, ``type(obj)`` included.
    """

    __slots__ = ()

    def __init_subclass__(cls, twin: type | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if twin is not None:
            if not issubclass(cls, twin):
                raise TypeError(f"{cls.__qualname__} must subclass its twin {twin.__qualname__}")
            _TWINS[cls] = twin

    @classmethod
    def __subclasshook__(cls, candidate: type) -> bool:
        twin = _TWINS.get(cls)
        if twin is None:  # a user's subclass: ABCMeta decides as for any class
            return cast("bool", NotImplemented)
        # Read from the MRO, not with issubclass: torch's IterableDataset is an ABC too, whose
        # check would ask its subclasses (ferry's among them), and so this hook, again.
        mro: tuple[type, ...] = getattr(candidate, "__mro__", ())
        return twin in mro


def is_ferry_instance(obj: object, cls: type[T]) -> TypeGuard[T]:
    """``isinstance(obj, cls)`` without :class:`TorchTwin`'s rule: true only when ``obj``'s class
    derives from ``cls`` itself, so a torch object is never taken for a ferry one where ferry
    reads its own attributes or relies on its own code."""
    return cls in type(obj).__mro__
