"""Per-sample parallel reads in thread workers (``ferry._engine.work.reads``).

When the samples of a map-style dataset wait (a sleep stands for a network read), thread workers
read the samples of a batch at once instead of one after another. What must not change: the
batches and their order, the error a failing read raises (the first failing key's, in key
order), ``on_error="skip"``'s accounting, resume, and nothing left running afterwards. The
decision itself (how many reads at once) is tested with stand-in clocks.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import weakref
from typing import Any, ClassVar

import pytest
import torch
import torch.utils.data as tud

import ferry
from _support.datasets import AllAtOnce
from _support.resume import assert_resumes_exactly
from ferry._engine.work import reads as reads_module
from ferry._engine.work.reads import PARALLEL_FROM, Failed, SampleReads, busy_of

LATENCY = 0.004


class Waiting(tud.Dataset[int]):
    """Sample ``i`` is ``i``, after ``latency`` seconds of sleep (which releases the GIL);
    ``fail`` holds keys whose read raises ``KeyError``. Counts reads in flight at once."""

    def __init__(self, n: int = 96, latency: float = LATENCY, fail: frozenset[int] = frozenset()):
        self.n, self.latency, self.fail = n, latency, fail
        self._lock = threading.Lock()
        self.in_flight = 0
        self.most = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        with self._lock:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        try:
            time.sleep(self.latency)
            if index in self.fail:
                raise KeyError(f"sample {index} is missing")
            return index
        finally:
            with self._lock:
                self.in_flight -= 1


def _threads(**kwargs: Any) -> ferry.DataLoader[Any]:
    return ferry.DataLoader(
        kwargs.pop("dataset", None) or Waiting(),
        batch_size=kwargs.pop("batch_size", 16),
        num_workers=2,
        worker_type="thread",
        **kwargs,
    )


def _reads_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ferry-read-")]


def _wait_no_reads(timeout: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while (alive := _reads_alive()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return alive


# -- the decision, with stand-in clocks ----------------------------------------------------------


class _Clocks:
    """A wall clock and a CPU clock that a stand-in dataset moves."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def dataset(self, wall: float, cpu: float) -> Any:
        clocks = self

        class Timed:
            threads: ClassVar[set[str]] = set()  # the threads that read

            def __getitem__(self, index: int) -> int:
                self.threads.add(threading.current_thread().name)
                clocks.wall += wall
                clocks.cpu += cpu
                return index

        return Timed()


def _reads(clocks: _Clocks, limit: int = 64) -> SampleReads:
    return SampleReads(limit, clock=lambda: clocks.wall, cpu_clock=lambda: clocks.cpu)


def test_reads_that_hold_the_cpu_stay_one_at_a_time() -> None:
    clocks = _Clocks()
    reads = _reads(clocks)
    dataset = clocks.dataset(wall=0.001, cpu=0.001)
    for _ in range(5):
        assert reads.read(dataset, list(range(8))) == list(range(8))
    assert reads.width == 1
    assert reads.ratio == pytest.approx(1.0)
    # Every read on the caller's thread; the pool's one thread only watched the first read.
    assert dataset.threads == {threading.current_thread().name}
    assert reads._pool is not None
    assert len(reads._pool._threads) == 1
    reads.close()


def test_reads_that_wait_go_wide_from_the_first_read_on() -> None:
    clocks = _Clocks()
    reads = _reads(clocks, limit=16)
    dataset = clocks.dataset(wall=0.010, cpu=0.0001)  # waits 100x its CPU time
    # The first read alone is measured, then the rest of the first batch goes at once.
    assert reads.read(dataset, [0]) == [0]
    assert reads.width == 16  # ceil(100), at most the limit
    try:
        assert reads.read(dataset, list(range(40))) == list(range(40))  # in key order
    finally:
        reads.close()


def test_the_width_follows_the_ratio_and_comes_back_down() -> None:
    clocks = _Clocks()
    reads = _reads(clocks)
    reads._measured(0.010, 0.001)
    assert reads.width == 10
    for _ in range(30):  # the reads stop waiting: the moving average follows
        reads._measured(0.001, 0.001)
    assert reads.ratio < PARALLEL_FROM
    assert reads.width == 1


def test_collect_gives_each_failure_in_its_place() -> None:
    clocks = _Clocks()
    reads = _reads(clocks)
    data = Waiting(n=8, latency=0.0, fail=frozenset({2, 5}))
    try:
        results = reads.read(data, list(range(8)), collect=True)
    finally:
        reads.close()
    assert [r.error.args[0] if isinstance(r, Failed) else r for r in results] == [
        0, 1, "sample 2 is missing", 3, 4, "sample 5 is missing", 6, 7,
    ]  # fmt: skip


# -- reads at once: what their times say ---------------------------------------------------------


def test_reads_at_once_that_waited_for_one_another_compute() -> None:
    """32 reads of 1 ms of CPU at once, most run whole, some waited for the others (the GIL):
    15x their CPU summed, but the median read took its CPU time. A process worker's reads
    (``alone``: num_workers="auto" judges them) compute: width 1 at once, whatever the
    averages said before."""
    reads = SampleReads(alone=True)
    reads._measured(0.020, 0.0002)  # (100x before)
    measured = [(0.001, 0.001, 0.001)] * 20 + [(0.040, 0.001, 0.001)] * 12
    assert sum(t[0] for t in measured) >= PARALLEL_FROM * 0.032  # (the sum says: they wait)
    wall, cpu, count = reads._verdict(measured)
    assert count == 32
    assert wall / cpu < PARALLEL_FROM
    assert reads.width == 1
    assert reads.ratio == pytest.approx(1.0)
    shared = SampleReads()  # thread workers' reads: the sums, as before
    shared._verdict(measured)
    assert shared.width > 1


def test_reads_at_once_that_kept_the_gil_busy_compute_even_where_the_median_waited() -> None:
    """Eight reads of 4 ms of Python at once, each cut short by the GIL's switch interval:
    each waited for the others, 7x at the median. Their busy seconds filled their span: the
    process's GIL was busy all along, which thread workers could not do better than; the judge
    is told they compute. The worker's own width stays as measured. Reads that waited and
    filled a fifth of the span (a fresh process's first batch fills up to 0.7) still wait."""
    measured = [(0.028, 0.004, 0.004)] * 8
    reads = SampleReads(alone=True)
    wall, busy, count = reads._verdict(measured, reads_module._filled(measured, 0.033))
    assert (wall, busy, count) == pytest.approx((0.032, 0.032, 8))
    assert reads.width == 7  # (the averages as measured: ceil(28 / 4))
    wall, busy, _ = SampleReads(alone=True)._verdict(measured, filled=0.2)
    assert wall / busy >= PARALLEL_FROM
    assert reads_module._filled(measured, 0.0) == 0.0
    shared = SampleReads()  # thread workers' reads: the sums, as before
    wall, cpu, _ = shared._verdict(measured, filled=1.0)
    assert wall / cpu >= PARALLEL_FROM


@pytest.mark.parametrize("alone", [False, True])
def test_reads_at_once_that_waited_wait(alone: bool) -> None:
    reads = SampleReads(alone=alone)
    measured = [(0.050, 0.0005, 0.0005)] * 32  # 100x
    assert reads._verdict(measured) == pytest.approx((1.6, 0.016, 32))
    assert reads.width == 64


def test_a_process_workers_reads_count_a_wait_for_a_cpu_as_computing() -> None:
    """Reads on a machine with more runnable threads than CPUs: 3 ms on a CPU and 11 ms
    waiting for one. A process worker's reads count the wait up to their CPU time as busy
    (6 ms): they compute. Thread workers' reads keep their width (ceil(14 / 3))."""
    assert reads_module._counted(0.003, 0.011) == pytest.approx(0.006)
    assert reads_module._counted(0.003, 0.001) == pytest.approx(0.004)
    assert reads_module._counted(0.00005, 0.004) == pytest.approx(0.0001)  # (woke from a sleep)
    measured = [(0.014, 0.006, 0.003)] * 32
    judged = SampleReads(alone=True)
    wall, busy, _ = judged._verdict(measured)
    assert wall / busy < PARALLEL_FROM
    assert judged.width == 1
    shared = SampleReads()
    shared._verdict(measured)
    assert shared.width == 5


class OpensAtFirstRead(tud.Dataset[int]):
    """The common pattern: a file (HDF5, LMDB) opened at the first read of each process, by
    whichever read finds it closed, then ``work`` seconds of Python per sample. With
    ``opens=2`` the second read waits too (the file's index read); ``opens`` may be changed
    between epochs (the next epoch's workers are forked with it)."""

    def __init__(self, n: int = 256, work: float = 0.001, opens: int = 1) -> None:
        self.n, self.work, self.opens, self.opened = n, work, opens, 0
        self.handle: object | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if self.opened < self.opens:
            self.opened += 1
            time.sleep(0.02)
            self.handle = object()
        end = time.thread_time() + self.work
        while time.thread_time() < end:
            pass
        return index


class Started(OpensAtFirstRead):
    """OpensAtFirstRead that notes when each read began and whether the file was open."""

    def __init__(self, n: int = 256, work: float = 0.001) -> None:
        super().__init__(n, work)
        self.began: list[tuple[int, bool]] = []

    def __getitem__(self, index: int) -> int:
        self.began.append((index, self.handle is not None))
        return super().__getitem__(index)


@pytest.mark.timeout(30)
def test_a_process_workers_first_read_that_opens_a_file_leaves_computing_reads_alone() -> None:
    """The first read waits (it opens the file). A process worker's reads (``alone``) begin
    nothing while it runs, and read the next one alone too, a probe: it computes, so the rest
    follow one at a time on the worker's thread, the file open for every one. (On a starved
    machine the probe may wait for a CPU long enough to look as if it waited: then the rest
    are read at once, and their median read says that they compute.)"""
    reads = SampleReads(alone=True)
    dataset = Started()
    try:
        assert reads.read(dataset, list(range(32))) == list(range(32))
        assert all(opened for index, opened in dataset.began if index > 0)
        said = reads.last_parallel()
        assert said is None or said[0] < PARALLEL_FROM * said[1]
        assert reads.width == 1
        assert reads.ratio < PARALLEL_FROM
    finally:
        reads.close()


@pytest.mark.timeout(30)
def test_a_probe_that_computes_takes_back_the_first_looks_word_that_reads_wait() -> None:
    """The first read opens the file (it waits: the main process holds the other workers
    back); the probe after it computes, which is said at once, so the other workers start
    while this batch is still read, not after it was handed out. A word from the first read's
    watcher that comes after the probe's (late, on a busy machine) is not said."""
    told: list[bool] = []
    reads = SampleReads(alone=True)
    reads.on_first_look = told.append
    try:
        assert reads.read(OpensAtFirstRead(8, work=0.002), list(range(8))) == list(range(8))
        assert told == [True, False]
        reads._tell_first_look(True)  # (a watcher's word after the probe's)
        assert told == [True, False]
    finally:
        reads.close()


@pytest.mark.timeout(30)
def test_a_process_workers_reads_that_wait_begin_the_rest_once_a_probe_waited_too() -> None:
    events: list[tuple[str, int]] = []

    class Logged(Waiting):
        def __getitem__(self, index: int) -> int:
            events.append(("begins", index))
            try:
                return super().__getitem__(index)
            finally:
                events.append(("ends", index))

    reads = SampleReads(alone=True)
    data = Logged(n=16, latency=0.01)
    try:
        assert reads.read(data, list(range(16))) == list(range(16))
        # the first alone, then the probe alone, then the other 14 at once
        assert events[:4] == [("begins", 0), ("ends", 0), ("begins", 1), ("ends", 1)]
        assert data.most > 1
        said = reads.last_parallel()
        assert said is not None
        assert said[0] >= PARALLEL_FROM * said[1]  # they wait: evidence from the first batch
    finally:
        reads.close()


# -- the first read, watched while it runs --------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_first_read_that_waits_has_the_rest_of_its_batch_begun_before_it_ends() -> None:
    rest_began = threading.Event()

    class Gated:
        waited: bool | None = None

        def __getitem__(self, index: int) -> int:
            if index == 0:  # waits (no CPU) until a later read of its batch has begun
                type(self).waited = rest_began.wait(timeout=10)
            else:
                rest_began.set()
                time.sleep(0.001)
            return index

    reads = SampleReads()
    try:
        assert reads.read(Gated(), list(range(8))) == list(range(8))
    finally:
        reads.close()
    assert Gated.waited is True  # read 0 ended because reads 1..7 had begun
    assert reads.width > 1
    assert _wait_no_reads() == []


@pytest.mark.timeout(30)
def test_a_first_read_that_computes_keeps_the_batch_on_the_callers_thread() -> None:
    class Computing:
        threads: ClassVar[set[str]] = set()

        def __getitem__(self, index: int) -> int:
            self.threads.add(threading.current_thread().name)
            end = time.thread_time() + (0.03 if index == 0 else 0.001)
            while time.thread_time() < end:  # holds the CPU (and the GIL)
                pass
            return index

    data = Computing()
    reads = SampleReads()
    # A collection started by another thread (the watcher's allocations, in a process that
    # ran hundreds of tests before: 50 ms and more) holds the GIL while the read waits for it,
    # so the read looks as if it waited ("Limits of the measurement" in docs/design/io.md):
    # none may run during this read.
    collecting = gc.isenabled()
    gc.disable()
    try:
        assert reads.read(data, list(range(6))) == list(range(6))
    finally:
        reads.close()
        if collecting:
            gc.enable()
    assert data.threads == {threading.current_thread().name}
    assert reads.width == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("wall", "cpu", "waits"), [(0.01, 0.0001, True), (0.01, 0.009, False)])
def test_a_first_read_that_ends_before_its_watcher_looks_is_judged_by_what_it_took(
    monkeypatch: pytest.MonkeyPatch, wall: float, cpu: float, waits: bool
) -> None:
    """On a machine whose CPUs are all busy the watcher may not run until the first read has
    ended: what it tells (``num_workers="auto"`` starts the other process workers when told
    the read computes) is then what the read took, not "computes" for want of a look."""
    clocks = _Clocks()
    read_over = threading.Event()

    class HeldWatcher:  # the watcher's first nap lasts until the first read is over
        @staticmethod
        def sleep(_seconds: float) -> None:
            read_over.wait(10)

    monkeypatch.setattr(reads_module, "time", HeldWatcher)
    timed = clocks.dataset(wall, cpu)

    class Data:
        def __getitem__(self, index: int) -> int:
            if index > 0:  # (read once the first one is over)
                read_over.set()
            return int(timed[index])

    reads = SampleReads(
        clock=lambda: clocks.wall, cpu_clock=lambda: clocks.cpu, busy=lambda _: clocks.cpu
    )
    assert _first_looks(reads, Data(), told=[]) == [waits]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("looks", ["while it runs", "once it ended"])
@pytest.mark.parametrize(
    "read",
    [
        # (wall, CPU and queued seconds, whether it waits)
        pytest.param((0.010, 0.0001, 0.008, True), id="slept-then-waited-8ms-for-a-cpu"),
        pytest.param((0.017, 0.009, 0.008, False), id="computed-waiting-as-long-for-a-cpu"),
    ],
)
def test_a_first_reads_watcher_counts_a_wait_for_a_cpu_as_a_reads_busy_seconds_do(
    monkeypatch: pytest.MonkeyPatch, looks: str, read: tuple[float, float, float, bool]
) -> None:
    """A process worker's first read on a machine whose CPUs are all busy: the watcher counts
    the reading thread's wait for a CPU up to its CPU time, as the read's own figures do
    (``reads._counted``). Counted whole, a read that slept and then waited milliseconds for a
    CPU as it woke looked as if it computed: the watcher said "computes", the main process
    started the workers it held back, and the loader became threads a batch later anyway
    (``test_reads_that_wait_become_threads_before_the_other_workers_start`` failed so)."""
    wall, cpu, queued, waits = read
    clocks = _Clocks()
    queue_seconds = [0.0]
    look = threading.Event()

    class HeldWatcher:  # the watcher's naps last until the read lets it look
        @staticmethod
        def sleep(_seconds: float) -> None:
            look.wait(10)

    monkeypatch.setattr(reads_module, "time", HeldWatcher)
    told: list[bool] = []

    class Data:
        def __getitem__(self, index: int) -> int:
            clocks.wall += wall
            clocks.cpu += cpu
            queue_seconds[0] += queued
            if index == 0 and looks == "while it runs":
                look.set()
                deadline = time.monotonic() + 10
                while not told and time.monotonic() < deadline:  # (its look is told at once)
                    time.sleep(0.001)
            elif index > 0:  # (the first read is over)
                look.set()
            return index

    reads = SampleReads(
        clock=lambda: clocks.wall,
        cpu_clock=lambda: clocks.cpu,
        busy=lambda _: clocks.cpu + queue_seconds[0],
        alone=True,
    )
    reads._clocks.split = lambda _: (clocks.cpu, queue_seconds[0])
    assert _first_looks(reads, Data(), told) == [waits]


def _first_looks(reads: SampleReads, data: Any, told: list[bool]) -> list[bool]:
    """What the watcher of ``data``'s first read said (into ``told``), reading samples 0, 1."""
    reads.on_first_look = told.append
    try:
        assert reads.read(data, [0, 1]) == [0, 1]
    finally:
        reads.close()  # (waits for the watcher)
    return told


@pytest.mark.timeout(30)
@pytest.mark.skipif(
    not hasattr(time, "pthread_getcpuclockid") or not os.path.exists("/proc/self/schedstat"),
    reason="no per-thread CPU clocks or schedstat",
)
def test_a_threads_busy_seconds_are_up_to_date_while_it_computes() -> None:
    """busy_of, as the first read's watcher reads it of a thread on a CPU: never behind the
    thread's CPU clock and time queued for a CPU read just before. (``schedstat``'s CPU
    figure for a running thread is as old as the last scheduler tick: a computing read would
    look as if it waited.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    matrix = torch.randn(600, 600)
    stop = threading.Event()

    def compute() -> None:  # on a CPU, without the GIL, until told to stop
        while not stop.is_set():
            matrix @ matrix

    thread = threading.Thread(target=compute, daemon=True)
    thread.start()
    behind = []
    try:
        time.sleep(0.02)
        for _ in range(100):
            time.sleep(0.0003)
            cpu = time.clock_gettime(time.pthread_getcpuclockid(thread.ident or 0))
            with open(f"/proc/self/task/{thread.native_id}/schedstat", "rb") as schedstat:
                queued = int(schedstat.read().split()[1]) / 1e9  # (waiting for a CPU)
            behind.append(cpu + queued - busy_of(thread))
    finally:
        stop.set()
        thread.join(10)
        torch.set_num_threads(threads)
    assert max(behind) <= 0.0


@pytest.mark.timeout(30)
def test_a_first_read_that_fails_cancels_what_the_watcher_began() -> None:
    class FailsFirst:
        def __init__(self) -> None:
            self.read: list[int] = []

        def __getitem__(self, index: int) -> int:
            if index == 0:
                time.sleep(0.05)  # long enough for the watcher to begin the rest
                raise KeyError("sample 0 is missing")
            time.sleep(0.005)
            self.read.append(index)
            return index

    reads = SampleReads(limit=2)
    data = FailsFirst()
    with pytest.raises(KeyError, match="sample 0 is missing"):
        reads.read(data, list(range(64)))
    reads.close()
    assert len(data.read) < 63  # the reads not begun yet were cancelled
    assert _wait_no_reads() == []


@pytest.mark.timeout(30)
def test_the_pool_reaches_its_width_with_threads_starting_threads() -> None:
    reads = SampleReads(limit=31)
    reads._measured(0.01, 0.0001)  # (measured to wait: read at once)
    try:
        assert reads.read(AllAtOnce(31), list(range(31))) == list(range(31))  # (31 at once)
        assert reads._pool is not None
        assert len(reads._pool._threads) == 31
    finally:
        reads.close()
    assert _wait_no_reads() == []


# -- in the loader -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_reads_on_the_pool_see_the_worker_info_of_the_worker_that_asked() -> None:
    class Who(Waiting):
        def __getitem__(self, index: int) -> Any:
            super().__getitem__(index)
            info, theirs = ferry.get_worker_info(), tud.get_worker_info()
            return (index, info.id if info else -1, theirs.id if theirs else -1)

    loader = _threads(dataset=Who(n=64), collate_fn=lambda rows: rows)
    batches = list(loader)
    assert sorted(r[0] for batch in batches for r in batch) == list(range(64))
    # Every read of a batch, on whatever thread, sees the worker that made it (ferry's and
    # torch's get_worker_info alike), and both workers made batches.
    workers = [{(r[1], r[2]) for r in batch} for batch in batches]
    assert all(len(seen) == 1 for seen in workers)
    assert {seen.pop() for seen in workers} == {(0, 0), (1, 1)}
    assert loader.stats().concurrency > 2


@pytest.mark.timeout(60)
def test_thread_workers_read_a_batch_at_once_and_hand_out_torchs_batches() -> None:
    data = Waiting()
    generator = torch.Generator()
    generator.manual_seed(4)
    want = [
        b.tolist() for b in tud.DataLoader(data, batch_size=16, shuffle=True, generator=generator)
    ]
    generator.manual_seed(4)
    loader = _threads(dataset=data, shuffle=True, generator=generator)
    data.most = 0
    assert [b.tolist() for b in loader] == want
    assert data.most > 2 * 2  # more reads at once than batches in flight (2 workers x 2)
    stats = loader.stats()
    assert stats.concurrency == 2 * 16  # two workers, each reading its 16 samples at once
    assert stats.read_wait_ratio > PARALLEL_FROM
    assert "reads: up to 32 samples at once" in str(stats)
    assert _wait_no_reads() == []


@pytest.mark.timeout(60)
def test_a_failing_read_raises_the_first_failing_key_of_the_batch() -> None:
    data = Waiting(fail=frozenset({21, 19}))  # both in batch 1 (keys 16..31)
    loader = _threads(dataset=data)
    iterator = iter(loader)
    assert next(iterator).tolist() == list(range(16))
    with pytest.raises(KeyError, match="sample 19 is missing"):
        next(iterator)
    del iterator
    loader._iterator = None
    assert _wait_no_reads() == []


@pytest.mark.timeout(60)
def test_skipped_reads_are_accounted_as_when_read_one_by_one() -> None:
    fail = frozenset({3, 17, 18, 40})

    def run(loader: ferry.DataLoader[Any]) -> tuple[list[list[int]], int]:
        batches = [b.tolist() for b in loader]
        return batches, loader.stats().skipped

    serial = run(ferry.DataLoader(Waiting(fail=fail, latency=0.0), batch_size=16, on_error="skip"))
    parallel = run(_threads(dataset=Waiting(fail=fail), on_error="skip"))
    assert parallel == serial
    assert serial[1] == len(fail)


@pytest.mark.timeout(60)
def test_a_read_that_ends_the_epoch_ends_it_as_in_torch() -> None:
    class Short(Waiting):
        def __getitem__(self, index: int) -> int:
            if index >= 40:
                raise StopIteration
            return super().__getitem__(index)

    want = [b.tolist() for b in tud.DataLoader(Short(latency=0.0), batch_size=16)]
    assert [b.tolist() for b in _threads(dataset=Short())] == want


@pytest.mark.timeout(60)
def test_resume_mid_epoch_with_parallel_reads_is_exact() -> None:
    def loader() -> ferry.DataLoader[Any]:
        return _threads(shuffle=True, generator=torch.Generator().manual_seed(9))

    assert_resumes_exactly(lambda seed: loader(), at=2, round_trip=None)


@pytest.mark.timeout(60)
def test_a_dataset_with_getitems_decides_its_reads_itself() -> None:
    class Many(Waiting):
        calls = 0

        def __getitems__(self, indices: list[int]) -> list[int]:
            type(self).calls += 1
            return [self[i] for i in indices]

    data = Many(n=32)
    assert [b.tolist() for b in _threads(dataset=data)] == [list(range(16)), list(range(16, 32))]
    assert Many.calls == 2
    assert data.most <= 2  # one read at a time per worker


@pytest.mark.timeout(60)
def test_persistent_workers_keep_their_reads_until_the_loader_lets_go() -> None:
    loader = _threads(persistent_workers=True)
    for _ in range(2):
        assert len(list(loader)) == 6
    assert _reads_alive()
    loader._iterator = None
    assert _wait_no_reads() == []


class _Local:
    """An object only a frame's local holds."""


def _look_at_the_reads(refs: list[weakref.ref[_Local]]) -> list[Any]:
    local = _Local()
    refs.append(weakref.ref(local))
    return reads_module.reads_serving(threading.get_ident())


def test_a_look_at_the_reads_in_flight_leaves_no_cycle_behind() -> None:
    """A stall report, and every process worker's answer to Stop, look at the pool's reads
    through ``sys._current_frames()``, whose dict holds the looking frame itself: kept in a
    local, it made a cycle that held every thread's frames, and their locals (a worker's
    dataset, which a spawned worker must let go of when its loop ends), until a collection.
    With collections off, a local of the looking frame's caller must go with the call. (Not
    counted by ``gc.collect()``: other threads of the process make garbage of their own.)"""
    collecting = gc.isenabled()
    gc.disable()
    try:
        refs: list[weakref.ref[_Local]] = []
        assert _look_at_the_reads(refs) == []
        assert refs[0]() is None, "the caller's frame outlived the call: a reference cycle"
    finally:
        if collecting:
            gc.enable()


def test_the_exit_waits_for_the_reads_running_on_the_pools() -> None:
    """At interpreter exit (crew/group.py) reads still running on a pool are waited for, up to
    the deadline: a pool thread inside a torch operation that let go of the GIL would abort the
    process as the interpreter finalizes."""
    started = time.monotonic()
    reads_module.wait_for_reads(started + 5.0)  # none runs: at once
    assert time.monotonic() - started < 0.5
    reads_module._SERVING[-1] = (0, "key", sys._getframe())  # (a read that runs)
    threading.Timer(0.2, reads_module._SERVING.pop, args=(-1,)).start()
    reads_module.wait_for_reads(started + 5.0)
    assert 0.15 < time.monotonic() - started < 4.0
    reads_module._SERVING[-1] = (0, "key", sys._getframe())  # (one that never ends)
    try:
        reads_module.wait_for_reads(time.monotonic() + 0.1)  # returns at the deadline
    finally:
        del reads_module._SERVING[-1]
