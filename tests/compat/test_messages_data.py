"""The errors and warnings of the samplers, ``DistributedSampler``, the datasets and
``random_split``, collate, and ``WorkerInfo`` keep torch's fixed phrases (see
:mod:`compat.phrases`)."""

from __future__ import annotations

import dataclasses
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from torch.utils.data._utils.collate import collate as torch_collate
from torch.utils.data._utils.worker import WorkerInfo as TorchWorkerInfo

import ferry
from _support.compare import DuckStream, map_dataset, stream_dataset
from _support.torch_versions import needs_torch
from compat.phrases import Case, check, params

pytestmark = pytest.mark.usefixtures("guard_global_state")

POSITIVE = "should be a positive integer value, but got"


def worker_info(module: Any) -> Any:
    cls = TorchWorkerInfo if module is tud else ferry.WorkerInfo
    return cls(id=0, num_workers=1, seed=0, dataset=None)


def set_worker_id(module: Any) -> None:
    worker_info(module).id = 1


def delete_worker_id(module: Any) -> None:
    del worker_info(module).id


def collate_without_map(module: Any) -> Any:
    """``collate`` (which ``default_collate`` calls with the default map) with an empty map."""
    collate = torch_collate if module is tud else module.collate
    return collate([object(), object()], collate_fn_map={})


class Short:
    """Map-style whose ``__getitems__`` returns one sample too few."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return index

    def __getitems__(self, indices: list[int]) -> list[int]:
        return list(indices)[:-1]


class NoLen:
    def __getitem__(self, index: int) -> int:
        return index


def subset_overriding_getitem(module: Any) -> Any:
    class Doubled(module.Subset):
        def __getitem__(self, index: int) -> Any:
            return 2 * super().__getitem__(index)

    return Doubled(list(range(4)), [0, 1])


def cummulative_sizes(module: Any) -> Any:
    return module.ConcatDataset([[1, 2]]).cummulative_sizes


def without_distributed(module: Any) -> Any:
    with mock.patch.object(torch.distributed, "is_available", return_value=False):
        return module.DistributedSampler(range(4))


def without_distributed_rank(module: Any) -> Any:
    """No ``torch.distributed``, ``num_replicas`` given: torch's second check, for the rank."""
    with mock.patch.object(torch.distributed, "is_available", return_value=False):
        return module.DistributedSampler(range(4), num_replicas=2)


def distributed_after_change(change: str, **kwargs: Any) -> Any:
    """Iterates a ``DistributedSampler`` of 4 indices over 2 ranks after ``change``: the
    dataset grows or shrinks by one, or ``rank``/``num_replicas`` is reassigned."""

    def trigger(module: Any) -> Any:
        data = list(range(4))
        sampler = module.DistributedSampler(data, num_replicas=2, rank=0, **kwargs)
        if change == "grow":
            data.append(4)
        elif change == "shrink":
            data.pop()
        else:
            name, value = change.split("=")
            setattr(sampler, name, int(value))
        return list(sampler)

    return trigger


def nested_tensors(module: Any) -> Any:
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    return module.default_collate([nested, nested])


def sparse_tensors(module: Any) -> Any:
    sparse = torch.eye(2).to_sparse()
    return module.default_collate([sparse, sparse])


SAMPLERS = [
    *(
        Case(
            f"random_replacement_{label}",
            lambda m, value=value: m.RandomSampler(range(3), replacement=value),
            TypeError,
            (f"replacement should be a boolean value, but got replacement={value}",),
        )
        for label, value in [("not_bool", 0), ("str", "yes")]
    ),
    *(
        Case(
            f"random_num_samples_{label}",
            lambda m, n=n: m.RandomSampler(range(3), num_samples=n),
            ValueError,
            (f"num_samples {POSITIVE} num_samples={n}",),
        )
        for label, n in [("zero", 0), ("negative", -2), ("float", 1.5)]
    ),
    Case(
        "random_empty_dataset",
        lambda m: m.RandomSampler([]),
        ValueError,
        (f"num_samples {POSITIVE} num_samples=0",),
    ),
    *(
        Case(
            f"weighted_num_samples_{label}",
            lambda m, n=n: m.WeightedRandomSampler([1.0, 2.0], num_samples=n),
            ValueError,
            (f"num_samples {POSITIVE} num_samples={n}",),
        )
        for label, n in [
            ("zero", 0),
            ("bool", True),
            ("float", 1.5),
            ("negative", -1),
            ("none", None),
        ]
    ),
    *(
        Case(
            f"weighted_replacement_{label}",
            lambda m, value=value: m.WeightedRandomSampler([1.0, 2.0], 2, replacement=value),
            ValueError,
            (f"replacement should be a boolean value, but got replacement={value}",),
        )
        for label, value in [("not_bool", 1), ("none", None)]
    ),
    *(
        Case(
            f"weighted_weights_{label}",
            lambda m, weights=weights: m.WeightedRandomSampler(weights, 2),
            ValueError,
            (rf"weights should be a 1d sequence but given weights have shape {shape}",),
        )
        for label, weights, shape in [
            ("2d", [[1.0, 2.0], [3.0, 4.0]], r"\(2, 2\)"),
            ("scalar", 1.0, r"\(\)"),
        ]
    ),
    *(
        Case(
            f"batch_size_{label}",
            lambda m, size=size: m.BatchSampler(range(4), size, False),
            ValueError,
            (f"batch_size {POSITIVE} batch_size={size}",),
        )
        for label, size in [
            ("zero", 0),
            ("bool", True),
            ("none", None),
            ("float", 2.0),
            ("negative", -1),
            ("str", "2"),
        ]
    ),
    *(
        Case(
            f"batch_sampler_drop_last_{label}",
            lambda m, value=value: m.BatchSampler(range(4), 2, value),
            ValueError,
            (f"drop_last should be a boolean value, but got drop_last={value}",),
        )
        for label, value in [("not_bool", 1), ("none", None)]
    ),
    Case(
        "sampler_base_iter",
        lambda m: iter(m.Sampler()),
        NotImplementedError,
        (),
    ),
    # torch's Sampler deliberately has no __len__ (see the note in torch's sampler.py).
    Case(
        "sampler_base_len",
        lambda m: len(m.Sampler()),
        TypeError,
        (r"object of type 'Sampler' has no len\(\)",),
    ),
    *(
        Case(
            f"distributed_rank_{label}",
            lambda m, rank=rank: m.DistributedSampler(range(4), num_replicas=2, rank=rank),
            ValueError,
            (rf"Invalid rank {rank}, rank should be in the interval \[0, 1\]",),
        )
        for label, rank in [("too_large", 2), ("negative", -1)]
    ),
    *(
        Case(
            f"distributed_{label}_replicas",
            lambda m, n=n: m.DistributedSampler(range(4), num_replicas=n, rank=0),
            ValueError,
            (rf"Invalid rank 0, rank should be in the interval \[0, {n - 1}\]",),
        )
        for label, n in [("no", 0), ("negative", -2)]
    ),
    *(
        Case(
            f"distributed_{missing}_without_process_group",
            lambda m, kwargs=kwargs: m.DistributedSampler(range(4), **kwargs),
            ValueError,
            (
                "Default process group has not been initialized, please make sure to call "
                "init_process_group",
            ),
            marks=[needs_torch("2.5", "this message")],
        )
        for missing, kwargs in [("num_replicas", {"rank": 0}), ("rank", {"num_replicas": 2})]
    ),
    Case(
        "distributed_package_unavailable",
        without_distributed,
        RuntimeError,
        ("Requires distributed package to be available",),
    ),
    Case(
        "distributed_package_unavailable_for_rank",
        without_distributed_rank,
        RuntimeError,
        ("Requires distributed package to be available",),
    ),
    *(
        Case(
            f"distributed_{label}",
            distributed_after_change(change, **kwargs),
            AssertionError,
            (rf"Number of indices \({got}\) does not match total_size \(4\)",),
            marks=[needs_torch("2.13", "this message")],
        )
        for label, change, kwargs, got in [
            # torch pads the grown list with its first total_size indices: 5 + 4.
            ("dataset_grew", "grow", {}, 9),
            ("dataset_grew_shuffled", "grow", {"shuffle": True}, 9),
            ("dataset_shrank_drop_last", "shrink", {"drop_last": True}, 3),
        ]
    ),
    *(
        Case(
            f"distributed_{label}_reassigned",
            distributed_after_change(change),
            AssertionError,
            (rf"Number of subsampled indices \({got}\) does not match num_samples \(2\)",),
            marks=[needs_torch("2.13", "this message")],
        )
        for label, change, got in [
            ("rank", "rank=5", 0),
            ("negative_rank", "rank=-1", 1),
            ("num_replicas", "num_replicas=4", 1),
        ]
    ),
    Case(
        "distributed_dataset_without_len",
        lambda m: m.DistributedSampler(NoLen(), num_replicas=2, rank=0),
        TypeError,
        (r"object of type 'NoLen' has no len\(\)",),
    ),
]

DATASETS = [
    Case(
        "dataset_getitem",
        lambda m: m.Dataset()[0],
        NotImplementedError,
        ("Subclasses of Dataset should implement __getitem__",),
    ),
    Case(
        "iterable_dataset_abstract",
        lambda m: m.IterableDataset(),
        TypeError,
        ("Can't instantiate abstract class IterableDataset",),
        marks=[needs_torch("2.5", "an abstract IterableDataset.__iter__")],
    ),
    Case(
        "iterable_dataset_getitem",
        lambda m: stream_dataset(m, [1])[0],
        NotImplementedError,
        ("Subclasses of Dataset should implement __getitem__",),
    ),
    Case(
        "tensor_size_mismatch",
        lambda m: m.TensorDataset(torch.zeros(3), torch.zeros(4)),
        AssertionError,
        ("Size mismatch between tensors",),
    ),
    Case(
        "stack_args_and_kwargs",
        lambda m: m.StackDataset([1], b=[2]),
        ValueError,
        ("Supported either", "but both types are given"),
    ),
    Case(
        "stack_nothing",
        lambda m: m.StackDataset(),
        ValueError,
        ("At least one dataset should be passed",),
    ),
    *(
        Case(
            f"stack_size_mismatch_{label}",
            build,
            ValueError,
            ("Size mismatch between datasets",),
        )
        for label, build in [
            ("args", lambda m: m.StackDataset([1, 2], [3])),
            ("kwargs", lambda m: m.StackDataset(a=[1, 2], b=[3])),
        ]
    ),
    *(
        Case(
            f"stack_nested_output_mismatch_{label}",
            build,
            ValueError,
            ("Nested dataset's output size mismatch. Expected 2, got 1",),
            marks=[needs_torch("2.5", "StackDataset.__getitems__")],
        )
        for label, build in [
            ("args", lambda m: m.StackDataset(Short()).__getitems__([0, 1])),
            ("kwargs", lambda m: m.StackDataset(a=Short()).__getitems__([0, 1])),
        ]
    ),
    Case(
        "concat_empty",
        lambda m: m.ConcatDataset([]),
        AssertionError,
        ("datasets should not be an empty iterable",),
    ),
    Case(
        "concat_iterable",
        lambda m: m.ConcatDataset([[1], stream_dataset(m, [1])]),
        AssertionError,
        ("ConcatDataset does not support IterableDataset",),
    ),
    Case(
        "concat_negative_index",
        lambda m: m.ConcatDataset([[1, 2], [3]])[-4],
        ValueError,
        ("absolute value of index should not exceed dataset length",),
    ),
    Case(
        "concat_cummulative_sizes",
        cummulative_sizes,
        FutureWarning,
        ("`cummulative_sizes` attribute is renamed to `cumulative_sizes`",),
        marks=[needs_torch("2.5", "this warning's category")],
    ),
    *(
        Case(
            f"chain_map_style_{label}",
            use,
            AssertionError,
            ("ChainDataset only supports IterableDataset",),
        )
        for label, use in [
            ("iter", lambda m: list(m.ChainDataset([stream_dataset(m, [1]), [2]]))),
            ("len", lambda m: len(m.ChainDataset([map_dataset(m, [2])]))),
        ]
    ),
    Case(
        "subset_overrides_getitem_only",
        subset_overriding_getitem,
        NotImplementedError,
        ("Doubled overrides __getitem__ but not __getitems__",),
        marks=[needs_torch("2.13", "this check")],
    ),
    Case(
        "random_split_fraction_out_of_range",
        lambda m: m.random_split(range(4), [1.5, -0.5]),
        ValueError,
        ("Fraction at index 0 is not between 0 and 1",),
    ),
    *(
        Case(
            f"random_split_sum_{label}",
            lambda m, lengths=lengths: m.random_split(range(4), lengths),
            ValueError,
            ("Sum of input lengths does not equal the length of the input dataset!",),
        )
        for label, lengths in [("lengths", [1, 2]), ("fractions", [0.5, 0.6])]
    ),
    Case(
        "random_split_empty_split",
        lambda m: m.random_split(range(2), [0.5, 0.5, 0.0]),
        UserWarning,
        ("Length of split at index 2 is 0. This might result in an empty dataset.",),
    ),
]

COLLATE = [
    *(
        Case(
            f"collate_unsupported_{label}",
            lambda m, batch=batch: m.default_collate(batch),
            TypeError,
            (
                "default_collate: batch must contain tensors, numpy arrays, numbers, dicts or "
                f"lists; found {found}",
            ),
        )
        for label, batch, found in [
            ("object", [object(), object()], "<class 'object'>"),
            ("none", [None, None], "<class 'NoneType'>"),
            ("nested", [{"a": (1, DuckStream([]))}] * 2, "<class '_support.compare.DuckStream'>"),
            ("numpy_object", [np.array([None], dtype=object)] * 2, "object"),
            ("numpy_str", [np.array(["a"])] * 2, "<U1"),
            ("numpy_str_scalar", [np.array("a")] * 2, "<U1"),
        ]
    ),
    Case(
        "collate_without_a_map",
        collate_without_map,
        TypeError,
        (
            "default_collate: batch must contain tensors, numpy arrays, numbers, dicts or "
            "lists; found <class 'object'>",
        ),
    ),
    *(
        Case(
            f"collate_unequal_sizes{label}",
            lambda m, batch=batch: m.default_collate(batch),
            RuntimeError,
            ("each element in list of batch should be of equal size",),
        )
        for label, batch in [("", [[1, 2], [3]]), ("_tuples", [(1, 2), (3,)])]
    ),
    Case(
        "collate_nested_tensors",
        nested_tensors,
        RuntimeError,
        ("Batches of nested tensors are not currently supported by the default collate_fn",),
        # torch warns that nested tensors are a prototype.
        marks=[
            pytest.mark.filterwarnings("ignore::UserWarning"),
            needs_torch("2.5", "this check"),
        ],
    ),
    Case(
        "collate_sparse_tensors",
        sparse_tensors,
        RuntimeError,
        ("Batches of sparse tensors are not currently supported by the default collate_fn",),
        marks=[needs_torch("2.5", "this check")],
    ),
    Case(
        "worker_info_is_frozen",
        set_worker_id,
        dataclasses.FrozenInstanceError,
        ("cannot assign to field 'id'",),
        marks=[needs_torch("2.13", "a WorkerInfo that is a frozen dataclass")],
    ),
    Case(
        "worker_info_field_cannot_be_deleted",
        delete_worker_id,
        dataclasses.FrozenInstanceError,
        ("cannot delete field 'id'",),
        marks=[needs_torch("2.13", "a WorkerInfo that is a frozen dataclass")],
    ),
]


@pytest.mark.parametrize("case", params(SAMPLERS))
def test_sampler_errors(case: Case) -> None:
    check(case)


@pytest.mark.parametrize("case", params(DATASETS))
def test_dataset_errors(case: Case) -> None:
    check(case)


@pytest.mark.parametrize("case", params(COLLATE))
def test_collate_and_worker_info_errors(case: Case) -> None:
    check(case)
