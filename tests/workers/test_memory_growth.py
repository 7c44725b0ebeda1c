"""Copy-on-write growth of process workers, measured and acted on.

A forked worker that reads the items of a large list of Python objects copies the pages they
sit on (each read writes a reference count). The workers measure their own share of anonymous
memory (``ferry._core.memory``): ``stats()`` shows it and says what it is,
``num_workers="auto"`` moves to thread workers when the growth would exceed what the system has,
and the doctor advises threads (its rule is tested in ``test_doctor.py``).
"""

from __future__ import annotations

import itertools
import mmap
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import ferry
from ferry._core import memory
from ferry._core.memory import COPY_ON_WRITE, MemorySampler, anon_bytes, growth_verdict
from ferry._engine.tuning import switch
from ferry.stats import LoaderStats, StatsRecorder

linux = pytest.mark.skipif(
    not Path("/proc/self/smaps_rollup").exists(), reason="needs /proc/<pid>/smaps_rollup (Linux)"
)
MiB = 1 << 20
INTERVAL_S, COST_SHARE = memory.INTERVAL_S, memory.COST_SHARE  # the library's own pace


class Strings(tud.Dataset[int]):
    """``n`` distinct Python strings in a list: the dataset that copy-on-write grows. With
    ``walk_from``, each process's reads after its ``walk_from``-th also read ``WALK_STEP``
    items in turn, so a worker copies every item early in its epoch, whatever the order, a
    slice a batch (as a worker reading its samples copies them: page by page), and its
    measures see the growth."""

    def __init__(self, n: int, walk_from: int = 0) -> None:
        self.items = [f"sample-{i:012d}-{'x' * (150 + i % 7)}" for i in range(n)]
        self.walk_from = walk_from
        self.reads = 0  # (each worker process counts its own)
        self.walked = 0

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> int:
        self.reads += 1
        if self.walk_from and self.reads > self.walk_from and self.walked < len(self.items):
            sum(map(len, self.items[self.walked : self.walked + WALK_STEP]))
            self.walked += WALK_STEP
        return len(self.items[index])


# A worker's first batch of 256 is made before it copies anything; from its second batch on,
# each read copies WALK_STEP more items: 800,000 of them within the first 20,000 reads (80
# batches of a worker's 1,563).
WALK = 256
WALK_STEP = 40


# --- the measure and when it is taken -----------------------------------------------------------


def _rollup(tmp_path: Path, **fields: int) -> str:
    path = tmp_path / "smaps_rollup"
    lines = ["55846f823000-7ffc80097000 ---p 00000000 00:00 0   [rollup]"]
    lines += [f"{name}:{kib:>12} kB" for name, kib in fields.items()]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_the_measure_is_the_share_of_anonymous_memory(tmp_path: Path) -> None:
    path = _rollup(tmp_path, Rss=900, Pss=500, Pss_Anon=300, Private_Clean=8, Private_Dirty=100)
    assert anon_bytes(path) == 300 * 1024
    # An older kernel without Pss_Anon: the private pages stand in.
    older = _rollup(tmp_path, Rss=900, Pss=500, Private_Clean=8, Private_Dirty=100)
    assert anon_bytes(older) == 108 * 1024
    assert anon_bytes(str(tmp_path / "missing")) == -1


@linux
def test_this_process_has_a_measure() -> None:
    assert anon_bytes() > 0
    assert memory.resident_anon_bytes() > 0


def _faulting() -> Callable[[], int]:
    """A process's fault count that grows by :data:`memory.QUIET_FAULTS` at each look: its
    memory may have changed every time, so every read that is due is made."""
    count = itertools.count(0, memory.QUIET_FAULTS)
    return lambda: next(count)


def test_a_worker_measures_once_it_faulted_then_at_most_four_times_a_second() -> None:
    now = [0.0]
    reads: list[float] = []

    def read() -> int:
        reads.append(now[0])
        now[0] += 0.002  # a read takes 2 ms
        return 100

    sampler = MemorySampler(read, lambda: now[0], _faulting())
    assert sampler.after_batch() == -1  # the first batch: its fault count is noted
    assert sampler.after_batch() == 100  # QUIET_FAULTS faults since: the baseline
    now[0] += 0.2
    assert sampler.after_batch() == -1  # not a quarter of a second yet
    now[0] += 0.1
    assert sampler.after_batch() == 100
    now[0] += 0.2  # (past 100 times the last read's 2 ms)
    sampler.restart()  # a new epoch (persistent workers): its first batch is measured
    assert sampler.after_batch() == 100
    assert len(reads) == 3


def test_a_new_epoch_does_not_buy_a_read_beyond_the_share() -> None:
    """Persistent workers of short epochs: each epoch's first batch is measured only where
    the last read was long enough ago for the 1% share (measured: 5-7 ms a read, 50 ms
    epochs)."""
    now = [0.0]

    def read() -> int:
        now[0] += 0.006  # 6 ms a read: at most one every 0.6 s
        return 100

    sampler = MemorySampler(read, lambda: now[0], _faulting())
    assert sampler.after_batch() == -1
    assert sampler.after_batch() == 100
    for _ in range(10):  # 50 ms epochs
        now[0] += 0.05
        sampler.restart()
        assert sampler.after_batch() == -1
    now[0] += 0.1  # 0.606 s since the last read began
    sampler.restart()
    assert sampler.after_batch() == 100


def test_the_end_of_an_epoch_reads_the_workers_within_the_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The main process reads each worker's memory when the epoch ends only while those reads
    fit in 1% of the epoch (5-7 ms a worker, at every end of 50 ms epochs), and the cost it
    learnt holds for the process: a new iterator each epoch (workers that do not persist)
    does not make every end read again."""
    monkeypatch.setattr(switch._ReadCost, "seconds", 0.0)  # (as in a new process)
    now = [0.0]
    stats = StatsRecorder(1, clock=lambda: now[0])
    stats.worker_memory(0, 1)  # (measured this epoch: the worker is read at its end)
    pids: list[tuple[int, int | None]] = [(0, os.getpid())]  # (this process stands in)
    now[0] = 0.05
    switch.measure_at_end(stats, pids)  # no read made yet: its cost is not known, so it is read
    assert stats.memory_latest[0] > 1
    for _ in range(3):  # short epochs, each a new recorder as a new iterator's
        stats = StatsRecorder(1, clock=lambda: now[0])
        stats.worker_memory(0, 1)
        now[0] += 0.0001  # an epoch of 0.1 ms: under 100 times any read of smaps_rollup
        switch.measure_at_end(stats, pids)
        assert stats.memory_latest[0] == 1
    now[0] += 1000.0
    switch.measure_at_end(stats, pids)
    assert stats.memory_latest[0] > 1


@linux
def test_the_end_of_an_epoch_reads_only_the_workers_that_faulted_since(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker whose fault count (in /proc/<pid>/stat, microseconds to read) grew by fewer
    than QUIET_FAULTS since its latest figure was read keeps that figure: it cannot have
    grown. Only the others' smaps_rollup is read (milliseconds each)."""
    monkeypatch.setattr(switch._ReadCost, "seconds", 0.0)
    now = [0.0]
    stats = StatsRecorder(2, clock=lambda: now[0])
    pid = os.getpid()  # (this process stands in for both workers)
    stats.worker_memory(0, 1, memory.process_faults(pid))  # read just now
    stats.worker_memory(1, 1, memory.process_faults(pid) - memory.QUIET_FAULTS)  # long ago
    read: list[str] = []
    real = switch.read_side_by_side
    monkeypatch.setattr(
        switch, "read_side_by_side", lambda paths: read.extend(paths) or real(paths)
    )
    now[0] = 10.0
    switch.measure_at_end(stats, [(0, pid), (1, pid)])
    assert read == [f"/proc/{pid}/smaps_rollup"]
    assert stats.memory_latest[0] == 1  # its figure stands
    assert stats.memory_latest[1] > 1  # read, with the fault count it was read at
    assert stats.memory_faults[1] >= 0
    read.clear()
    switch.measure_at_end(stats, [(0, pid), (1, pid)])
    assert read == []  # neither faulted since


@pytest.mark.timeout(30)
def test_the_workers_memory_is_read_side_by_side() -> None:
    """Each path is read by one of up to 8 threads (this one among them); a path that gives
    nothing (a worker gone) reads -1; no reader is left behind."""
    own = "/proc/self/smaps_rollup"
    if anon_bytes(own) < 0:
        pytest.skip("needs /proc/<pid>/smaps_rollup (Linux)")
    before = threading.active_count()
    paths = [own] * 10 + ["/proc/0/smaps_rollup"]
    found = switch.read_side_by_side(paths)
    assert len(found) == 11
    assert all(value > 0 for value in found[:10])
    assert found[10] == -1
    assert threading.active_count() == before
    assert switch.read_side_by_side([]) == []


def test_a_slow_measure_is_taken_less_often() -> None:
    now = [0.0]

    def read() -> int:
        now[0] += 0.05  # 50 ms a read (a huge process): at most every 5 s (1% of the time)
        return 1

    sampler = MemorySampler(read, lambda: now[0], _faulting())
    assert sampler.after_batch() == -1
    assert sampler.after_batch() == 1
    now[0] += 2.0
    assert sampler.after_batch() == -1
    now[0] += 3.0
    assert sampler.after_batch() == 1


def test_no_measure_where_the_system_has_none() -> None:
    calls = []
    sampler = MemorySampler(lambda: calls.append(1) or -1, lambda: 10.0 * len(calls), _faulting())
    for _ in range(4):
        assert sampler.after_batch() == -1
    assert len(calls) == 1  # asked once (at the second batch), not again


def test_a_worker_that_faulted_in_no_pages_keeps_its_last_figure() -> None:
    """Memory becomes a process's own only through page faults, which the kernel counts: a
    read that is due is skipped, and its last figure stands, while the worker took fewer than
    QUIET_FAULTS faults since; past them, or after STALE_S, it is read again."""
    now, faults = [0.0], [1000]
    reads: list[float] = []

    def read() -> int:
        reads.append(now[0])
        faults[0] += 3  # (what reading it faults in does not count)
        return 100 + len(reads)

    sampler = MemorySampler(read, lambda: now[0], lambda: faults[0])
    assert sampler.after_batch() == -1  # the first batch
    faults[0] += memory.QUIET_FAULTS
    assert sampler.after_batch() == 101  # the first figure
    assert sampler.faults == 1003 + memory.QUIET_FAULTS
    now[0] += 0.3
    faults[0] += memory.QUIET_FAULTS - 1
    assert sampler.after_batch() == 101  # due, but nothing could have grown: the figure stands
    now[0] += 0.1
    assert sampler.after_batch() == -1  # (and it was due: the next is a quarter of a second on)
    now[0] += 0.2
    faults[0] += 1  # QUIET_FAULTS since the read
    assert sampler.after_batch() == 102
    assert len(reads) == 2
    sampler.restart()  # a new epoch: its baseline is the figure that stands
    now[0] += 0.3
    assert sampler.after_batch() == 102
    now[0] += memory.STALE_S  # not a fault since, but it is old: a huge page needs one fault
    assert sampler.after_batch() == 103
    assert len(reads) == 3


def test_a_worker_that_faults_in_no_pages_is_not_read_until_it_does_or_is_old() -> None:
    """A short epoch (a validation pass, a test's dozen batches) of workers that fault in a few
    pages a batch: no read at all (each one walked the page tables it inherited, 7-17 ms of a
    worker's CPU, for a first figure no second one followed). Persistent workers go on
    counting from their first batch; QUIET_FAULTS faults since it, or STALE_S, and the first
    figure is read."""
    now, faults = [0.0], [5000]
    reads: list[float] = []

    def read() -> int:
        reads.append(now[0])
        return 100

    def epoch(sampler: MemorySampler) -> list[int]:
        figures = []
        for _ in range(12):
            figures.append(sampler.after_batch())
            now[0] += 0.05
            faults[0] += 5
        return figures

    sampler = MemorySampler(read, lambda: now[0], lambda: faults[0])
    assert epoch(sampler) == [-1] * 12
    sampler.restart()  # the next epoch of persistent workers
    assert epoch(sampler) == [-1] * 12
    assert reads == []
    faults[0] = 5000 + memory.QUIET_FAULTS  # since the first batch of the first epoch
    assert sampler.after_batch() == 100
    assert len(reads) == 1

    old = MemorySampler(read, lambda: now[0], lambda: faults[0])
    assert old.after_batch() == -1
    now[0] += memory.STALE_S - 0.01
    assert old.after_batch() == -1
    now[0] += 0.01  # no fault since, but a huge page needs one: it is read
    assert old.after_batch() == 100
    assert len(reads) == 2


def test_a_worker_whose_faults_are_not_known_reads_whenever_due() -> None:
    now = [0.0]
    sampler = MemorySampler(lambda: 100, lambda: now[0], lambda: -1)
    reads = 0
    for _ in range(5):
        now[0] += 1.0
        reads += sampler.after_batch() == 100
    assert reads == 5
    assert sampler.faults == -1
    assert not memory.unchanged_since(-1, -1)
    assert not memory.unchanged_since(10, -1)
    assert not memory.unchanged_since(10, 9)  # (a count that went back: another process)


@linux
def test_a_process_fault_count_is_read_from_proc() -> None:
    before = memory.fault_count()
    touched = bytearray(64 << 20)  # 64 MiB made resident: thousands of faults (or huge pages)
    touched[:: 1 << 12] = b"x" * len(range(0, len(touched), 1 << 12))
    mine = memory.process_faults(os.getpid())
    assert before < mine <= memory.fault_count()
    assert not memory.unchanged_since(before, mine)
    assert memory.process_faults(0) == -1  # (no such process)


# --- when num_workers="auto" moves to threads ---------------------------------------------------


def test_growth_below_a_working_set_never_moves() -> None:
    assert growth_verdict(COPY_ON_WRITE - 1, 10, 10_000, 100 * MiB) == ""


def test_growth_is_projected_to_the_end_of_the_epoch_against_half_the_memory() -> None:
    # 100 MiB in 100 batches, 100 left: 200 MiB by the end.
    assert growth_verdict(100 * MiB, 100, 100, 401 * MiB) == ""
    why = growth_verdict(100 * MiB, 100, 100, 399 * MiB)
    assert "copied 100 MiB" in why
    assert "about 200 MiB" in why
    assert "399 MiB available" in why


def test_the_projection_stops_at_what_the_workers_can_copy() -> None:
    # Linear: 1,100 MiB; but each of 2 workers can copy at most the main process's 150 MiB.
    assert growth_verdict(100 * MiB, 100, 1000, 700 * MiB, ceiling=300 * MiB) == ""
    assert "about 300 MiB" in growth_verdict(100 * MiB, 100, 1000, 500 * MiB, 300 * MiB)


def test_no_move_without_the_memory_figure() -> None:
    assert growth_verdict(10_000 * MiB, 1, 10, None) == ""
    assert growth_verdict(10_000 * MiB, 0, 10, 1) == ""


# --- end to end -------------------------------------------------------------------------------


def _measure_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forked workers measure every 50 ms whatever a measure costs (a loaded machine makes
    each read of smaps_rollup slower, so the 1% rule would space them out past a short
    epoch): the test sees the growth within the epoch."""
    monkeypatch.setattr(memory, "INTERVAL_S", 0.05)
    monkeypatch.setattr(memory, "COST_SHARE", 1)


def _epoch(loader: ferry.DataLoader[Any]) -> tuple[list[list[int]], LoaderStats]:
    batches = [batch.tolist() for batch in loader]
    stats = loader.stats()
    assert stats is not None
    return batches, stats


@linux
@pytest.mark.timeout(120)
@pytest.mark.skipif(sys.platform != "linux", reason="needs fork (Linux)")
def test_stats_show_the_growth_of_workers_that_copy_the_dataset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _measure_often(monkeypatch)
    dataset = Strings(800_000, WALK)
    loader = ferry.DataLoader(
        dataset, batch_size=256, num_workers=2, multiprocessing_context="fork"
    )
    _, stats = _epoch(loader)
    assert all(w.memory_bytes > 0 for w in stats.workers)
    assert stats.memory_growth_bytes >= 2 * COPY_ON_WRITE, stats.memory_growth_bytes
    assert stats.copy_on_write
    text = str(stats)
    assert "workers' own memory" in text
    assert "copy-on-write" in text
    assert "worker_type='thread'" in text
    assert "ferry.SharedList" in text
    plain = stats.as_dict()
    assert plain["copy_on_write"] is True
    assert plain["memory_growth_bytes"] == stats.memory_growth_bytes


class Scratch(tud.Dataset[int]):
    """Each sample faults in a mebibyte of scratch memory of its own and gives it back: page
    faults (the workers are measured), but no copy of anything they share."""

    def __len__(self) -> int:
        return 1024

    def __getitem__(self, index: int) -> int:
        with mmap.mmap(-1, 1 << 20) as scratch:
            for offset in range(0, 1 << 20, 4096):
                scratch[offset] = 1
        return index


@linux
@pytest.mark.timeout(120)
def test_workers_that_read_no_shared_objects_show_no_copy_on_write() -> None:
    loader = ferry.DataLoader(Scratch(), batch_size=64, num_workers=2)
    _, stats = _epoch(loader)
    assert all(w.memory_bytes > 0 for w in stats.workers)  # measured ...
    assert not stats.copy_on_write  # ... and small
    assert "copy-on-write" not in str(stats)


@linux
@pytest.mark.timeout(120)
@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
def test_a_short_epoch_of_workers_that_fault_in_next_to_nothing_reads_no_memory(
    monkeypatch: pytest.MonkeyPatch, persistent: bool
) -> None:
    """Six batches a worker, each faulting in a few pages: the workers never read their
    memory (a first figure no second one would follow), so stats() shows none."""
    _measure_often(monkeypatch)  # (the time rules would allow a read at every batch)
    loader = ferry.DataLoader(range(96), batch_size=8, num_workers=2, persistent_workers=persistent)
    for _ in range(2 if persistent else 1):
        _, stats = _epoch(loader)
        assert [w.memory_bytes for w in stats.workers] == [-1, -1]
        assert stats.memory_growth_bytes == 0
        assert "workers' own memory" not in str(stats)


@pytest.mark.timeout(60)
def test_thread_workers_and_the_inline_loader_have_nothing_to_measure() -> None:
    for options in ({"num_workers": 2, "worker_type": "thread"}, {"num_workers": 0}):
        loader = ferry.DataLoader(range(256), batch_size=16, **options)
        _, stats = _epoch(loader)
        assert all(w.memory_bytes == -1 for w in stats.workers)
        assert stats.memory_growth_bytes == 0
        assert not stats.copy_on_write
        assert "workers' own memory" not in str(stats)


@linux
@pytest.mark.timeout(180)
@pytest.mark.skipif(sys.platform != "linux", reason="needs fork (Linux)")
def test_auto_moves_to_threads_when_the_growth_would_exceed_the_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dataset = Strings(400_000, WALK)  # (each worker copies about 85 MiB of it)
    # A machine with little memory to spare: 80 MiB, of which the workers may take half.
    monkeypatch.setattr(switch, "available_memory", lambda: 80 * MiB)
    _measure_often(monkeypatch)

    def loader(workers: Any) -> ferry.DataLoader[Any]:
        return ferry.DataLoader(
            dataset,
            batch_size=256,
            shuffle=True,
            generator=torch.Generator().manual_seed(7),
            num_workers=workers,
            multiprocessing_context="fork",
        )

    auto = loader("auto")
    first, stats = _epoch(auto)
    assert stats.engine == "thread"
    assert "copy-on-write" in stats.tuning
    assert "80 MiB available" in stats.tuning
    second, stats = _epoch(auto)
    assert stats.engine == "thread"
    assert auto.worker_type == "thread"  # kept for the next epochs
    # Not a batch changed: the same as fixed process workers over the same seeds. They measure
    # at the library's own pace (how often a worker measures changes no batch; measuring this
    # large a process 20 times a second took about 2 s of each 800,000-sample epoch).
    monkeypatch.setattr(memory, "INTERVAL_S", INTERVAL_S)
    monkeypatch.setattr(memory, "COST_SHARE", COST_SHARE)
    fixed = loader(2)
    assert first == _epoch(fixed)[0]
    assert second == _epoch(fixed)[0]


@linux
@pytest.mark.timeout(120)
@pytest.mark.skipif(sys.platform != "linux", reason="needs fork (Linux)")
def test_auto_keeps_processes_where_the_memory_suffices() -> None:
    loader = ferry.DataLoader(
        Strings(300_000), batch_size=256, num_workers="auto", multiprocessing_context="fork"
    )
    _, stats = _epoch(loader)
    assert stats.engine == "process"
    assert "copy-on-write" not in stats.tuning


class FreezeCount(tud.Dataset[int]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        import gc

        return gc.get_freeze_count()


@pytest.mark.timeout(60)
@pytest.mark.skipif(sys.platform != "linux", reason="needs fork (Linux)")
def test_forked_workers_keep_the_inherited_objects_out_of_their_collections() -> None:
    """A collection writes to every object it visits: forked workers get the main process's
    objects in the permanent generation, which collections skip; the main process keeps
    collecting its own."""
    import gc

    loader = ferry.DataLoader(
        FreezeCount(), batch_size=2, num_workers=2, multiprocessing_context="fork"
    )
    counts = [x for batch in loader for x in batch.tolist()]
    assert min(counts) > 1000  # (torch's modules alone are tens of thousands of objects)
    assert gc.get_freeze_count() == 0


@pytest.mark.timeout(60)
@pytest.mark.skipif(sys.platform != "linux", reason="needs fork (Linux)")
def test_a_programs_own_freeze_of_the_collector_stays() -> None:
    """A program that called ``gc.freeze()`` itself (the advice for forking loaders) keeps its
    objects frozen through an epoch of forked workers, which inherit them frozen; ferry's own
    freeze around the fork used to end with ``gc.unfreeze()``, which undid the program's."""
    import gc

    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        loader = ferry.DataLoader(
            FreezeCount(), batch_size=2, num_workers=2, multiprocessing_context="fork"
        )
        counts = [x for batch in loader for x in batch.tolist()]
        # (a frozen object freed by its reference count leaves the count: a few go meanwhile)
        assert min(counts) > frozen // 2
        assert gc.get_freeze_count() > frozen // 2  # (0 once undone)
    finally:
        gc.unfreeze()


@pytest.mark.timeout(60)
def test_stats_say_how_much_shared_memory_the_loader_maps() -> None:
    """Process workers' batches lie in shared-memory slabs mapped in the main process: stats()
    says how much is mapped now and the most it was (large batches, bounded slabs)."""
    data = tud.TensorDataset(torch.zeros(64, 1 << 16))  # 256 KiB a sample: 1 MiB a batch
    loader = ferry.DataLoader(data, batch_size=4, num_workers=2)
    iterator = iter(loader)
    held = [next(iterator) for _ in range(6)]
    stats = loader.stats()
    assert stats.shared_memory_bytes >= 6 * (1 << 20)  # (the batches the loop holds, at least)
    assert stats.shared_memory_peak_bytes >= stats.shared_memory_bytes
    assert "shared memory:" in str(stats)
    del held, iterator
    threads = ferry.DataLoader(data, batch_size=4, num_workers=2, worker_type="thread")
    assert sum(len(batch) for (batch,) in threads) == 64
    assert threads.stats().shared_memory_peak_bytes == 0
    assert "shared memory:" not in str(threads.stats())


def test_slabs_are_kept_for_reuse_up_to_a_share_of_the_available_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 150 MB batch of float32 images keeps its slab (its hand-off stays a few ms) on a
    machine with memory to spare; a 1 GiB batch on a 24 GiB machine does not (its memory goes
    back as soon as the batch is dropped, as torch's does)."""
    from ferry._engine.transport import shm

    monkeypatch.setattr(shm, "available_memory", lambda: 32 << 30)
    assert shm.reuse_limit() == 512 * MiB
    monkeypatch.setattr(shm, "available_memory", lambda: 20 << 30)
    assert 150 * MiB <= shm.reuse_limit() < 1024 * MiB
    monkeypatch.setattr(shm, "available_memory", lambda: 1 << 30)
    assert shm.reuse_limit() == shm.REUSE_FLOOR  # (64 MiB at least)
    monkeypatch.setattr(shm, "available_memory", lambda: None)
    assert shm.reuse_limit() == shm.REUSE_FLOOR
    monkeypatch.setattr(shm, "REUSE_LIMIT", 1 * MiB)  # set by hand: as it is
    assert shm.reuse_limit() == 1 * MiB
