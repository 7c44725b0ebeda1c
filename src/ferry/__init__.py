"""ferry: a drop-in, faster, resumable and leak-free ``torch.utils.data``.

Replace ``from torch.utils.data import X`` with ``from ferry import X``: every public name of
``torch.utils.data`` is here with the same signature, defaults and sample order.
"""

from ferry._core.info import WorkerInfo, get_worker_info
from ferry.collate import collate, default_collate, default_collate_fn_map, default_convert
from ferry.datasets import (
    ChainDataset,
    ConcatDataset,
    Dataset,
    IterableDataset,
    StackDataset,
    Subset,
    TensorDataset,
    random_split,
)
from ferry.distributed import DistributedSampler
from ferry.loader import DataLoader
from ferry.samplers import (
    BatchSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from ferry.shared_list import SharedList

__version__ = "0.1.0"

__all__ = [
    "BatchSampler",
    "ChainDataset",
    "ConcatDataset",
    "DataLoader",
    "Dataset",
    "DistributedSampler",
    "IterableDataset",
    "RandomSampler",
    "Sampler",
    "SequentialSampler",
    "SharedList",
    "StackDataset",
    "Subset",
    "SubsetRandomSampler",
    "TensorDataset",
    "WeightedRandomSampler",
    "WorkerInfo",
    "collate",
    "default_collate",
    "default_collate_fn_map",
    "default_convert",
    "get_worker_info",
    "random_split",
]
