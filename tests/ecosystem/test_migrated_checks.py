"""A program migrated to ferry's names keeps working on the objects the libraries make from torch's.

Lightning, accelerate and Hugging Face ``datasets`` build their objects from torch's classes:
Lightning and Fabric inject torch's ``DistributedSampler`` (with torch's ``SequentialSampler`` and
``BatchSampler``), accelerate's prepared loaders are torch ``DataLoader`` s, ``datasets``' streams
are torch ``IterableDataset`` s. Their own test suites, run with ``from torch.utils.data import X``
answered by ferry, asked ``isinstance(obj, X)`` of those objects and failed: these are
those cases, each against the library's real objects, with ferry's names. Beside them, the
shutdown count Lightning's ``test_workers_are_shutdown`` takes of a loader whose persistent
iterator it stops, then lets go.
"""

from __future__ import annotations

import gc
import pickle
from typing import Any

import datasets
import pytest
import torch
import torch.utils.data as tud
from accelerate import Accelerator
from accelerate.data_loader import (
    DataLoaderDispatcher,
    DataLoaderShard,
    SkipDataLoader,
    skip_first_batches,
)
from accelerate.utils import DataLoaderConfiguration
from lightning.fabric import Fabric
from lightning.pytorch.utilities.combined_loader import _shutdown_workers_and_reset_iterator
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

import ferry
from ferry.distributed import DistributedSampler

pytestmark = pytest.mark.usefixtures("guard_global_state")


@pytest.mark.parametrize("shuffle", [False, True])
def test_fabric_injects_a_sampler_ferrys_names_recognise(shuffle: bool) -> None:
    """Lightning's ``test_setup_dataloaders_replace_standard_sampler``: Fabric under DDP swaps
    a loader's sampler for torch's DistributedSampler."""
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric._launched = True  # as Lightning's test: pretend the ranks were launched
    loader = fabric.setup_dataloaders(ferry.DataLoader(ferry.TensorDataset(torch.arange(6.0))))
    prepared = ferry.DataLoader(range(3), shuffle=shuffle)
    injected = fabric.setup_dataloaders(prepared)
    for made in (loader, injected):
        assert isinstance(made.sampler, DistributedSampler)
        assert isinstance(made.sampler, tud.distributed.DistributedSampler)
        assert isinstance(made.batch_sampler, ferry.BatchSampler)


def test_lightning_rebuilt_loaders_answer_ferrys_names() -> None:
    """Lightning's ``test_replace_distributed_sampler`` and the overfit/limit-batches cases:
    the Trainer rebuilds a loader around torch's samplers."""
    data = ferry.TensorDataset(torch.arange(8.0))
    loader = ferry.DataLoader(data, batch_size=2, shuffle=True)
    torch_sampler = tud.distributed.DistributedSampler(data, num_replicas=2, rank=1)
    rebuilt = _update_dataloader(loader, torch_sampler)
    assert isinstance(rebuilt.sampler, DistributedSampler)
    assert isinstance(rebuilt.batch_sampler, ferry.BatchSampler)
    sequential = _update_dataloader(loader, tud.SequentialSampler(data))
    assert isinstance(sequential.sampler, ferry.SequentialSampler)
    assert not isinstance(sequential.sampler, ferry.RandomSampler)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dispatch_batches", [False, True])
def test_accelerate_prepared_loaders_are_ferrys_data_loader(dispatch_batches: bool) -> None:
    """accelerate's ``test_dataloader_inheritance`` and ``test_can_pickle_dataloader``."""
    for made in (
        SkipDataLoader(range(16), batch_size=4, skip_batches=2),
        DataLoaderShard(range(16), batch_size=4),
        DataLoaderDispatcher(range(16), batch_size=4),
    ):
        assert isinstance(made, ferry.DataLoader)
        assert isinstance(made.base_dataloader, ferry.DataLoader)
    loader = ferry.DataLoader(ferry.TensorDataset(torch.arange(10)))
    config = DataLoaderConfiguration(dispatch_batches=dispatch_batches)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    accelerator.prepare(loader, skip_first_batches(loader, 2))
    loaded = pickle.loads(pickle.dumps(accelerator))
    assert len(loaded._dataloaders) == 2
    assert all(isinstance(made, ferry.DataLoader) for made in loaded._dataloaders)


def test_hf_streams_are_ferrys_iterable_datasets() -> None:
    """datasets' ``test_iterable_dataset_torch_integration`` and ``_picklable``."""
    stream = datasets.Dataset.from_dict({"id": list(range(6))}).to_iterable_dataset()
    assert isinstance(stream, ferry.IterableDataset)
    assert isinstance(pickle.loads(pickle.dumps(stream)), ferry.IterableDataset)
    assert [row["id"] for row in ferry.DataLoader(stream, batch_size=None)] == list(range(6))


# -- Lightning stops a persistent iterator, then sets the loader's _iterator to None -------------


def _counting_loader(base: type) -> Any:
    """A loader whose iterators are torch's, counting their ``_shutdown_workers`` calls (as
    Lightning's ``test_workers_are_shutdown`` builds it)."""

    class Counted(_MultiProcessingDataLoaderIter):
        def __init__(self, loader: Any) -> None:
            super().__init__(loader)
            self.owner = loader

        def _shutdown_workers(self) -> None:
            self.owner.shutdowns += 1
            super()._shutdown_workers()

    class Counting(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.shutdowns = 0

        def _get_iterator(self) -> Any:
            return Counted(self)

    return Counting


def _shutdowns(module: Any) -> list[int]:
    loader = _counting_loader(module.DataLoader)(
        module.TensorDataset(torch.arange(6.0)),
        batch_size=2,
        num_workers=1,
        persistent_workers=True,
        multiprocessing_context="fork",
    )
    counts = []
    for _ in range(2):  # two stages, each stopped as Lightning stops them
        assert len(list(loader)) == 3
        _shutdown_workers_and_reset_iterator(loader)
        gc.collect()
        counts.append(loader.shutdowns)
    assert loader._iterator is None
    return counts


@pytest.mark.timeout(120)
def test_an_iterator_stopped_before_it_is_let_go_is_stopped_once() -> None:
    assert _shutdowns(ferry) == _shutdowns(tud)
