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

``import torch`` has already imported ``torch.utils.data``, so this costs nothing at import time.
"""

from __future__ import annotations

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
    "TorchSubset",
    "TorchSubsetRandomSampler",
    "TorchTensorDataset",
    "TorchWeightedRandomSampler",
]
