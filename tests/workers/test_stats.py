"""``loader.stats()``: per-stage figures that add up, for every engine.

No timing is asserted against a threshold of speed: the checks are that the figures are
consistent (stage times within the wall time, counts equal to batches) and that a stage made
deliberately slow shows up in that stage.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch

import ferry
from _support.processes import FAST, Kind
from ferry.stats import LoaderStats

ENGINES = ("inline", *FAST)


class SlowFetch(ferry.Dataset[torch.Tensor]):
    """Each sample takes ``delay`` seconds to fetch."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.delay)
        return torch.full((64,), index)


# Well above what a trivial fetch of a batch costs on a loaded machine (tens of ms, seen in CI):
# the stage the time lands in must not depend on the machine's load.
COLLATE_S = 0.05


def slow_collate(samples: list[torch.Tensor]) -> torch.Tensor:
    time.sleep(COLLATE_S)
    return torch.stack(samples)


class Stream(ferry.IterableDataset[torch.Tensor]):
    def __iter__(self) -> Any:
        info = ferry.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return (torch.full((8,), i) for i in range(start, 40, step))


def options(engine: str) -> dict[str, Any]:
    if engine == "inline":
        return {"num_workers": 0}
    return {"num_workers": 2, **Kind(engine).kwargs}


def consistent(stats: LoaderStats, batches: int, *, ended: bool = True) -> None:
    """Figures that must hold; ``ended``: the epoch is over (every batch made was delivered)."""
    assert stats.batches == batches
    assert stats.ready + stats.waited == batches
    for stage in ("sampler", "fetch", "collate", "hand_off", "wait", "pin"):
        assert getattr(stats, f"{stage}_s") >= 0
    # What the training loop's thread does is within the wall time.
    assert stats.wait_s + stats.pin_s <= stats.wall_s
    if stats.engine == "inline":
        assert stats.workers == ()
        assert stats.fetch_s + stats.collate_s + stats.sampler_s <= stats.wall_s
        assert stats.hand_off_bytes == 0
    else:
        made = sum(w.batches for w in stats.workers)
        # Workers make batches ahead of the loop (prefetch_factor 2 per worker).
        assert made == batches if ended else batches <= made <= batches + 2 * len(stats.workers)
        for worker in stats.workers:
            assert 0 <= worker.busy_fraction <= 1
            assert worker.busy_s <= stats.wall_s
        assert stats.fetch_s + stats.collate_s <= stats.wall_s * len(stats.workers)
    if stats.engine == "thread":
        assert stats.hand_off_bytes == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_figures_add_up(engine: str) -> None:
    loader = ferry.DataLoader(SlowFetch(48, 0.002), batch_size=4, **options(engine))
    for _ in loader:
        pass
    stats = loader.stats()
    consistent(stats, 12)
    # 48 fetches of 2 ms each: the fetch stage holds them (thread workers read the samples of
    # a batch at once when they wait, ferry._engine.work.reads: at least one read per batch).
    reads = 12 if stats.engine == "thread" else 48
    assert stats.fetch_s >= reads * 0.002
    assert stats.engine == (
        "inline" if engine == "inline" else Kind(engine).kwargs.get("worker_type", "process")
    )
    if engine == "fork":
        assert stats.hand_off_bytes >= 48 * 64 * 8  # the tensors' bytes crossed over


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_slow_collate_is_collate(engine: str) -> None:
    loader = ferry.DataLoader(
        SlowFetch(16, 0.0), batch_size=4, collate_fn=slow_collate, **options(engine)
    )
    assert len(list(loader)) == 4
    stats = loader.stats()
    consistent(stats, 4)
    assert stats.collate_s >= 4 * COLLATE_S
    assert stats.collate_s > stats.fetch_s


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_stream(engine: str) -> None:
    loader = ferry.DataLoader(Stream(), batch_size=5, **options(engine))
    batches = list(loader)
    consistent(loader.stats(), len(batches))


class Counted(ferry.Dataset[torch.Tensor]):
    """Counts each sample's fetches in ``counts``, a tensor in shared memory: the test sees what
    process workers fetched."""

    def __init__(self, counts: torch.Tensor) -> None:
        self.counts = counts

    def __len__(self) -> int:
        return len(self.counts)

    def __getitem__(self, index: int) -> torch.Tensor:
        self.counts[index] += 1
        return torch.full((64,), index)


# After the workers fetched a batch, what its hand-off (collate, send, the main process's
# receipt) may take on a machine loaded 4 times over: a few milliseconds unloaded.
HAND_OFF_MARGIN_S = 0.03


def slower_than_the_loader(counts: torch.Tensor, position: int, epoch: int) -> None:
    """A training step over batch ``position`` (batches of 2 samples, ``counts`` from
    :class:`Counted`) that ends only once the workers have fetched the next two batches, and
    their hand-off had time to end."""
    coming = counts[2 * position + 2 : 2 * position + 6]
    deadline = time.monotonic() + 10.0
    while len(coming) and int(coming.min()) <= epoch:
        assert time.monotonic() < deadline, f"the workers fetched {counts.tolist()}"
        time.sleep(0.001)
    time.sleep(HAND_OFF_MARGIN_S)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", FAST)
def test_slow_training_loop_finds_batches_ready(engine: str) -> None:
    """A loop slower than the loader finds its batches waiting: the loader is ahead. The loop
    is slower by construction, not by a guess at how fast the workers run: each step waits
    until the workers have fetched the next two batches, then for their hand-off, so a loaded
    machine, which slows the workers too, cannot turn the verdict. (The second epoch of
    persistent workers: the first one's wait for the workers to start could be a tenth of so
    short an epoch.)"""
    counts = torch.zeros(32, dtype=torch.int32).share_memory_()
    loader = ferry.DataLoader(
        Counted(counts), batch_size=2, persistent_workers=True, **options(engine)
    )
    try:
        for epoch in range(2):
            for position, _ in enumerate(loader):
                slower_than_the_loader(counts, position, epoch)
        stats = loader.stats()
    finally:
        loader._iterator = None  # the persistent workers stop now, whether it passed or not
    consistent(stats, 16)
    assert stats.ready > stats.waited, stats
    assert stats.bottleneck == "training loop", stats


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", FAST)
def test_start_up_is_its_own_figure(engine: str) -> None:
    """The wait for the first batch (workers starting) is reported apart and left out of the
    bottleneck: a short epoch behind a slow loop is not 'loader-bound' for its start-up."""
    counts = torch.zeros(32, dtype=torch.int32).share_memory_()
    loader = ferry.DataLoader(Counted(counts), batch_size=2, **options(engine))
    time.sleep(0.05)  # iter() is not called yet: this is not in the epoch
    iterator = iter(loader)
    time.sleep(0.05)  # between iter() and the first next(): start-up, not waited
    for position, _ in enumerate(iterator):
        slower_than_the_loader(counts, position, 0)  # (a loaded machine cannot turn the verdict)
    stats = loader.stats()
    assert 0 < stats.first_wait_s < stats.first_batch_s, stats
    assert stats.first_batch_s >= 0.05, stats
    assert stats.bottleneck == "training loop", stats
    plain = stats.as_dict()
    assert plain["first_batch_s"] == stats.first_batch_s
    assert plain["first_wait_s"] == stats.first_wait_s


@pytest.mark.timeout(60)
def test_slow_loader_is_the_bottleneck() -> None:
    loader = ferry.DataLoader(SlowFetch(16, 0.005), batch_size=2, num_workers=1)
    assert len(list(loader)) == 8
    stats = loader.stats()
    assert stats.bottleneck == "loader"
    assert "the bottleneck is the loader" in str(stats)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", FAST)
def test_workers_finishing_together_are_still_the_bottleneck(engine: str) -> None:
    """Two workers hand in their batches together: the loop finds every other batch ready, yet
    it waits nearly all the time. The bottleneck is judged by that time, not by the counts."""
    loader = ferry.DataLoader(SlowFetch(24, 0.02), batch_size=2, **options(engine))
    assert len(list(loader)) == 12
    stats = loader.stats()
    assert stats.wait_share > 0.5, stats
    assert stats.bottleneck == "loader"
    assert stats.as_dict()["wait_share"] == stats.wait_share
    assert f"the loop waited {100 * stats.wait_share:.0f}% of the time" in str(stats)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", FAST)
def test_mid_epoch_then_next_epoch(engine: str) -> None:
    """stats() answers mid-epoch (the epoch so far), and each epoch starts from zero."""
    loader = ferry.DataLoader(
        SlowFetch(20, 0.0), batch_size=2, persistent_workers=True, **options(engine)
    )
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    consistent(loader.stats(), 3, ended=False)
    for _ in iterator:
        pass
    consistent(loader.stats(), 10)
    assert len(list(loader)) == 10
    consistent(loader.stats(), 10)


@pytest.mark.timeout(60)
def test_before_any_epoch_and_plain_data() -> None:
    loader = ferry.DataLoader(SlowFetch(4, 0.0), batch_size=2)
    empty = loader.stats()
    assert empty.batches == 0
    assert empty.bottleneck == "unknown"
    list(loader)
    plain = loader.stats().as_dict()
    assert json.loads(json.dumps(plain)) == plain
    assert set(plain["stages_s"]) == {"sampler", "fetch", "collate", "hand_off", "wait", "pin"}
    assert plain["batches"] == 2
    table = str(loader.stats())
    for stage in plain["stages_s"]:
        assert stage in table
