"""SharedList: a list's behaviour (indexing, iteration, pickling), the same batches as a plain
list through process workers (fork and spawn), and the reason it exists: forked workers that
read every item of a plain list grow by about the size of its objects (copy-on-write of
reference counts), workers reading a SharedList do not."""

from __future__ import annotations

import copy
import mmap
import os
import pickle
import sys
import types
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import ferry
from ferry import SharedList, shared_list

pytestmark = pytest.mark.usefixtures("guard_global_state")

ITEMS: list[Any] = [
    "a",
    "",
    "ünïcödé",
    0,
    -(2**70),
    3.5,
    None,
    True,
    b"\x00bytes",
    (1, "two", 3.0),
    [1, [2, [3]]],
    {"path": "/data/0.jpg", "label": 7},
    {1, 2},
    frozenset({"x"}),
]


# -- a list's behaviour ---------------------------------------------------------------------------


def test_items_decode_to_equal_objects() -> None:
    shared = SharedList(ITEMS)
    assert len(shared) == len(ITEMS)
    assert [shared[i] for i in range(len(ITEMS))] == ITEMS
    assert list(shared) == ITEMS
    assert [type(x) for x in shared] == [type(x) for x in ITEMS]


def test_negative_indices_and_index_types() -> None:
    shared = SharedList(range(10))
    assert shared[-1] == 9
    assert shared[-10] == 0
    assert shared[torch.tensor(3)] == 3  # anything with __index__
    assert shared[True] == 1


@pytest.mark.parametrize("index", [10, -11, 2**63])
def test_out_of_range_is_an_index_error(index: int) -> None:
    shared = SharedList(range(10))
    with pytest.raises(IndexError, match=f"SharedList index {index} is out of range .* length 10"):
        shared[index]


def test_non_integer_index_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="SharedList indices must be integers or slices, got str"):
        SharedList(range(3))["1"]  # type: ignore[call-overload]


def test_slices_give_lists() -> None:
    values = list(range(20))
    shared = SharedList(values)
    for piece in (slice(None), slice(3, 9), slice(None, None, -1), slice(-5, None, 2), slice(9, 3)):
        assert shared[piece] == values[piece]


def test_sequence_mixins() -> None:
    shared = SharedList(["x", "y", "x"])
    assert isinstance(shared, Sequence)
    assert "y" in shared
    assert "z" not in shared
    assert shared.index("y") == 1
    assert shared.count("x") == 2
    assert list(reversed(shared)) == ["x", "y", "x"]


def test_getitems_fetches_a_batch() -> None:
    shared = SharedList(ITEMS)
    assert shared.__getitems__([3, 0, -1, 3]) == [ITEMS[3], ITEMS[0], ITEMS[-1], ITEMS[3]]


def test_items_are_fresh_copies() -> None:
    shared = SharedList([{"a": [1]}])
    first = shared[0]
    first["a"].append(2)
    assert shared[0] == {"a": [1]}


def test_empty() -> None:
    shared: SharedList[Any] = SharedList([])
    assert len(shared) == 0
    assert list(shared) == []
    assert shared[:] == []
    with pytest.raises(IndexError):
        shared[0]
    assert len(pickle.loads(pickle.dumps(shared))) == 0


def test_any_iterable_read_once() -> None:
    assert list(SharedList(str(i) for i in range(5))) == ["0", "1", "2", "3", "4"]
    assert list(SharedList(iter({"k": 1}))) == ["k"]


def test_large_objects_and_many_items() -> None:
    big = [bytes([i]) * (3 << 20) for i in range(3)]  # each past the first capacity
    shared = SharedList([b"", *big, "tail"])
    assert shared[1] == big[0]
    assert shared[3] == big[2]
    assert shared[4] == "tail"
    assert shared.nbytes >= sum(map(len, big))
    many = SharedList(f"/data/{i}.jpg" for i in range(100_000))
    assert many[77_777] == "/data/77777.jpg"
    assert many[-1] == "/data/99999.jpg"


def test_builds_where_mappings_cannot_be_resized(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoResize(mmap.mmap):
        def resize(self, newsize: int) -> None:
            raise SystemError("mmap: resizing not available--no mremap()")

    monkeypatch.setattr(
        shared_list, "mmap", types.SimpleNamespace(mmap=NoResize, ACCESS_READ=mmap.ACCESS_READ)
    )
    values = [bytes([i]) * 50_000 for i in range(10)]  # past the first capacity several times
    assert list(SharedList(values)) == values


def test_items_that_cannot_be_pickled_are_named() -> None:
    with pytest.raises(TypeError, match=r"SharedList item 2 \(function\) cannot be pickled"):
        SharedList([1, 2, lambda: 3])
    with pytest.raises(TypeError, match=r"items must be an iterable, got int"):
        SharedList(5)  # type: ignore[arg-type]


def test_a_failed_build_closes_its_file() -> None:
    before = len(os.listdir("/proc/self/fd")) if sys.platform == "linux" else 0
    for _ in range(20):
        with pytest.raises(TypeError):
            SharedList([1, lambda: 0])
    if sys.platform == "linux":
        assert len(os.listdir("/proc/self/fd")) <= before + 1


@pytest.mark.skipif(sys.platform != "linux", reason="counts descriptors in /proc/self/fd")
def test_dropped_lists_release_their_files() -> None:
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        shared = SharedList(["x"] * 1000)
        pickle.loads(pickle.dumps(shared))
    del shared
    assert len(os.listdir("/proc/self/fd")) <= before + 1


def test_repr() -> None:
    assert repr(SharedList(["a", "b"])).startswith("SharedList(<2 items, ")


# -- pickling and copies --------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_round_trip(protocol: int) -> None:
    shared = SharedList(ITEMS)
    loaded = pickle.loads(pickle.dumps(shared, protocol=protocol))
    assert isinstance(loaded, SharedList)
    assert list(loaded) == ITEMS
    assert loaded.nbytes == shared.nbytes


def test_copies_share_the_buffer() -> None:
    shared = SharedList(ITEMS)
    assert copy.copy(shared) is shared
    assert copy.deepcopy({"k": shared})["k"] is shared


# -- through the DataLoader -----------------------------------------------------------------------


class Paths(ferry.Dataset[Any]):
    """A dataset of (path, label) records held in ``items`` (a list or a SharedList)."""

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        return self.items[index]


def _records(n: int) -> list[dict[str, Any]]:
    return [{"path": f"/data/{i:06d}.jpg", "label": i % 10} for i in range(n)]


def _collate_with_file(batch: list[Any]) -> tuple[Any, int | None]:
    """The batch, and the inode of the file behind the worker's SharedList (if it has one)."""
    info = ferry.get_worker_info()
    items = info.dataset.items if info is not None else None
    inode = os.fstat(items._fd).st_ino if isinstance(items, SharedList) else None
    return ferry.default_collate(batch), inode


def _batches(items: Sequence[Any], **options: Any) -> list[tuple[Any, int | None]]:
    loader: ferry.DataLoader[Any] = ferry.DataLoader(
        Paths(items),
        batch_size=7,
        shuffle=True,
        generator=torch.Generator().manual_seed(5),
        collate_fn=_collate_with_file,
        **options,
    )
    return list(loader)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver", "thread"])
def test_workers_give_the_batches_of_a_plain_list(context: str) -> None:
    records = _records(200)
    shared = SharedList(records)
    expected = _batches(records)
    if context == "thread":
        got = _batches(shared, num_workers=2, worker_type="thread")
    else:
        got = _batches(shared, num_workers=2, multiprocessing_context=context)
    assert len(got) == len(expected) == 29
    for (mine, _), (theirs, _) in zip(got, expected, strict=True):
        assert mine["path"] == theirs["path"]
        assert torch.equal(mine["label"], theirs["label"])
    # The workers read the main process's file: spawn and forkserver sent its descriptor, not
    # a copy of its bytes.
    assert {inode for _, inode in got} == {os.fstat(shared._fd).st_ino}


@pytest.mark.timeout(60)
def test_a_shared_list_is_a_dataset_itself() -> None:
    loader: ferry.DataLoader[Any] = ferry.DataLoader(
        SharedList(range(10)), batch_size=4, num_workers=2
    )
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


# -- the point: no copy-on-write growth in forked workers -----------------------------------------

_baseline_kb = 0


def _private_kb() -> int:
    """This process's private memory (USS), in KiB: pages no other process maps."""
    total = 0
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            key, _, value = line.partition(":")
            if key in ("Private_Clean", "Private_Dirty"):
                total += int(value.split()[0])
    return total


def _record_baseline(worker_id: int) -> None:
    global _baseline_kb
    _baseline_kb = _private_kb()


def _growth_after(batch: list[int]) -> tuple[int, int]:
    """Collate: the worker's pid and its private memory's growth since it started, in KiB."""
    return os.getpid(), _private_kb() - _baseline_kb


class Lengths(ferry.Dataset[int]):
    """Reads each item (as a dataset would) and keeps only its length."""

    def __init__(self, items: Sequence[str]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> int:
        return len(self.items[index])


def _worker_growth_mb(items: Sequence[str]) -> list[float]:
    """One shuffled epoch over ``items`` with 2 fork workers: each worker's final growth."""
    loader: ferry.DataLoader[Any] = ferry.DataLoader(
        Lengths(items),
        batch_size=2000,
        shuffle=True,
        num_workers=2,
        multiprocessing_context="fork",
        worker_init_fn=_record_baseline,
        collate_fn=_growth_after,
    )
    last: dict[int, int] = {}
    for pid, growth_kb in loader:
        last[pid] = growth_kb
    assert len(last) == 2
    return [kb / 1024 for kb in last.values()]


@pytest.mark.skipif(
    not os.path.exists("/proc/self/smaps_rollup"),
    reason="measures private memory from /proc/<pid>/smaps_rollup (Linux 4.14 and later)",
)
@pytest.mark.timeout(120)
def test_forked_workers_do_not_copy_a_shared_list() -> None:
    # ~500k strings of 30 characters: about 40 MB of str objects, on pages the workers inherit.
    paths = [f"/data/train/{i:08d}/image.jpg" for i in range(500_000)]
    with_list = _worker_growth_mb(paths)
    shared = SharedList(paths)
    with_shared = _worker_growth_mb(shared)
    # Every worker read every page of objects: each page was copied (the reference counts).
    assert min(with_list) >= 25, f"plain list: workers grew by {with_list} MB"
    assert max(with_shared) < 4, f"SharedList: workers grew by {with_shared} MB"
