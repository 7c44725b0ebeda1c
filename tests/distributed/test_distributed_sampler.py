"""DistributedSampler, shard and shard_info in one process: explicit ranks, torch as the oracle.

The tests on real process groups are in ``test_distributed_groups.py``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

from _support.torch_versions import needs_torch
from ferry._core import ranks
from ferry._core.info import WorkerInfo, set_thread_worker_info
from ferry._sampler_keys import index_batches, index_chunks
from ferry.distributed import DistributedSampler, NoProcessGroupError, shard, shard_info
from ferry.samplers import BatchSampler, Sampler


@st.composite
def sampler_args(draw: st.DrawFn) -> dict[str, object]:
    num_replicas = draw(st.integers(1, 9))
    return {
        "n": draw(st.integers(0, 200)),
        "num_replicas": num_replicas,
        "rank": draw(st.integers(0, num_replicas - 1)),
        "shuffle": draw(st.booleans()),
        "seed": draw(st.one_of(st.integers(0, 2**31), st.integers(-(2**40), 2**40))),
        "drop_last": draw(st.booleans()),
        "epoch": draw(st.integers(0, 10_000)),
    }


def _pair(args: dict[str, object]) -> tuple[DistributedSampler, TorchDistributedSampler[int]]:
    kwargs = {k: v for k, v in args.items() if k not in ("n", "epoch")}
    data = range(args["n"])
    ours = DistributedSampler(data, **kwargs)
    theirs = TorchDistributedSampler(data, **kwargs)
    ours.set_epoch(args["epoch"])
    theirs.set_epoch(args["epoch"])
    return ours, theirs


@settings(max_examples=300, deadline=None)
@given(sampler_args())
def test_same_indices_and_sizes_as_torch(args: dict[str, object]) -> None:
    ours, theirs = _pair(args)
    assert list(ours) == list(theirs)
    assert len(ours) == len(theirs)
    assert (ours.num_samples, ours.total_size) == (theirs.num_samples, theirs.total_size)


@settings(max_examples=100, deadline=None)
@given(sampler_args())
def test_index_chunks_are_the_iteration_as_int64_tensors(args: dict[str, object]) -> None:
    ours, _ = _pair(args)
    chunks = list(ours._index_chunks())
    assert all(c.dtype == torch.int64 and c.dim() == 1 for c in chunks)
    joined = torch.cat([*chunks, torch.empty(0, dtype=torch.int64)]).tolist()
    assert joined == list(ours)


def test_loader_tensor_path_sees_the_same_indices() -> None:
    sampler = DistributedSampler(range(23), num_replicas=3, rank=2, seed=8)
    sampler.set_epoch(3)
    chunks = index_chunks(sampler)
    assert chunks is not None
    assert torch.cat(list(chunks)).tolist() == list(sampler)
    batches = index_batches(BatchSampler(sampler, batch_size=3, drop_last=False))
    assert batches is not None
    assert [b.tolist() for b in batches] == list(BatchSampler(sampler, 3, drop_last=False))


def test_subclass_that_overrides_iter_leaves_the_tensor_path() -> None:
    class Reversed(DistributedSampler):
        def __iter__(self) -> Iterator[int]:
            return reversed(list(super().__iter__()))

    sampler = Reversed(range(10), num_replicas=2, rank=0)
    assert index_chunks(sampler) is None


def test_attributes_match_torch() -> None:
    ours = DistributedSampler(range(10), num_replicas=4, rank=3, shuffle=False, seed=5)
    theirs = TorchDistributedSampler(range(10), num_replicas=4, rank=3, shuffle=False, seed=5)
    ours.set_epoch(2)
    theirs.set_epoch(2)
    for name in ("num_replicas", "rank", "epoch", "num_samples", "total_size", "shuffle", "seed"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.drop_last is theirs.drop_last is False
    assert ours.dataset is not None
    assert isinstance(ours, Sampler)
    assert "num_replicas=4" in repr(ours)


@pytest.mark.parametrize(("n", "world"), [(1, 4), (3, 8), (2, 7), (5, 2)])
def test_padding_repeats_the_list_when_it_is_shorter_than_the_world(n: int, world: int) -> None:
    parts = [list(DistributedSampler(range(n), world, r, shuffle=False)) for r in range(world)]
    theirs = [
        list(TorchDistributedSampler(range(n), world, r, shuffle=False)) for r in range(world)
    ]
    assert parts == theirs
    assert all(len(p) == len(parts[0]) for p in parts)
    assert {i for p in parts for i in p} == set(range(n))


def test_set_epoch_reshuffles_deterministically() -> None:
    first = DistributedSampler(range(50), num_replicas=2, rank=0, seed=1)
    second = DistributedSampler(range(50), num_replicas=2, rank=0, seed=1)
    orders = []
    for epoch in range(3):
        first.set_epoch(epoch)
        second.set_epoch(epoch)
        assert list(first) == list(second)
        orders.append(list(first))
    assert orders[0] != orders[1] != orders[2]
    assert list(first) == list(first)  # iterating does not advance the shuffle


def test_iter_draws_the_epochs_list_at_once_as_torchs_does() -> None:
    """torch's ``__iter__`` builds its list: a ``set_epoch`` after ``iter()`` is for the next
    iteration, and a split made invalid fails at ``iter()``, not at the first index."""
    for sampler_class in (DistributedSampler, TorchDistributedSampler):
        sampler = sampler_class(range(10), num_replicas=2, rank=0, seed=3)
        keys = iter(sampler)
        sampler.set_epoch(5)
        assert list(keys) == list(TorchDistributedSampler(range(10), 2, 0, seed=3))
        broken = sampler_class(range(10), num_replicas=2, rank=0)
        broken.rank = 5
        with pytest.raises(AssertionError):
            iter(broken)


# --- pad=False -------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 150), st.integers(1, 9), st.booleans(), st.integers(0, 100))
def test_unpadded_ranks_see_every_sample_exactly_once(
    n: int, world: int, shuffle: bool, epoch: int
) -> None:
    samplers = [
        DistributedSampler(range(n), world, rank, shuffle=shuffle, seed=3, pad=False)
        for rank in range(world)
    ]
    for s in samplers:
        s.set_epoch(epoch)
    parts = [list(s) for s in samplers]
    assert sorted(i for p in parts for i in p) == list(range(n))
    assert [len(s) for s in samplers] == [len(p) for p in parts]
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    # The same shuffle as torch's, dealt the same way, only without the repeated tail.
    whole = TorchDistributedSampler(range(n), 1, 0, shuffle=shuffle, seed=3)
    whole.set_epoch(epoch)
    order = list(whole)
    assert parts == [order[rank::world] for rank in range(world)]
    assert all(s.total_size == n for s in samplers)


def test_unpadded_lengths_differ_by_one_on_the_first_ranks() -> None:
    lengths = [len(DistributedSampler(range(10), 4, r, pad=False)) for r in range(4)]
    assert lengths == [3, 3, 2, 2]


@pytest.mark.parametrize("n", [0, 1, 7, 12])
def test_unpadded_with_drop_last_is_drop_last(n: int) -> None:
    """Nothing is repeated with drop_last anyway: pad=False is accepted and changes nothing."""
    for rank in range(3):
        unpadded = DistributedSampler(range(n), 3, rank, seed=4, drop_last=True, pad=False)
        padded = DistributedSampler(range(n), 3, rank, seed=4, drop_last=True)
        assert list(unpadded) == list(padded)
        assert len(unpadded) == len(padded)
        assert unpadded.total_size == padded.total_size


def test_pad_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        DistributedSampler(range(4), 2, 0, True, 0, False, False)


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [-1, 2, 5])
def test_rank_out_of_range(rank: int) -> None:
    with pytest.raises(ValueError) as theirs:
        TorchDistributedSampler(range(4), num_replicas=2, rank=rank)
    with pytest.raises(
        ValueError, match=rf"Invalid rank {rank}, rank should be in the interval \[0, 1\]"
    ):
        DistributedSampler(range(4), num_replicas=2, rank=rank)
    assert theirs.type is ValueError


@pytest.mark.parametrize("num_replicas", [0, -2])
def test_num_replicas_must_be_positive(num_replicas: int) -> None:
    with pytest.raises(
        ValueError,
        match=rf"Invalid rank 0, rank should be in the interval \[0, {num_replicas - 1}\]: "
        rf"num_replicas must be a positive number of ranks, got num_replicas={num_replicas}",
    ):
        DistributedSampler(range(4), num_replicas=num_replicas, rank=0)


@pytest.mark.parametrize(
    ("option", "value"),
    [("rank", 1.0), ("num_replicas", "2"), ("seed", 1.5), ("num_replicas", 2.0)],
)
def test_integer_options_reject_other_types(option: str, value: object) -> None:
    """torch fails on these too: at the first slice or seed (TypeError, RuntimeError), or
    comparing a string with the rank."""
    kwargs: dict[str, object] = {"num_replicas": 2, "rank": 0, option: value}
    with pytest.raises(TypeError, match=rf"{option} must be an integer, got {value!r}"):
        DistributedSampler(range(4), **kwargs)


@pytest.mark.parametrize(
    ("num_replicas", "rank"), [(1.0, 1), (0, 1.0), (2.5, -1), (np.float64(2), 3)]
)
def test_a_rank_outside_the_ranks_is_named_first_as_in_torch(
    num_replicas: float, rank: float
) -> None:
    """torch places the rank among the ranks before it uses either as an integer: a rank
    outside them is its ValueError even where one of the two is a float."""
    with pytest.raises(ValueError, match="Invalid rank") as theirs:
        TorchDistributedSampler(range(4), num_replicas=num_replicas, rank=rank)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"Invalid rank .*, rank should be in the interval"
    ) as ours:
        DistributedSampler(range(4), num_replicas=num_replicas, rank=rank)  # type: ignore[arg-type]
    assert str(theirs.value).split(":")[0] in str(ours.value)


@pytest.mark.parametrize(
    "options",
    [
        {"shuffle": 1},
        {"shuffle": 0},
        {"shuffle": "yes"},
        {"drop_last": 1},
        {"drop_last": None},
        {"rank": True},
        {"rank": False, "num_replicas": True},
        {"seed": True, "shuffle": 1},
        {"rank": np.int64(1), "num_replicas": np.int32(3)},
    ],
    ids=str,
)
def test_values_torch_takes_as_true_false_or_integers_give_its_indices(
    options: dict[str, Any],
) -> None:
    """torch's sampler takes any value for shuffle and drop_last (as true or false) and a bool
    as an integer (rank=True): a program that passes them keeps working."""
    kwargs = {"num_replicas": 2, "rank": 0, "seed": 3, **options}
    theirs, ours = (
        TorchDistributedSampler(range(9), **kwargs),
        DistributedSampler(range(9), **kwargs),
    )
    for epoch in (0, True, 2):
        theirs.set_epoch(epoch)
        ours.set_epoch(epoch)
        assert list(ours) == list(theirs)
        assert len(ours) == len(theirs)
    assert ours.shuffle == bool(theirs.shuffle)
    assert ours.drop_last == bool(theirs.drop_last)


def test_pad_takes_only_a_bool() -> None:
    """pad is ferry's own option: only True or False."""
    with pytest.raises(TypeError, match=r"pad should be a boolean value, but got pad=1 \(int\)"):
        DistributedSampler(range(4), num_replicas=2, rank=0, pad=1)  # type: ignore[arg-type]


def test_set_epoch_rejects_a_float() -> None:
    sampler = DistributedSampler(range(4), num_replicas=2, rank=0)
    with pytest.raises(TypeError, match=r"epoch must be an integer, got 1.5"):
        sampler.set_epoch(1.5)


def test_numpy_integers_are_accepted() -> None:
    sampler = DistributedSampler(range(9), np.int64(3), np.int32(1), seed=np.int64(2))
    sampler.set_epoch(np.int64(4))
    theirs = TorchDistributedSampler(range(9), 3, 1, seed=2)
    theirs.set_epoch(4)
    assert list(sampler) == list(theirs)
    assert type(sampler.rank) is int
    assert type(sampler.epoch) is int


def test_dataset_without_length() -> None:
    def stream() -> Iterator[int]:
        yield 1

    with pytest.raises(TypeError, match=r"needs a dataset with a length.*got generator"):
        DistributedSampler(stream(), num_replicas=2, rank=0)


def test_dataset_whose_length_changed() -> None:
    data = list(range(10))
    sampler = DistributedSampler(data, num_replicas=2, rank=0)
    data.append(10)
    with pytest.raises(RuntimeError, match=r"length changed from 10 to 11"):
        list(sampler)


@needs_torch("2.5", "this message")
@pytest.mark.parametrize(
    "kwargs", [{}, {"num_replicas": 2}, {"rank": 0}], ids=["neither", "no-rank", "no-world"]
)
def test_no_process_group(kwargs: dict[str, int]) -> None:
    assert not torch.distributed.is_initialized()
    # torch raises ValueError here (from get_world_size/get_rank); ours is also a RuntimeError.
    with pytest.raises(ValueError):
        TorchDistributedSampler(range(4), **kwargs)
    with pytest.raises(
        NoProcessGroupError, match=r"Default process group has not been initialized"
    ):
        DistributedSampler(range(4), **kwargs)
    with pytest.raises(RuntimeError):
        DistributedSampler(range(4), **kwargs)
    with pytest.raises(ValueError):
        DistributedSampler(range(4), **kwargs)


def test_distributed_package_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch built without distributed support: torch raises RuntimeError, and so do we."""
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"Requires distributed package to be available"):
        DistributedSampler(range(4))
    with pytest.raises(RuntimeError):
        TorchDistributedSampler(range(4))
    assert shard_info() == (0, 1)


# --- shard and shard_info ----------------------------------------------------------------------


def test_shard_in_the_main_process_without_a_group_yields_everything() -> None:
    assert shard_info() == (0, 1)
    assert list(shard(range(7))) == list(range(7))
    assert list(shard(iter("abc"))) == ["a", "b", "c"]


def _in_workers(num_workers: int, length: int) -> list[tuple[tuple[int, int], list[int]]]:
    """Each of ``num_workers`` threads, posing as loader workers: its shard_info and shard."""
    results: list[tuple[tuple[int, int], list[int]]] = [((0, 0), [])] * num_workers

    def work(worker_id: int) -> None:
        set_thread_worker_info(WorkerInfo(worker_id, num_workers, seed=0, dataset=None))
        results[worker_id] = (shard_info(), list(shard(range(length))))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(num_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
        assert not t.is_alive()
    return results


@pytest.mark.timeout(30)
def test_shard_between_workers_of_one_process() -> None:
    results = _in_workers(3, 20)
    assert [info for info, _ in results] == [(0, 3), (1, 3), (2, 3)]
    assert [items for _, items in results] == [list(range(w, 20, 3)) for w in range(3)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world", [2, 3])
def test_shard_between_ranks_and_workers_covers_the_stream_once(world: int) -> None:
    """What process workers see once the loader hands them their parent's rank."""
    seen: Counter[int] = Counter()
    slots = []
    try:
        for rank in range(world):
            ranks.inherit_rank_world((rank, world))
            for info, items in _in_workers(2, 31):
                slots.append(info)
                seen.update(items)
    finally:
        ranks.inherit_rank_world(None)
    assert sorted(slots) == [(slot, 2 * world) for slot in range(2 * world)]
    assert seen == Counter(range(31))
    assert shard_info() == (0, 1)


def test_shard_is_lazy() -> None:
    """The share is decided when iteration starts (inside the worker), not when shard is called."""
    items = shard(range(6))
    ranks.inherit_rank_world((1, 2))
    try:
        assert list(items) == [1, 3, 5]
    finally:
        ranks.inherit_rank_world(None)
