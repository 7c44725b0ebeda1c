"""``torch.utils.data.dataset``'s public names, so that ``from ferry.dataset import X`` replaces
``from torch.utils.data.dataset import X`` (the classes live in :mod:`ferry.datasets`)."""

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

__all__ = [
    "ChainDataset",
    "ConcatDataset",
    "Dataset",
    "IterableDataset",
    "StackDataset",
    "Subset",
    "TensorDataset",
    "random_split",
]
