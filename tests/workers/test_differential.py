"""Worker loading against torch: the same batches, exactly, and the same global RNG state after.

torch runs with fork workers (its results do not depend on the start method); ferry runs with
every kind of worker. Fork and threads get the broad matrix; spawn and forkserver, whose workers
take seconds to start, a representative case each.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ferry
from _support import datasets as ds
from _support.compare import HYPOTHESIS, assert_same
from _support.processes import ALL, FAST, Kind
from workers.differential import Build, compare

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def items(n: int, **kwargs: Any) -> Build:
    return lambda module: (ds.Items(n), dict(kwargs))


# -- map-style ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ALL, indirect=True)
def test_map_shuffled_every_kind(kind: Kind) -> None:
    batches = compare(items(23, batch_size=4, shuffle=True), kind, num_workers=2)
    assert len(batches[0]) == 6


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
@pytest.mark.parametrize("num_workers", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_map_batches(kind: Kind, num_workers: int, drop_last: bool, shuffle: bool) -> None:
    compare(
        items(22, batch_size=5, shuffle=shuffle, drop_last=drop_last),
        kind,
        num_workers=num_workers,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
@pytest.mark.parametrize("num_workers", [1, 3])
def test_map_batching_off(kind: Kind, num_workers: int) -> None:
    batches = compare(items(7, batch_size=None, shuffle=True), kind, num_workers=num_workers)
    assert isinstance(batches[0][0]["name"], str)


def _generator_shuffle(module: Any) -> tuple[Any, dict[str, Any]]:
    return ds.Items(19), {
        "batch_size": 3,
        "shuffle": True,
        "generator": torch.Generator().manual_seed(1234),
    }


def _weighted_sampler(module: Any) -> tuple[Any, dict[str, Any]]:
    sampler = module.WeightedRandomSampler(
        [0.1, 3.0, 1.0, 0.5, 2.0, 0.0, 1.5], num_samples=17, generator=torch.Generator()
    )
    return ds.Items(7), {"batch_size": 4, "sampler": sampler}


def _subset_sampler(module: Any) -> tuple[Any, dict[str, Any]]:
    sampler = module.SubsetRandomSampler([9, 3, 4, 0, 7, 12, 1])
    return ds.Items(13), {"batch_size": 2, "sampler": sampler, "drop_last": True}


def _batch_sampler(module: Any) -> tuple[Any, dict[str, Any]]:
    batches = module.BatchSampler(module.RandomSampler(range(17)), 4, drop_last=False)
    return ds.Items(17), {"batch_sampler": batches}


def _list_batch_sampler(module: Any) -> tuple[Any, dict[str, Any]]:
    # Any iterable of index lists is a batch sampler, uneven batches included.
    return ds.Items(10), {"batch_sampler": [[3, 1], [0], [9, 8, 7, 6], [2, 5, 4]]}


def _tensor_dataset(module: Any) -> tuple[Any, dict[str, Any]]:
    x = torch.arange(60, dtype=torch.float64).reshape(20, 3)
    y = torch.arange(20) % 3 == 0
    return module.TensorDataset(x, y), {"batch_size": 6, "shuffle": True}


def _tensor_subset(module: Any) -> tuple[Any, dict[str, Any]]:
    base = module.TensorDataset(torch.arange(40).reshape(20, 2))
    return module.Subset(base, [5, 1, 19, 7, 0, 3, 8]), {"batch_size": 3}


def _concat(module: Any) -> tuple[Any, dict[str, Any]]:
    return module.ConcatDataset([ds.Items(5), ds.Indices(4)]), {"batch_size": None}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize(
    "build",
    [
        _generator_shuffle,
        _weighted_sampler,
        _subset_sampler,
        _batch_sampler,
        _list_batch_sampler,
        _tensor_dataset,
        _tensor_subset,
        _concat,
    ],
)
def test_map_samplers(kind: Kind, num_workers: int, build: Build) -> None:
    compare(build, kind, num_workers=num_workers)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
@pytest.mark.parametrize(
    "build",
    [
        items(22, batch_size=5, shuffle=True, drop_last=True),
        items(7, batch_size=None, shuffle=True),
        _weighted_sampler,
        _subset_sampler,
        _batch_sampler,
        _list_batch_sampler,
        _tensor_subset,
    ],
    ids=["shuffled", "batching off", "weighted", "subset", "batch sampler", "list", "tensors"],
)
def test_map_balanced_workers_give_torchs_batches(kind: Kind, build: Build) -> None:
    """``balance_workers=True`` changes which worker makes a batch, not the batches: with
    samples that do not draw from the worker's generators, torch's batches, in torch's order,
    and the same RNG state after, over two epochs with persistent workers."""
    compare(
        build,
        kind,
        epochs=2,
        num_workers=3,
        prefetch_factor=1,
        persistent_workers=True,
        ferry_only={"balance_workers": True},
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["spawn"], indirect=True)
def test_map_samplers_spawn(kind: Kind) -> None:
    compare(_batch_sampler, kind, num_workers=1)


@pytest.mark.timeout(120)
@settings(HYPOTHESIS, max_examples=30)
@given(
    case=st.fixed_dictionaries(
        {
            "n": st.integers(0, 30),
            "batch_size": st.one_of(st.none(), st.integers(1, 8)),
            "shuffle": st.booleans(),
            "drop_last": st.booleans(),
            "num_workers": st.integers(1, 3),
            "prefetch_factor": st.integers(1, 3),
            "seed": st.integers(0, 2**31),
            "balanced": st.booleans(),
        }
    )
)
def test_map_property_fork(case: dict[str, Any]) -> None:
    kwargs: dict[str, Any] = {"batch_size": case["batch_size"], "shuffle": case["shuffle"]}
    if case["batch_size"] is not None:
        kwargs["drop_last"] = case["drop_last"]
    n = case["n"]
    compare(
        lambda module: (ds.Indices(n), kwargs),
        Kind("fork"),
        seed=case["seed"],
        num_workers=case["num_workers"],
        prefetch_factor=case["prefetch_factor"],
        # (balanced: the same batches; torch's result is cached, so this costs ferry's run)
        ferry_only={"balance_workers": case["balanced"]},
    )


# -- iterable-style -------------------------------------------------------------------------------


def sharded(n: int, **kwargs: Any) -> Build:
    return lambda module: (ds.Sharded(n, module.get_worker_info), dict(kwargs))


def uneven(lengths: tuple[int, ...], **kwargs: Any) -> Build:
    return lambda module: (ds.Uneven(lengths, module.get_worker_info), dict(kwargs))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ALL, indirect=True)
def test_iterable_sharded_every_kind(kind: Kind) -> None:
    batches = compare(sharded(23, batch_size=4), kind, num_workers=2)
    assert sorted(i for batch in batches[0] for i in batch["index"].tolist()) == list(range(23))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
@pytest.mark.parametrize("num_workers", [1, 2, 3])
@pytest.mark.parametrize(
    ("batch_size", "drop_last"), [(None, False), (1, False), (4, False), (4, True)]
)
def test_iterable_sharded(
    kind: Kind, num_workers: int, batch_size: int | None, drop_last: bool
) -> None:
    kwargs: dict[str, Any] = {"batch_size": batch_size}
    if batch_size is not None:
        kwargs["drop_last"] = drop_last
    compare(sharded(22, **kwargs), kind, num_workers=num_workers)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
@pytest.mark.parametrize(
    "lengths", [(9, 2, 5), (0, 7, 1), (3, 3, 3), (1, 0, 0), (0, 0, 0)], ids=str
)
@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_uneven_streams(kind: Kind, lengths: tuple[int, ...], drop_last: bool) -> None:
    """One worker's stream ends early: the others go on; a short last batch per worker is
    dropped with drop_last."""
    compare(uneven(lengths, batch_size=2, drop_last=drop_last), kind, num_workers=3)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind_name", FAST)
@settings(HYPOTHESIS, max_examples=25)
@given(
    case=st.fixed_dictionaries(
        {
            "lengths": st.lists(st.integers(0, 7), min_size=1, max_size=3),
            "batch_size": st.one_of(st.none(), st.integers(1, 4)),
            "drop_last": st.booleans(),
            "prefetch_factor": st.integers(1, 3),
        }
    )
)
def test_iterable_property(kind_name: str, case: dict[str, Any]) -> None:
    """Streams of any lengths, one per worker, against torch: the round-robin over workers
    that skips ended streams, and drop_last applied per worker."""
    lengths = tuple(case["lengths"])
    kwargs: dict[str, Any] = {"batch_size": case["batch_size"]}
    if case["batch_size"] is not None:
        kwargs["drop_last"] = case["drop_last"]
    compare(
        uneven(lengths, **kwargs),
        Kind(kind_name),
        num_workers=len(lengths),
        prefetch_factor=case["prefetch_factor"],
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
@pytest.mark.parametrize("prefetch_factor", [1, 4])
def test_iterable_uneven_prefetch(kind: Kind, prefetch_factor: int) -> None:
    compare(
        uneven((11, 1, 4), batch_size=None),
        kind,
        num_workers=3,
        prefetch_factor=prefetch_factor,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_iterable_replicated(kind: Kind, num_workers: int) -> None:
    """Without sharding every worker yields the whole stream: each sample num_workers times."""
    batches = compare(
        lambda module: (ds.Replicated(7), {"batch_size": 3}), kind, num_workers=num_workers
    )
    values = sorted(v for batch in batches[0] for v in batch.tolist())
    assert values == sorted(list(range(7)) * num_workers)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_iterable_ferry_base_class(kind: Kind) -> None:
    """A stream derived from ferry.IterableDataset, sharded with ferry.get_worker_info: worker 0
    streams 0, 2, 4, 6, 8 and worker 1 streams 1, 3, 5, 7, 9; their batches alternate."""
    loader = ferry.DataLoader(ds.FerryStream(10), batch_size=2, num_workers=2, **kind.kwargs)
    got = [batch.tolist() for batch in loader]
    assert got == [[0, 2], [1, 3], [4, 6], [5, 7], [8], [9]]


# -- several epochs and persistent workers --------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
@pytest.mark.parametrize("persistent", [False, True])
def test_map_epochs(kind: Kind, persistent: bool) -> None:
    compare(
        items(13, batch_size=3, shuffle=True),
        kind,
        epochs=3,
        num_workers=2,
        persistent_workers=persistent,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
@pytest.mark.parametrize("persistent", [False, True])
def test_map_epochs_after_break(kind: Kind, persistent: bool) -> None:
    """A first epoch left after two batches, then full epochs: the same as torch."""
    compare(
        items(17, batch_size=2, shuffle=True),
        kind,
        epochs=3,
        take=2,
        num_workers=3,
        persistent_workers=persistent,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
@pytest.mark.parametrize("take", [None, 1])
def test_iterable_persistent_epochs(kind: Kind, take: int | None) -> None:
    """Persistent workers reopen their streams every epoch."""
    got = compare(
        uneven((5, 2), batch_size=2),
        kind,
        epochs=3,
        take=take,
        num_workers=2,
        persistent_workers=True,
    )
    assert len(got[1]) == 4
    assert_same(got[1], got[2], "second vs third epoch")
