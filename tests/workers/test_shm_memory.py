"""Shared memory a loader holds for its batches stays bounded and goes back to the system.

* Slabs larger than ``shm.REUSE_LIMIT`` carry one batch: the worker lets go of each once it is
  sent, and the main process unmaps it the moment the batch is dropped (torch's behaviour).
* Smaller slabs are kept for reuse, but a worker gets back only what its tasks can use: after
  the loop drops many held batches, the surplus is retired (closed in the worker, unmapped in
  the main process), and so are slabs too small for batches that grew.
* Once no task is left to send (``Channel.no_more_tasks``), freed slabs are retired.
* ``Channel.held_bytes()`` says how much shared memory the loader maps now.

Slabs a worker maps are read from its ``/proc/<pid>/maps`` (memfd names ``ferry-slab-<id>``),
leaving out those it inherited from this process when it was forked (earlier tests' slabs).
"""

from __future__ import annotations

import gc
import io
import mmap
import os
import pickle
import re
import struct
import threading
from typing import Any

import pytest
import torch

import ferry
from _support import datasets as ds
from _support.processes import poll
from ferry._engine.transport import shm
from ferry._engine.transport.messages import NewSlab

pytestmark = pytest.mark.skipif(not shm.SLABS_SUPPORTED, reason="no memfd_create on this platform")

FORK = {"multiprocessing_context": "fork"}
MIB = 1 << 20
_SLAB = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ (\d+) +/memfd:ferry-slab-")


def slab_files(pid: int) -> dict[int, int]:
    """Inode -> mapped bytes of the slab files process ``pid`` maps now."""
    found: dict[int, int] = {}
    with open(f"/proc/{pid}/maps", encoding="ascii") as maps:
        for line in maps:
            match = _SLAB.match(line)
            if match:
                start, end, inode = int(match[1], 16), int(match[2], 16), int(match[3])
                found[inode] = found.get(inode, 0) + end - start
    return found


class Workers:
    """The slabs the workers of ``iterator`` map, apart from those inherited at fork."""

    def __init__(self) -> None:
        self.inherited = set(slab_files(os.getpid()))

    def slabs(self, iterator: Any) -> list[dict[int, int]]:
        return [
            {k: v for k, v in slab_files(w.pid).items() if k not in self.inherited}
            for w in iterator._workers
        ]


def held(iterator: Any) -> int:
    return int(iterator._crew.channel.held_bytes())


class Growing:
    """Map-style: samples of ``small`` float32 values below index ``at``, ``large`` from it."""

    def __init__(self, n: int, at: int, small: int, large: int) -> None:
        self.n, self.at, self.small, self.large = n, at, small, large

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((self.small if index < self.at else self.large,), float(index))


@pytest.mark.timeout(60)
def test_large_batches_are_let_go_of_when_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the reuse limit, no slab outlives its batch: the worker keeps none once it has
    sent it, and the main process's mapping goes when the user drops the batch."""
    monkeypatch.setattr(shm, "REUSE_LIMIT", 1 * MIB)  # (fork: the workers see it too)
    sample = (1 << 19,)  # 2 MiB of float32: batches of 4 MiB
    loader = ferry.DataLoader(ds.Blocks(40, sample), batch_size=2, num_workers=2, **FORK)
    seen = Workers()
    iterator = iter(loader)
    kept = [next(iterator) for _ in range(5)]
    # Each worker maps at most the slab of the batch it is making.
    assert poll(lambda: all(len(w) <= 1 for w in seen.slabs(iterator)), 10.0)
    before = held(iterator)
    assert before >= 5 * 4 * MIB, before
    del kept
    gc.collect()
    assert held(iterator) <= before - 5 * 4 * MIB, (held(iterator), before)
    for count, batch in enumerate(iterator, start=5):
        assert int(batch[0, 0]) == 2 * count
        assert held(iterator) <= 6 * 4 * MIB  # in flight (2 x 2), the batch held, the next


@pytest.mark.timeout(60)
def test_slabs_a_worker_cannot_use_are_retired() -> None:
    """30 batches held, then dropped: each worker gets back only what its tasks can use; the
    rest are closed in the worker and unmapped here."""
    prefetch = 2
    loader = ferry.DataLoader(
        ds.Blocks(160, (1 << 16,)), batch_size=2, num_workers=2, prefetch_factor=prefetch, **FORK
    )
    seen = Workers()
    iterator = iter(loader)
    kept = [next(iterator) for _ in range(30)]
    most = max(len(w) for w in seen.slabs(iterator))
    assert most >= 10, most  # each batch held took a slab of its own
    before = held(iterator)
    del kept
    gc.collect()
    for _ in range(10):
        next(iterator)
    bound = prefetch + 3  # in flight, the batch held, and those not told free yet
    for worker in iterator._workers:
        assert len(worker.slabs._maps) <= bound, (worker.worker_id, len(worker.slabs._maps))
    assert poll(lambda: all(len(w) <= bound for w in seen.slabs(iterator)), 10.0), seen.slabs(
        iterator
    )
    assert held(iterator) < before / 2, (held(iterator), before)
    assert len(list(iterator)) == 40


@pytest.mark.timeout(60)
def test_slabs_too_small_for_grown_batches_are_retired() -> None:
    """Batches grow fourfold at batch 20: the slabs made for the small ones are retired as they
    come free, in the worker and here."""
    small, large = 1 << 18, 1 << 20  # float32: batches of 2 MiB, then 8 MiB
    loader = ferry.DataLoader(Growing(120, 40, small, large), batch_size=2, num_workers=2, **FORK)
    seen = Workers()
    iterator = iter(loader)
    for count in range(20):
        assert next(iterator).shape == (2, small), count
    for count in range(20, 40):
        assert next(iterator).shape == (2, large), count
    for worker in iterator._workers:
        sizes = sorted(worker.slabs._sizes.values())
        assert sizes, worker.worker_id
        assert sizes[0] >= 8 * MIB, (worker.worker_id, sizes)
    assert poll(lambda: all(min(w.values()) >= 8 * MIB for w in seen.slabs(iterator)), 10.0), (
        seen.slabs(iterator)
    )
    assert len(list(iterator)) == 20


@pytest.mark.timeout(60)
def test_no_more_tasks_retires_what_is_freed() -> None:
    """When the iterator has no task left to send, freed slabs are not kept for tasks that
    will not come: closed in the workers, unmapped here; the batch still held stays."""
    loader = ferry.DataLoader(ds.Blocks(24, (1 << 16,)), batch_size=2, num_workers=2, **FORK)
    seen = Workers()
    iterator = iter(loader)
    for _ in range(12):
        last = next(iterator)
    iterator._crew.channel.no_more_tasks()
    # Only the slab under the batch still held (1 MiB, the smallest slab) stays mapped.
    assert held(iterator) == 1 * MIB, held(iterator)
    assert poll(lambda: sum(map(len, seen.slabs(iterator))) <= 1, 10.0), seen.slabs(iterator)
    assert int(last[1, 0]) == 23
    with pytest.raises(StopIteration):
        next(iterator)


@pytest.mark.timeout(60)
def test_a_worker_with_nothing_left_keeps_no_freed_slab() -> None:
    """At the end of an epoch, a worker that will get no more tasks holds no slab whose batch
    the loop has dropped (its memory goes back before the epoch ends)."""
    loader = ferry.DataLoader(ds.Blocks(24, (1 << 16,)), batch_size=2, num_workers=2, **FORK)
    seen = Workers()
    iterator = iter(loader)
    for _ in range(11):
        next(iterator)
    last = next(iterator)  # the 12th and last: the 11th is dropped now
    iterator._crew.channel.receive(0.0, [0, 0])
    drained = poll(lambda: sum(map(len, seen.slabs(iterator))) <= 1, 5.0)
    assert list(iterator) == []  # (the workers stop before the test fails, if it does)
    assert drained, seen.slabs(iterator)
    del last


@pytest.mark.timeout(60)
def test_held_bytes_follow_the_batches() -> None:
    """held_bytes() counts every slab mapped here: kept for reuse, or under batches the user
    holds, also after the workers are gone; nothing once the batches are dropped too."""
    loader = ferry.DataLoader(ds.Blocks(40, (1 << 16,)), batch_size=2, num_workers=2, **FORK)
    iterator = iter(loader)
    kept = [next(iterator) for _ in range(8)]
    assert held(iterator) >= 8 * MIB
    for worker in iterator._workers:
        assert worker.slabs.held_bytes() == sum(worker.slabs._sizes.values())
    maps = [worker.slabs for worker in iterator._workers]
    rest = list(iterator)  # the workers stop at the end of the epoch
    assert len(rest) == 12
    del iterator
    gc.collect()
    assert sum(m.held_bytes() for m in maps) >= 20 * MIB  # 20 batches held, 1 MiB slabs
    del kept, rest
    gc.collect()
    assert sum(m.held_bytes() for m in maps) == 0


# -- the parts, without processes -----------------------------------------------------------------


class _Mapping:
    """Stands in for a mapped slab (weak-referenceable, as the ctypes buffers are)."""


def _maps_with(sizes: list[int]) -> shm.SlabMaps:
    maps = shm.SlabMaps()
    for slab_id, size in enumerate(sizes):
        maps._keep(NewSlab(slab_id, size), _Mapping())
    return maps


@pytest.mark.timeout(10)
def test_a_worker_gets_back_at_most_what_its_tasks_can_use() -> None:
    maps = _maps_with([MIB] * 6)
    maps.sent()
    maps.sent()  # it has held two tasks at once (prefetch_factor=2)
    maps.release((0, 1, 2, 3, 4, 5))
    given = maps.take_freed()
    assert len(given) == 2, given
    retired = maps.take_retired()
    assert sorted(given + retired) == [0, 1, 2, 3, 4, 5]
    assert sorted(maps._maps) == sorted(given)
    assert maps.take_retired() == ()


@pytest.mark.timeout(10)
def test_slabs_too_small_for_recent_batches_are_retired() -> None:
    maps = _maps_with([MIB, 4 * MIB, 8 * MIB])
    maps.sent()
    maps.sent()
    maps._recent.append(3 * MIB)
    maps.release((0, 1, 2))
    assert maps.take_freed() == (1, 2)  # smallest fitting first
    assert maps.take_retired() == (0,)


@pytest.mark.timeout(10)
def test_one_batch_slabs_are_unmapped_when_released() -> None:
    maps = shm.SlabMaps()
    maps._keep(NewSlab(0, 8 * MIB, reuse=False), _Mapping())
    maps._keep(NewSlab(1, MIB), _Mapping())
    assert maps.held_bytes() == 9 * MIB
    maps.release((0, 1))
    gc.collect()
    assert 0 not in maps._maps
    assert 1 in maps._maps
    assert maps.held_bytes() == MIB
    maps.drain()  # no task in flight: what the worker was given back goes too
    assert maps.take_retired() == (1,)
    gc.collect()
    assert maps.held_bytes() == 0


@pytest.mark.timeout(10)
def test_worker_side_one_batch_slabs_and_retirement(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "REUSE_LIMIT", 2 * MIB)
    allocator = shm.SlabAllocator(os.getpid())
    try:
        for nbytes in (2 * MIB, 3 * MIB):
            allocator.begin(())
            allocator.empty((nbytes,), torch.uint8)
            used = allocator.finish()
            assert len(used) == 1
            allocator.handed_off(used)
        # The 3 MiB slab carried one batch and was let go of once handed off.
        assert [slab.size for slab in allocator.slabs.values()] == [2 * MIB]
        allocator.retire(tuple(allocator.slabs))
        assert allocator.slabs == {}
    finally:
        allocator.close()


# -- persistent workers --------------------------------------------------------------------------


class _Stored:
    """Map-style: views of four 1 MiB tensors made before the workers start (a sample
    allocates nothing: the workers' page faults are the loader's)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.data = torch.arange(4 << 18, dtype=torch.float32).view(4, 1 << 18)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index % 4]


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[7])


@pytest.mark.timeout(60)
def test_persistent_workers_keep_their_slabs_from_epoch_to_epoch() -> None:
    """A steady epoch of persistent workers makes, maps and retires no slab, and faults in no
    batch's pages: the slabs of the epoch before are given back with Resume. (When they were
    retired at every epoch's end, they were made again each epoch, 2,350 faults per 9.6 MB slab
    in the worker, and the epoch took 60-80% longer.) Counts, not seconds."""
    loader = ferry.DataLoader(
        _Stored(64), batch_size=4, num_workers=2, persistent_workers=True, **FORK
    )
    seen = Workers()
    for _ in range(2):  # the first epoch makes the slabs, the second settles who holds which
        for batch in loader:
            assert batch.shape == (4, 1 << 18)
    iterator = loader._iterator
    pids = [w.pid for w in iterator._workers]
    mapped = [set(w.slabs._maps) for w in iterator._workers]
    files = seen.slabs(iterator)
    assert all(files), files
    for epoch in range(3):
        faults = [_minor_faults(pid) for pid in pids]
        for batch in loader:
            assert batch.shape == (4, 1 << 18)
        assert [w.pid for w in iterator._workers] == pids
        assert [set(w.slabs._maps) for w in iterator._workers] == mapped, epoch
        assert seen.slabs(iterator) == files, epoch
        # A new 4 MiB slab is 1,024 faults in its worker alone; an epoch without one: a few.
        grown = [_minor_faults(pid) - before for pid, before in zip(pids, faults, strict=True)]
        assert max(grown) < 256, (epoch, grown)
    del batch, iterator


# -- decoding a batch: its tensors over the slabs, each slab lent until its last tensor goes ------


class _Refs(pickle.Pickler):
    """Pickles a batch as a worker does: each tensor of ``at`` by reference to its place."""

    def __init__(self, file: io.BytesIO, at: dict[int, tuple[int, int]]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.at = at

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and id(obj) in self.at:
            slab_id, offset = self.at[id(obj)]
            return ("ferry-slab", slab_id, offset, obj.dtype, tuple(obj.shape), obj.stride())
        return None


def _slab_maps(*sizes: int) -> tuple[shm.SlabMaps, list[mmap.mmap]]:
    maps, mappings = shm.SlabMaps(), [mmap.mmap(-1, size) for size in sizes]
    for slab_id, mapping in enumerate(mappings):
        maps._keep(NewSlab(slab_id, len(mapping)), mapping)
    return maps, mappings


def _place(mapping: mmap.mmap, offset: int, tensor: torch.Tensor) -> None:
    data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    mapping[offset : offset + len(data)] = data


@pytest.mark.timeout(10)
def test_a_batch_decodes_to_tensors_over_its_slabs_each_lent_until_its_last_tensor_goes() -> None:
    maps, mappings = _slab_maps(4096, 4096, 4096)
    first = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    second = torch.tensor([True, False, True])
    third = torch.arange(6, dtype=torch.int64).reshape(2, 3).t()  # not contiguous
    _place(mappings[0], 0, first)
    _place(mappings[0], 64, second)
    _place(mappings[1], 128, third.t())  # (its storage, as the worker's slab holds it)
    at = {id(first): (0, 0), id(second): (0, 64), id(third): (1, 128)}
    payload = io.BytesIO()
    _Refs(payload, at).dump({"a": first, "b": [second, first], "c": third, "n": 7})
    # Slab 2 is listed with the batch but holds none of its tensors: freed at once.
    batch = maps.decode(payload.getvalue(), (0, 1, 2))
    assert torch.equal(batch["a"], first)
    assert batch["b"][1] is batch["a"]
    assert torch.equal(batch["b"][0], second)
    assert batch["b"][0].dtype == torch.bool
    assert torch.equal(batch["c"], third)
    assert batch["c"].stride() == third.stride()
    assert batch["n"] == 7
    assert sorted(maps._lent) == [0, 1]
    assert maps._freed == [2]
    assert maps._recent[-1] == 48 + 3 + 48  # the bytes the tensors span
    batch["a"][0, 0] = 100.0  # over the slab: no copy was made
    assert struct.unpack_from("f", mappings[0], 0) == (100.0,)

    a, b, c = batch["a"], batch["b"][0], batch["c"]
    del batch
    gc.collect()
    assert sorted(maps._lent) == [0, 1]  # every one is still held
    del a
    assert 0 in maps._lent  # slab 0 still holds b
    holder = [b]
    del b

    def drop() -> None:
        holder.clear()  # the last tensor over slab 0 goes in another thread

    done = threading.Thread(target=drop)
    done.start()
    done.join(5)
    assert sorted(maps._freed) == [0, 2]
    assert sorted(maps._lent) == [1]
    del c
    assert sorted(maps._freed) == [0, 1, 2]
    assert not maps._lent


@pytest.mark.timeout(10)
def test_a_batch_without_slabs_is_plain_pickle() -> None:
    maps, _ = _slab_maps(4096)
    assert maps.decode(pickle.dumps([1, torch.ones(2)]), ())[0] == 1
    assert not maps._lent
    assert not maps._freed


@pytest.mark.timeout(10)
def test_a_one_batch_slab_is_unmapped_when_its_last_tensor_goes() -> None:
    maps = shm.SlabMaps()
    mapping = mmap.mmap(-1, 8192)
    maps._keep(NewSlab(0, 8192, reuse=False), mapping)
    tensor = torch.arange(4, dtype=torch.int32)
    _place(mapping, 0, tensor)
    payload = io.BytesIO()
    _Refs(payload, {id(tensor): (0, 0)}).dump(tensor)
    del mapping
    got = maps.decode(payload.getvalue(), (0,))
    assert torch.equal(got, tensor)
    assert maps.held_bytes() == 8192
    del got
    gc.collect()
    assert not maps._maps
    assert not maps._freed
    assert maps.held_bytes() == 0
