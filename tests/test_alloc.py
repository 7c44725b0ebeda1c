"""The buffer pool behind batch memory in the main process: a buffer is reused only when no
tensor, view, slice or numpy array made from it is alive; small batches are not pooled; idle
buffers are capped; the allocator is per thread; concurrent use never hands out live memory."""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
import torch

from _support.strategies import TORCH_DTYPES
from ferry._core.alloc import BufferPool, active_allocator, batch_empty, using_allocator

pytestmark = pytest.mark.usefixtures("guard_global_state")

BIG = (1 << 18) // 4 + 1000  # float32 elements: just over the default pooling threshold


def _base(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _settle() -> None:
    """Tensors and their views hold no reference cycles: reference counting frees them at
    ``del``. A young-generation collection covers anything a test helper left in a cycle."""
    gc.collect(0)


def test_small_tensors_are_not_pooled() -> None:
    pool = BufferPool()
    small = pool.empty((100,), torch.float32)
    assert small.shape == (100,)
    assert small.dtype == torch.float32
    assert len(pool) == 0


def test_threshold_is_inclusive() -> None:
    pool = BufferPool(min_bytes=1024)
    pool.empty((255,), torch.float32)
    assert len(pool) == 0
    pool.empty((256,), torch.float32)
    assert len(pool) == 1


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_pooled_tensors_have_the_asked_shape_and_dtype(dtype: torch.dtype) -> None:
    pool = BufferPool(min_bytes=1)
    tensor = pool.empty((3, 5, 7), dtype)
    assert tensor.shape == (3, 5, 7)
    assert tensor.dtype == dtype
    assert tensor.is_contiguous()
    assert tensor.device.type == "cpu"
    assert tensor.data_ptr() % dtype.itemsize == 0
    tensor.fill_(1)
    assert torch.equal(tensor, torch.ones(3, 5, 7, dtype=dtype))
    assert len(pool) == 1


def test_a_buffer_is_reused_after_its_tensor_is_gone() -> None:
    pool = BufferPool()
    first = pool.empty((BIG,), torch.float32)
    address = _base(first)
    del first
    _settle()
    again = pool.empty((BIG,), torch.float32)
    assert _base(again) == address
    assert len(pool) == 1


def test_a_buffer_is_not_reused_while_its_tensor_is_alive() -> None:
    pool = BufferPool()
    first = pool.empty((BIG,), torch.float32)
    first.fill_(7)
    second = pool.empty((BIG,), torch.float32)
    second.fill_(8)
    assert _base(first) != _base(second)
    assert torch.all(first == 7)
    assert len(pool) == 2


@pytest.mark.parametrize(
    "keep",
    [
        lambda t: t[10:20],
        lambda t: t.view(-1, 8)[3],
        lambda t: t[::7],
        lambda t: t.view(torch.int32),
        lambda t: t.untyped_storage(),
        lambda t: t.numpy(),
        lambda t: t.numpy()[5:9],
        lambda t: memoryview(t.numpy()),
        torch.utils.dlpack.to_dlpack,
    ],
    ids=[
        "slice",
        "row of a view",
        "strided",
        "dtype view",
        "storage",
        "numpy",
        "numpy slice",
        "memoryview",
        "dlpack",
    ],
)
def test_a_buffer_is_not_reused_while_anything_made_from_it_is_alive(keep: Any) -> None:
    pool = BufferPool()
    tensor = pool.empty((BIG,), torch.float32)
    address = _base(tensor)
    kept = keep(tensor)
    del tensor
    _settle()
    other = pool.empty((BIG,), torch.float32)
    assert _base(other) != address
    del kept, other
    _settle()
    assert _base(pool.empty((BIG,), torch.float32)) == address


def test_reuse_after_a_numpy_view_is_dropped() -> None:
    pool = BufferPool()
    tensor = pool.empty((BIG,), torch.float32)
    address = _base(tensor)
    array = tensor.numpy()
    del tensor
    _settle()
    assert _base(pool.empty((BIG,), torch.float32)) != address
    del array
    _settle()
    assert _base(pool.empty((BIG,), torch.float32)) == address


def test_best_fit_reuses_a_buffer_at_most_twice_the_size() -> None:
    pool = BufferPool(min_bytes=1024)
    large = pool.empty((4000,), torch.float32)
    address = _base(large)
    del large
    _settle()
    smaller = pool.empty((2500,), torch.float32)
    assert _base(smaller) == address
    del smaller
    _settle()
    much_smaller = pool.empty((1000,), torch.float32)
    assert _base(much_smaller) != address
    assert len(pool) == 2


def test_idle_buffers_are_capped() -> None:
    pool = BufferPool(min_bytes=1024, max_idle=2)
    held = [pool.empty((1000 + 600 * i,), torch.float32) for i in range(6)]
    assert len(pool) == 6
    del held
    _settle()
    pool.empty((1000,), torch.float32)
    assert len(pool) <= 3
    for _ in range(5):
        pool.empty((1000,), torch.float32)
    assert len(pool) <= 3


def test_lent_buffers_are_never_dropped() -> None:
    pool = BufferPool(min_bytes=1024, max_idle=0)
    held = [pool.empty((1000,), torch.float32) for _ in range(4)]
    for position, tensor in enumerate(held):
        tensor.fill_(position)
    pool.empty((1000,), torch.float32)
    assert len(pool) >= 4
    assert all(torch.all(t == i) for i, t in enumerate(held))


def test_zero_sized_tensors() -> None:
    pool = BufferPool(min_bytes=0)
    empty = pool.empty((0, 3), torch.float32)
    assert empty.shape == (0, 3)


# -- the per-thread allocator --------------------------------------------------------------------


def test_batch_empty_without_an_allocator_is_a_plain_tensor() -> None:
    assert active_allocator() is None
    tensor = batch_empty((2, 3), torch.int16)
    assert tensor.shape == (2, 3)
    assert tensor.dtype == torch.int16


def test_using_allocator_installs_and_restores() -> None:
    outer, inner = BufferPool(min_bytes=1), BufferPool(min_bytes=1)
    with using_allocator(outer):
        assert active_allocator() is outer
        batch_empty((4,), torch.float32)
        with using_allocator(inner):
            assert active_allocator() is inner
            batch_empty((4,), torch.float32)
        assert active_allocator() is outer
        with using_allocator(None):
            assert active_allocator() is None
    assert active_allocator() is None
    assert len(outer) == 1
    assert len(inner) == 1


def test_using_allocator_restores_after_an_exception() -> None:
    pool = BufferPool()
    with pytest.raises(RuntimeError, match="boom"), using_allocator(pool):
        raise RuntimeError("boom")
    assert active_allocator() is None


@pytest.mark.timeout(30)
def test_the_allocator_is_per_thread() -> None:
    pool = BufferPool()
    seen: list[Any] = []
    with using_allocator(pool):
        thread = threading.Thread(target=lambda: seen.append(active_allocator()))
        thread.start()
        thread.join(10)
    assert seen == [None]


@pytest.mark.timeout(30)
def test_concurrent_use_never_hands_out_live_memory() -> None:
    pool = BufferPool(min_bytes=1024, max_idle=3)
    errors: list[str] = []
    barrier = threading.Barrier(4)

    def work(worker: int) -> None:
        barrier.wait(10)
        kept: list[tuple[torch.Tensor, float]] = []
        for step in range(150):
            value = float(worker * 1000 + step)
            tensor = pool.empty((512 + 64 * (step % 5),), torch.float32)
            tensor.fill_(value)
            kept.append((tensor, value))
            if len(kept) > 3:
                kept.pop(0)
            for held, held_value in kept:
                if not torch.all(held == held_value):
                    errors.append(f"worker {worker}: a live tensor was overwritten at {step}")
                    return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
