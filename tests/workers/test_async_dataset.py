"""Async map-style datasets (``async def __getitem__`` / ``__getitems__``,
``ferry._engine.work.aio``).

torch hands the coroutine objects to ``collate_fn``; ferry awaits them on an event loop of its
own, many at once. What must hold: the batches and order of the equivalent sync dataset under
torch's DataLoader, in every engine; the first failing key's error; ``on_error="skip"``'s
accounting; StopIteration ending the epoch; resume; the bound on reads in flight; and no
``ferry-aio`` thread left once the loader's workers (or the inline epoch) are done.
"""

from __future__ import annotations

import asyncio
import gc
import pickle
import threading
import time
import warnings
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import ferry
from _support.resume import assert_resumes_exactly
from ferry._engine.work.aio import IN_FLIGHT, AsyncReads, is_async_dataset
from ferry._engine.work.fetch import make_fetcher
from ferry._engine.work.reads import Failed, SampleReads
from ferry.collate import default_collate

LATENCY = 0.003
ENGINES = ("inline", "thread", "fork")


class Local(tud.Dataset[Any]):
    """Sample ``i`` is ``(i, i * i)``; keys in ``fail`` raise ``KeyError``, keys from ``stop``
    on raise ``StopIteration``. The sync twin of :class:`Remote`."""

    def __init__(
        self, n: int = 64, fail: frozenset[int] = frozenset(), stop: int | None = None
    ) -> None:
        self.n, self.fail, self.stop = n, fail, stop

    def __len__(self) -> int:
        return self.n

    def sample(self, index: int) -> Any:
        if index in self.fail:
            raise KeyError(f"sample {index} is missing")
        if self.stop is not None and index >= self.stop:
            raise StopIteration
        return (index, torch.tensor([index, index * index]))

    def __getitem__(self, index: int) -> Any:
        return self.sample(index)


class Remote(Local):
    """:class:`Local` read with ``async def``, after ``latency`` seconds; counts the reads in
    flight at once (``most``)."""

    def __init__(self, *args: Any, latency: float = LATENCY, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.latency = latency
        self.in_flight = self.most = 0

    async def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(self.latency)
            return self.sample(index)
        finally:
            self.in_flight -= 1


class RemoteMany(Local):
    """Batches in one ``async def __getitems__`` call (counted); no ``__getitem__`` of its own
    but the sync one (a batch is never read through it)."""

    calls = 0

    async def __getitems__(self, indices: list[int]) -> list[Any]:
        type(self).calls += 1
        await asyncio.sleep(LATENCY)
        return [self.sample(i) for i in indices]


def _engine(name: str) -> dict[str, Any]:
    if name == "inline":
        return {}
    if name == "thread":
        return {"num_workers": 2, "worker_type": "thread"}
    return {"num_workers": 2, "multiprocessing_context": name}


def _batches(loader: Any) -> list[Any]:
    return [[b[0].tolist(), b[1].tolist()] for b in loader]


def _aio_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ferry-aio"]


def _wait_no_aio(timeout: float = 5.0) -> list[threading.Thread]:
    deadline = time.monotonic() + timeout
    while (alive := _aio_alive()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return alive


# -- the batches of the sync twin under torch ---------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", [*ENGINES, "spawn"])  # (spawn: AsyncReads pickled)
def test_batches_and_order_are_torchs_for_the_sync_twin(engine: str) -> None:
    want = _batches(
        tud.DataLoader(
            Local(), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3)
        )
    )
    loader = ferry.DataLoader(
        Remote(),
        batch_size=8,
        shuffle=True,
        generator=torch.Generator().manual_seed(3),
        **_engine(engine),
    )
    assert _batches(loader) == want
    assert _wait_no_aio() == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_batching_off_and_async_getitems_are_awaited(engine: str) -> None:
    want = list(tud.DataLoader(Local(n=6), batch_size=None))
    got = list(ferry.DataLoader(Remote(n=6), batch_size=None, **_engine(engine)))
    assert [(i, t.tolist()) for i, t in got] == [(i, t.tolist()) for i, t in want]
    want = _batches(tud.DataLoader(Local(n=20), batch_size=8))
    RemoteMany.calls = 0
    assert _batches(ferry.DataLoader(RemoteMany(n=20), batch_size=8, **_engine(engine))) == want
    if engine != "fork":  # (a process worker counts in its own copy of the class)
        assert RemoteMany.calls == 3  # one awaited call per batch


@pytest.mark.timeout(60)
def test_wrappers_of_an_async_dataset_are_awaited_too() -> None:
    remote, local = Remote(n=12), Local(n=12)
    for wrap in (
        lambda d: ferry.Subset(d, [5, 3, 1, 0, 11]),
        lambda d: tud.Subset(d, [5, 3, 1, 0, 11]),
        lambda d: ferry.ConcatDataset([d, Local(n=4)]),
    ):
        assert is_async_dataset(wrap(remote))
        assert not is_async_dataset(wrap(local))
        want = _batches(tud.DataLoader(wrap(local), batch_size=4))
        assert _batches(ferry.DataLoader(wrap(remote), batch_size=4)) == want
        threads = ferry.DataLoader(wrap(remote), batch_size=4, num_workers=2, worker_type="thread")
        assert _batches(threads) == want


@pytest.mark.timeout(60)
def test_iterating_inside_a_running_event_loop_works() -> None:
    async def main() -> list[Any]:
        return _batches(ferry.DataLoader(Remote(n=16), batch_size=8))

    assert asyncio.run(main()) == _batches(tud.DataLoader(Local(n=16), batch_size=8))


# -- concurrency ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_reads_go_at_once_up_to_the_bound() -> None:
    data = Remote(n=40, latency=0.02)
    loader = ferry.DataLoader(data, batch_size=20)
    started = time.perf_counter()
    assert len(list(loader)) == 2
    assert data.most == 20  # a whole batch in flight at once, not one read after another
    assert time.perf_counter() - started < 20 * 0.02  # (one after another: 40 x 20 ms)
    assert loader.stats().concurrency == 20
    data = Remote(n=2 * IN_FLIGHT, latency=0.02)
    assert len(list(ferry.DataLoader(data, batch_size=2 * IN_FLIGHT))) == 1
    assert data.most == IN_FLIGHT  # bounded


@pytest.mark.timeout(60)
def test_thread_workers_share_one_loop_and_its_bound() -> None:
    data = Remote(n=4 * IN_FLIGHT, latency=0.02)
    loader = ferry.DataLoader(data, batch_size=IN_FLIGHT, num_workers=2, worker_type="thread")
    assert len(list(loader)) == 4
    assert data.most == IN_FLIGHT  # two workers' batches together, within one bound
    assert _wait_no_aio() == []


# -- errors, skip, the end of an epoch -----------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("error::RuntimeWarning")  # (no "coroutine was never awaited")
@pytest.mark.parametrize("engine", ENGINES)
def test_a_failing_read_raises_the_first_failing_key(engine: str) -> None:
    data = Remote(fail=frozenset({21, 19}))  # both in batch 2 (keys 16..23)
    loader = ferry.DataLoader(data, batch_size=8, **_engine(engine))
    iterator = iter(loader)
    assert [next(iterator)[0].tolist() for _ in range(2)] == [list(range(8)), list(range(8, 16))]
    with pytest.raises(KeyError, match="sample 19 is missing"):
        next(iterator)
    if engine == "inline":  # the loader goes on after an error, as torch's does
        assert next(iterator)[0].tolist() == list(range(24, 32))
    del iterator, loader  # (the loader keeps its last inline iterator's track, and so it)
    gc.collect()
    assert _wait_no_aio() == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_skipped_reads_are_accounted_as_for_the_sync_twin(engine: str) -> None:
    fail = frozenset({3, 17, 18, 40, 41, 42, 43, 44, 45, 46, 47})  # (batch 5 fails whole)

    def run(loader: ferry.DataLoader[Any]) -> tuple[list[Any], int]:
        return _batches(loader), loader.stats().skipped

    want = run(ferry.DataLoader(Local(fail=fail), batch_size=8, on_error="skip"))
    kwargs = {"batch_size": 8, "on_error": "skip", **_engine(engine)}
    assert run(ferry.DataLoader(Remote(fail=fail), **kwargs)) == want
    assert run(ferry.DataLoader(RemoteMany(fail=fail), **kwargs)) == want
    assert want[1] == len(fail)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_stop_iteration_in_a_coroutine_ends_the_epoch_as_in_torch(engine: str) -> None:
    want = _batches(tud.DataLoader(Local(stop=20), batch_size=8))
    assert _batches(ferry.DataLoader(Remote(stop=20), batch_size=8, **_engine(engine))) == want
    assert _wait_no_aio() == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_resume_mid_epoch_is_exact(engine: str) -> None:
    def loader() -> ferry.DataLoader[Any]:
        return ferry.DataLoader(
            Remote(),
            batch_size=8,
            shuffle=True,
            generator=torch.Generator().manual_seed(9),
            **_engine(engine),
        )

    assert_resumes_exactly(lambda seed: loader(), at=2, round_trip=None)


# -- nothing left running -------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_inline_loop_stops_with_its_epoch_or_its_iterator() -> None:
    loader = ferry.DataLoader(Remote(n=32), batch_size=8)
    iterator = iter(loader)
    next(iterator)
    assert len(_aio_alive()) == 1
    list(iterator)  # the epoch ends: its loop stops
    assert _wait_no_aio() == []
    iterator = iter(loader)
    next(iterator)  # left mid-epoch: the loop stops when the iterator is collected
    del iterator, loader
    gc.collect()
    assert _wait_no_aio() == []


@pytest.mark.timeout(60)
def test_an_inline_iterator_dropped_mid_epoch_stops_its_loop_at_once() -> None:
    """The loader keeps its last iterator's track, so that ``loader.state_dict()`` answers
    after the iterator is gone; the track holds nothing of the iterator itself, so dropping
    the iterator frees it at once (no cyclic collection): its loop stops while the loader
    lives, and the loader's state still resumes where it stood."""
    loader = ferry.DataLoader(Remote(n=32), batch_size=8)
    iterator = iter(loader)
    next(iterator)
    next(iterator)
    gc.disable()
    try:
        del iterator
        assert _wait_no_aio() == []
    finally:
        gc.enable()
    resumed = ferry.DataLoader(Remote(n=32), batch_size=8)
    resumed.load_state_dict(loader.state_dict())
    assert [b[0].tolist() for b in resumed] == [b[0].tolist() for b in list(loader)[2:]]


@pytest.mark.timeout(60)
def test_persistent_thread_workers_keep_their_loop_until_the_loader_lets_go() -> None:
    loader = ferry.DataLoader(
        Remote(n=32), batch_size=8, num_workers=2, worker_type="thread", persistent_workers=True
    )
    for _ in range(2):
        assert len(list(loader)) == 4
    assert len(_aio_alive()) == 1
    loader._iterator = None
    assert _wait_no_aio() == []


@pytest.mark.timeout(60)
def test_a_sync_dataset_is_untouched() -> None:
    assert not is_async_dataset(Local())
    fetcher = make_fetcher(Local(), False, True, default_collate, False)
    assert fetcher.reads is None  # type: ignore[union-attr]
    loader = ferry.DataLoader(Local(n=32), batch_size=8, num_workers=2, worker_type="thread")
    iterator = iter(loader)
    next(iterator)
    assert isinstance(iterator._crew.group.reads, SampleReads)  # type: ignore[attr-defined]
    del iterator
    inline = iter(ferry.DataLoader(Local(n=32), batch_size=8))
    next(inline)
    assert inline._reads is None  # type: ignore[attr-defined]
    assert _aio_alive() == []


# -- AsyncReads alone -----------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_reads_collect_each_failure_in_its_place_and_pickle_unstarted() -> None:
    reads = AsyncReads(limit=4)
    try:
        data = Remote(n=8, latency=0.0, fail=frozenset({2, 5}))
        results = reads.read(data, list(range(8)), collect=True)
        assert [r.error.args[0] if isinstance(r, Failed) else r[0] for r in results] == [
            0, 1, "sample 2 is missing", 3, 4, "sample 5 is missing", 6, 7,
        ]  # fmt: skip
        assert reads.peak_width == 4
        copy = pickle.loads(pickle.dumps(reads))
        assert copy.limit == 4
        assert copy._loop is None
    finally:
        reads.close()
    with pytest.raises(RuntimeError, match="shut down"):
        reads.read(data, [0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gc.collect()
    assert _wait_no_aio() == []
