"""``num_workers="auto"``: process workers whose reads wait give way to thread workers within
the first epoch (``ThreadMove.move``, tuning/switch.py), without changing a batch.

The process workers read per sample too (their own pool), and the first batch of each worker
tells (``WaitJudge``: wall time over the CPU time the worker's thread used). Then the same number
of thread workers take over at a batch boundary and fetch every batch not yet handed out again,
from the same keys; the next epochs start with threads. CPU-bound work, and datasets with a
state of their own, stay in processes.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import psutil
import pytest
import torch
import torch.utils.data as tud

import ferry
from _support.processes import worker_pids
from _support.resume import assert_resumes_exactly
from ferry._engine.tuning import autotune, switch
from ferry._engine.tuning.switch import WaitJudge
from ferry._engine.work.reads import PARALLEL_FROM, SampleReads
from workers.test_sample_reads import OpensAtFirstRead, Waiting, _wait_no_reads


class Busy(tud.Dataset[int]):
    """CPU-bound: each sample spins for ``work`` seconds of CPU."""

    def __init__(self, n: int = 64, work: float = 0.002) -> None:
        self.n, self.work = n, work

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        end = time.thread_time() + self.work
        while time.thread_time() < end:
            pass
        return index


class Counted(Waiting):
    """Waiting, with a state of its own."""

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


# Reads that wait this long: a waiting worker's wake-ups on a loaded machine (time spent ready
# to run, which the judge counts as computing) stay small beside it.
SLOW = 0.02


class WaitsThenComputes(tud.Dataset[int]):
    """Sample ``i`` is ``i``: the first ``waits`` reads in each process wait (``SLOW``: files
    opened and a cache filled over the network, say), every later one computes ``work`` seconds
    of Python, holding the GIL. The judge sees the first reads wait."""

    def __init__(self, n: int, waits: int, work: float) -> None:
        self.n, self.waits, self.work = n, waits, work
        self.reads: dict[int, int] = {}  # per process (threads may race and lose a count)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        count = self.reads.get(os.getpid(), 0)
        self.reads[os.getpid()] = count + 1
        if count < self.waits:
            time.sleep(SLOW)
            return index
        end = time.thread_time() + self.work
        while time.thread_time() < end:
            pass
        return index


def _auto(dataset: Any, **kwargs: Any) -> ferry.DataLoader[Any]:
    return ferry.DataLoader(dataset, batch_size=8, num_workers="auto", **kwargs)


def test_the_judge_decides_once_from_the_first_batches() -> None:
    judge = WaitJudge(batches=2)
    assert judge.add(0.32, 0.001, reads=8) == ""  # one batch: not yet
    why = judge.add(0.30, 0.002, reads=8)
    assert "worker_type='thread'" in why
    assert judge.decided
    assert judge.add(0.3, 0.001, reads=8) == ""  # decided: nothing more
    cpu_bound = WaitJudge(batches=1)
    assert cpu_bound.add(0.01, 0.01 / (PARALLEL_FROM - 1), reads=8) == ""
    assert cpu_bound.decided


def test_the_judge_goes_by_the_median_read_of_eight_at_least() -> None:
    """Batches of one to three samples: the judge waits for eight reads, and goes by the
    median read, each batch counting for its reads. Two reads that wait in a process (its
    file opened, its index read; or a stall) do not make reads that compute pass for reads
    that wait, as the sums of the first two batches did; reads that wait still do."""
    judge = WaitJudge(batches=2)
    assert judge.add(0.030, 0.001, reads=1) == ""  # the second read, which waited
    assert judge.add(0.032, 0.002, reads=1) == ""  # the other worker's
    assert not judge.decided  # (two batches, two reads: not enough)
    for _ in range(5):
        assert judge.add(0.002, 0.002, reads=1) == ""
    assert not judge.decided
    assert judge.add(0.002, 0.002, reads=1) == ""
    assert judge.decided  # eight reads: they compute (the sums said 17x)
    assert judge.wall / judge.cpu >= PARALLEL_FROM
    waiting = WaitJudge(batches=2)
    assert waiting.add(0.004, 0.002, reads=3) == ""  # (a batch that hit a cache)
    assert waiting.add(0.09, 0.003, reads=3) == ""
    assert "worker_type='thread'" in waiting.add(0.09, 0.003, reads=3)
    even = WaitJudge(batches=1)  # an even count: the lower median (processes: the safe side)
    assert even.add(0.02, 0.001, reads=4) == ""
    assert even.add(0.001, 0.001, reads=4) == ""
    assert even.decided


@pytest.mark.timeout(90)
def test_waiting_process_workers_become_threads_with_torchs_batches() -> None:
    data = Waiting(n=160, latency=SLOW)

    # torch's batches: sample i is i, so torch's loader over the indices gives them without
    # the 20 ms reads (3 s an epoch inline); its shuffle is the same sampler, same generator.
    generator = torch.Generator().manual_seed(2)
    reference = tud.DataLoader(range(160), batch_size=8, shuffle=True, generator=generator)
    want = [[b.tolist() for b in reference] for _ in range(2)]
    loader = _auto(data, shuffle=True, generator=torch.Generator().manual_seed(2))
    iterator = iter(loader)
    processes = [w.pid for w in iterator._workers]  # type: ignore[attr-defined]
    assert all(pid is not None for pid in processes)  # it starts with process workers
    got = [[b.tolist() for b in iterator]]
    del iterator
    stats = loader.stats()
    assert stats.engine == "thread"
    assert "worker_type='thread' from batch" in stats.tuning
    assert stats.concurrency > loader.num_workers
    got.append([b.tolist() for b in loader])
    assert loader.stats().engine == "thread"
    assert got == want
    assert loader.worker_type == "thread"  # the next epochs start with threads
    assert not [pid for pid in processes if psutil.pid_exists(pid)]  # stopped at the switch
    assert _wait_no_reads() == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("dataset", [Busy(), Counted(n=64)], ids=["cpu_bound", "stateful"])
def test_cpu_bound_and_stateful_datasets_stay_in_processes(dataset: Any) -> None:
    loader = _auto(dataset)
    assert [x for b in loader for x in b.tolist()] == list(range(len(dataset)))
    assert loader.stats().engine == "process"
    assert loader.worker_type == "process"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("work", [0.0002, 0.002])
def test_a_dataset_that_opens_its_file_at_the_first_read_stays_in_processes(work: float) -> None:
    """Each process worker's first read opens the file (20 ms of waiting), and the reads its
    watcher then began at once found it still closed and opened it too: that batch waited,
    but only for what a first read does. The reads compute; process workers stay (threads
    would run them on one CPU: half the speed on two, a fifteenth on sixteen)."""
    data = OpensAtFirstRead(n=512, work=work)
    loader = ferry.DataLoader(
        data, batch_size=32, num_workers="auto", multiprocessing_context="fork"
    )
    assert [x for b in loader for x in b.tolist()] == list(range(512))
    stats = loader.stats()
    assert stats.engine == "process", stats.tuning


@pytest.mark.timeout(90)
@pytest.mark.parametrize("opens", [1, 2])
@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_a_small_batch_after_a_first_read_that_opens_its_file_stays_in_processes(
    batch_size: int, opens: int
) -> None:
    """Batches too small to read at once are judged as they were read, one after another:
    without the worker's first read, which opened the file (with it, 20 ms against 1 ms
    reads, every batch of one to three samples looked like waiting), and by the median of
    eight reads or more (the sums of the first two batches went by the second read that
    waited, where two do: ``opens=2``)."""
    data = OpensAtFirstRead(n=48, work=0.001, opens=opens)
    loader = ferry.DataLoader(
        data, batch_size=batch_size, num_workers="auto", multiprocessing_context="fork"
    )
    assert [x for b in loader for x in b.tolist()] == list(range(48))
    stats = loader.stats()
    assert stats.engine == "process", stats.tuning


@pytest.mark.timeout(90)
def test_reads_that_wait_one_sample_a_batch_still_become_threads() -> None:
    data = Waiting(n=24, latency=SLOW)
    loader = ferry.DataLoader(
        data, batch_size=1, num_workers="auto", multiprocessing_context="fork"
    )
    assert [x for b in loader for x in b.tolist()] == list(range(24))
    assert loader.stats().engine == "thread"


@pytest.mark.timeout(90)
def test_a_state_taken_after_the_switch_resumes_exactly() -> None:
    def loader() -> ferry.DataLoader[Any]:
        return _auto(
            Waiting(n=120, latency=SLOW), shuffle=True, generator=torch.Generator().manual_seed(5)
        )

    def switched(first: Any) -> None:
        assert first.stats().engine == "thread"

    assert_resumes_exactly(lambda seed: loader(), at=6, round_trip=None, before_state=switched)


@pytest.mark.timeout(90)
def test_a_state_taken_after_the_switch_resumes_on_threads_from_its_first_batch() -> None:
    """What the judge found goes on in the resumed loader (a new process, after a crash): no
    process worker is started to be judged again, and the batches are the uninterrupted
    run's."""

    def loader() -> ferry.DataLoader[Any]:
        return _auto(
            Waiting(n=120, latency=SLOW), shuffle=True, generator=torch.Generator().manual_seed(5)
        )

    first = loader()
    iterator = iter(first)
    for _ in range(6):
        next(iterator)
    assert first.stats().engine == "thread"
    assert first.worker_type == "process"  # (the loader's own: moved within the epoch)
    state = json.loads(json.dumps(first.state_dict()))
    rest = [b.tolist() for b in iterator]
    resumed = loader()
    resumed.load_state_dict(state)
    assert (resumed.worker_type, resumed._threads_for_waits) == ("thread", True)
    again = iter(resumed)
    assert worker_pids(again) == [os.getpid()] * resumed.num_workers  # (threads: this process)
    assert [b.tolist() for b in again] == rest
    assert "the loaded state's tuning" in resumed.stats().tuning


@pytest.mark.timeout(90)
def test_an_error_after_the_switch_names_the_failing_sample() -> None:
    loader = _auto(Waiting(n=64, latency=SLOW, fail=frozenset({45})))
    iterator = iter(loader)
    for _ in range(5):  # keys 0..39
        next(iterator)
    with pytest.raises(KeyError, match="sample 45 is missing"):
        next(iterator)  # keys 40..47
    assert loader.stats().engine == "thread"
    del iterator
    assert _wait_no_reads() == []
    assert not [t for t in threading.enumerate() if t.name.startswith("ferry-worker-")]


@pytest.mark.timeout(90)
def test_an_async_dataset_stays_in_processes_that_await_it() -> None:
    """Its process workers look idle (the awaits run on their own loop), but they already keep
    a batch's reads in flight at once: no switch, and the batches are the sync twin's."""
    from workers.test_async_dataset import Local, Remote

    want = [b[0].tolist() for b in tud.DataLoader(Local(), batch_size=8)]
    loader = _auto(Remote())
    assert [b[0].tolist() for b in loader] == want
    assert loader.stats().engine == "process"


class Logged(Waiting):
    """Waiting, and each read appends its index to a file (shared by every process)."""

    def __init__(self, path: str, n: int) -> None:
        super().__init__(n=n, latency=SLOW)
        self.path = path

    def __getitem__(self, index: int) -> int:
        value = super().__getitem__(index)
        with open(self.path, "a") as log:
            log.write(f"{index}\n")
        return value


@pytest.mark.timeout(90)
def test_batches_the_processes_made_before_the_switch_are_not_read_again(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The judge decides when each process worker's first batch has arrived: those batches are
    handed out as made, and only batches still in the stopped processes are read again."""
    # (worker 1 starts on worker 0's word alone, however slow the machine: on a starved one
    # the word may come after HOLD_FOR, and worker 1, started then, makes batch 1 too)
    monkeypatch.setattr(switch, "HOLD_FOR", 30.0)
    path = str(tmp_path / "reads.log")
    loader = _auto(Logged(path, n=160))
    assert [x for b in loader for x in b.tolist()] == list(range(160))
    assert loader.stats().engine == "thread"
    with open(path) as log:
        reads = [int(line) for line in log]
    counts = {index: reads.count(index) for index in range(160)}
    assert all(counts[i] == 1 for i in range(16)), counts  # batches 0 and 1: made once
    assert max(counts.values()) <= 2


def test_reads_measured_elsewhere_run_at_once_from_the_first_read() -> None:
    judge = WaitJudge(batches=2)
    judge.add(0.08, 0.0008, reads=8)
    judge.add(0.08, 0.0008, reads=8)
    assert judge.per_read() == pytest.approx((0.01, 0.0001))
    reads = SampleReads(measured=judge.per_read())
    assert reads.width == 64  # the ratio (100), at most the pool: no first read alone
    assert WaitJudge(batches=1).per_read() is None
    assert SampleReads().width == 1


@pytest.mark.timeout(90)
@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
def test_thread_workers_found_bound_by_the_gil_are_processes_again(
    persistent: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The judge took the first reads' wait for every read's and made the workers threads;
    the rest computed, holding the GIL the threads share, while the loop waited: the next
    epoch has process workers again, and keeps them (the next processes' first reads wait
    too, and no judge moves them). The batches are torch's throughout, shuffled.

    Their reads take 0.8-0.9 CPU seconds a second on 2 idle cores, but about 0.5 beside three
    CPU burners (a thread that holds the GIL waits for a CPU too, which its CPU clock does not
    count): the bound is lowered here so that a loaded machine runs the same path; the bound
    itself is test_autotune.py's."""
    monkeypatch.setattr(autotune, "GIL_BOUND", 0.3)
    data = WaitsThenComputes(n=320, waits=16, work=0.002)
    # torch's batches: sample i is i, so torch's loader over the indices, with the same
    # sampler and generator (and persistent workers where ferry's persist), gives them.
    reference = tud.DataLoader(
        range(320),
        batch_size=8,
        shuffle=True,
        generator=torch.Generator().manual_seed(5),
        num_workers=1 if persistent else 0,
        persistent_workers=persistent,
    )
    want = [[b.tolist() for b in reference] for _ in range(3)]
    generator = torch.Generator().manual_seed(5)
    loader = _auto(data, shuffle=True, generator=generator, persistent_workers=persistent)
    got = [[b.tolist() for b in loader]]
    first = loader.stats()
    assert first.engine == "thread"
    assert first.read_cpu_s >= autotune.GIL_BOUND * first.read_span_s > 0
    iterator = iter(loader)
    assert loader.worker_type == "process"
    assert all(pid is not None for pid in worker_pids(iterator))
    got.append([b.tolist() for b in iterator])
    del iterator
    stats = loader.stats()
    assert stats.engine == "process"
    assert "bound by the one GIL they share" in stats.tuning
    iterator = iter(loader)
    got.append([next(iterator).tolist() for _ in range(10)])
    # A loader resumed from here (a new process, after a crash) keeps processes: the first
    # reads of its new workers wait too, and no judge moves them to threads again.
    state = loader.state_dict()
    got[-1] += [b.tolist() for b in iterator]
    del iterator
    assert loader.stats().engine == "process"
    assert loader.worker_type == "process"
    assert got == want
    resumed = _auto(
        WaitsThenComputes(n=320, waits=16, work=0.002),
        shuffle=True,
        generator=torch.Generator().manual_seed(5),
        persistent_workers=persistent,
    )
    resumed.load_state_dict(state)
    assert resumed._tuner is not None
    assert resumed._tuner.threads_refused
    assert [b.tolist() for b in resumed] == want[2][10:]
    assert resumed.stats().engine == "process"
