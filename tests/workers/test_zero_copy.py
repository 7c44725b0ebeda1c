"""Zero-copy hand-off: a process worker's batch reaches the training loop as tensors over shared
memory the worker wrote, without a copy; that memory is reused, and never while the user still
holds a batch in it.

The observable used for "over shared memory": the tensor's bytes lie in a shared mapping
(``s`` in ``/proc/self/maps``) of an anonymous memory file (``/memfd:...``), and its storage
cannot be resized (it wraps memory it does not own).
"""

from __future__ import annotations

import gc
import itertools
from typing import Any

import pytest
import torch

import ferry
from _support import datasets as ds
from _support.processes import FAST, PROCESSES, Kind, shared_mapping_of
from workers.differential import compare

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensor_leaves(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensor_leaves(v)]
    return []


def assert_in_shared_memory(tensor: torch.Tensor) -> None:
    mapping = shared_mapping_of(tensor.data_ptr())
    assert mapping is not None, "the tensor's bytes are in no mapping"
    permissions, path = mapping
    assert permissions[3] == "s", f"not a shared mapping: {mapping}"
    assert path.startswith("/memfd:"), f"not an anonymous memory file: {mapping}"
    storage = tensor.untyped_storage()
    if hasattr(storage, "resizable"):  # (torch 2.1 cannot tell)
        assert not storage.resizable()


def expected_block(index: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, index, dtype=torch.int64).to(dtype)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", PROCESSES, indirect=True)
def test_batches_are_tensors_over_shared_memory(kind: Kind) -> None:
    loader = ferry.DataLoader(ds.Items(9), batch_size=4, num_workers=1, **kind.kwargs)
    batches = list(loader)
    assert [b["index"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert batches[2]["name"] == ["item-8"]
    for batch in batches:
        leaves = tensor_leaves(batch)
        assert len(leaves) == 8
        for leaf in leaves:
            assert_in_shared_memory(leaf)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fork"], indirect=True)
def test_slabs_are_reused_over_an_epoch(kind: Kind) -> None:
    """200 batches; the slabs each worker has shared with the main process stay few: batches
    in flight, the one the loop holds, and those not yet reported free."""
    shape = (2, 4096)
    prefetch = 2
    loader = ferry.DataLoader(
        ds.Blocks(400, shape), batch_size=2, num_workers=2, prefetch_factor=prefetch, **kind.kwargs
    )
    iterator = iter(loader)
    most = [0, 0]
    count = 0
    for count, batch in enumerate(iterator, start=1):
        first = (count - 1) * 2
        assert torch.equal(batch[:, 0, 0], torch.tensor([first, first + 1], dtype=torch.float32))
        for worker in iterator._workers:
            most[worker.worker_id] = max(most[worker.worker_id], len(worker.slabs._maps))
    assert count == 200
    assert all(1 <= m <= prefetch + 3 for m in most), most


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_held_batches_are_never_overwritten(kind: Kind) -> None:
    shape = (4, 10000)  # 320 kB batches: thread workers take them from the reused buffer pool
    loader = ferry.DataLoader(ds.Blocks(120, shape), batch_size=2, num_workers=2, **kind.kwargs)
    iterator = iter(loader)
    held = [next(iterator) for _ in range(20)]
    rest = list(iterator)
    assert len(rest) == 40
    for position, batch in enumerate(held):
        expected = torch.stack(
            [expected_block(2 * position + k, shape, torch.float32) for k in (0, 1)]
        )
        assert torch.equal(batch, expected), f"held batch {position} changed"
    starts = sorted(b.data_ptr() for b in held)
    nbytes = held[0].numel() * held[0].element_size()
    assert all(b - a >= nbytes for a, b in itertools.pairwise(starts)), "overlap"
    # Still intact after the loader and its workers are gone.
    del iterator, loader, rest
    gc.collect()
    for position, batch in enumerate(held):
        assert int(batch[1, 0, 0]) == 2 * position + 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fork"], indirect=True)
def test_memory_freed_by_the_user_is_reused(kind: Kind) -> None:
    """A dropped batch's memory is written again (not a new slab per batch)."""
    loader = ferry.DataLoader(
        ds.Blocks(200, (1000,)), batch_size=1, num_workers=1, prefetch_factor=1, **kind.kwargs
    )
    seen = set()
    for batch in loader:
        seen.add(shared_mapping_of(batch.data_ptr()))
    assert 1 <= len(seen) <= 4, seen


# -- what batches can hold: compared with torch --------------------------------------------------


def blocks(shape: tuple[int, ...], dtype: torch.dtype, **kwargs: Any) -> Any:
    return lambda module: (ds.Blocks(7, shape, dtype), {"batch_size": 3, **kwargs})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
@pytest.mark.parametrize(
    "dtype",
    [torch.bool, torch.float16, torch.bfloat16, torch.complex64, torch.complex128, torch.int8],
    ids=str,
)
def test_dtypes(kind: Kind, dtype: torch.dtype) -> None:
    batches = compare(blocks((3, 5), dtype), kind, num_workers=2)
    assert [b.dtype for b in batches[0]] == [dtype] * 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
@pytest.mark.parametrize("shape", [(0,), (2, 0, 3), ()], ids=str)
def test_zero_size_and_scalar_samples(kind: Kind, shape: tuple[int, ...]) -> None:
    compare(blocks(shape, torch.float32), kind, num_workers=2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_mixed_leaves(kind: Kind) -> None:
    batches = compare(blocks((2,), torch.int64, collate_fn=ds.mixed_leaves), kind, num_workers=2)
    assert batches[0][0]["names"] == ["row-0", "row-1", "row-2"]
    if not kind.threads:
        assert_in_shared_memory(batches[0][0]["stacked"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_custom_collate_tensor_not_made_in_shared_memory(kind: Kind) -> None:
    batches = compare(blocks((4, 2), torch.float64, collate_fn=ds.stack_plain), kind, num_workers=2)
    if not kind.threads:
        for batch in batches[0]:
            assert_in_shared_memory(batch)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_custom_collate_non_contiguous(kind: Kind) -> None:
    """A transposed tensor keeps its strides, as torch's batches do."""
    batches = compare(
        blocks((5,), torch.float32, collate_fn=ds.stack_transposed), kind, num_workers=2
    )
    assert not batches[0][0].is_contiguous()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_custom_collate_views_of_a_batch(kind: Kind) -> None:
    """Views with offsets and strides into default_collate's output."""
    batches = compare(
        blocks((4,), torch.int32, collate_fn=ds.default_then_slice), kind, num_workers=2
    )
    assert batches[0][0]["every_other"].stride() == (4, 2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_views_of_a_batch_made_outside_the_slabs_keep_torchs_strides(kind: Kind) -> None:
    """Views of a tensor collate did not put in a slab are copied in with the bytes they span,
    so their strides are torch's (an expanded view's zero strides too, without a byte per
    element)."""
    build = blocks((6,), torch.float32, collate_fn=ds.views_of_a_plain_batch)
    dataset, kwargs = build(torch.utils.data)
    expected = next(iter(torch.utils.data.DataLoader(dataset, **kwargs, num_workers=2)))
    got = compare(build, kind, num_workers=2)[0][0]  # (epoch 0, batch 0)
    for name, tensor in got.items():
        assert tensor.stride() == expected[name].stride(), name
    if not kind.threads:
        assert got["expanded"].untyped_storage().nbytes() == 6 * 4  # one row, not three


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_one_tensor_twice_in_a_batch(kind: Kind) -> None:
    """The same tensor twice in a batch stays one tensor, as in torch: writing through one
    name is seen through the other."""
    batches = compare(blocks((2,), torch.float32, collate_fn=ds.plain_twice), kind, num_workers=1)
    first, second = batches[0][0]
    first.fill_(-1)
    assert torch.equal(second, first)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_batches_of_growing_size(kind: Kind) -> None:
    """Batches from 256 kB to 4 MB, in no order: slabs grow, several serve one batch, and every
    held batch keeps its values."""
    sizes = [1, 8, 2, 16, 3, 16, 1, 5]
    batches: list[list[int]] = []
    for size in sizes:
        start = sum(len(b) for b in batches)
        batches.append(list(range(start, start + size)))

    def build(module: Any) -> tuple[Any, dict[str, Any]]:
        return ds.TwoBlocks(sum(sizes), (64 * 1024,)), {"batch_sampler": batches}

    got = compare(build, kind, num_workers=2)
    for batch, indices in zip(got[0], batches, strict=True):
        assert batch[0][:, -1].tolist() == [float(i) for i in indices]
        if not kind.threads:
            assert_in_shared_memory(batch[0])
            assert_in_shared_memory(batch[1])
