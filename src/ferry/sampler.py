"""``torch.utils.data.sampler``'s public names, so that ``from ferry.sampler import X`` replaces
``from torch.utils.data.sampler import X`` (the classes live in :mod:`ferry.samplers`)."""

from ferry.samplers import (
    BatchSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

__all__ = [
    "BatchSampler",
    "RandomSampler",
    "Sampler",
    "SequentialSampler",
    "SubsetRandomSampler",
    "WeightedRandomSampler",
]
