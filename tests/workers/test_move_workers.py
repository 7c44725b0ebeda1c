"""``move_workers``: process workers trade CPUs while an epoch runs (``crew/placement.py``), so
that on CPUs of unequal speed none stays on the slowest. Nothing else may change: the same
batches in torch's order, a worker someone placed stays where it was put, nothing moves between
epochs, and the thread that moves them ends with the workers."""

from __future__ import annotations

import gc
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import ferry
from _support.processes import poll
from ferry._engine.crew import placement
from ferry._engine.crew.placement import WorkerMover, _stat, numa_nodes, should_move

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.skipif(
        not should_move(True, "process", 2), reason="needs Linux's sched_setaffinity and 2 CPUs"
    ),
]

ALL = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()


def _spin(stop: Any) -> None:
    while not stop.is_set():
        sum(range(1000))


def _sleep(stop: Any) -> None:
    stop.wait(60)


def _children(target: Callable[[Any], None]) -> Iterator[list[int]]:
    """Two child processes running ``target(stop)`` (their pids), stopped after the test."""
    context = multiprocessing.get_context("fork")
    stop = context.Event()
    children = [context.Process(target=target, args=(stop,), daemon=True) for _ in range(2)]
    for child in children:
        child.start()
    yield [child.pid for child in children if child.pid is not None]
    stop.set()
    for child in children:
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join(5)


@pytest.fixture
def spinners() -> Iterator[list[int]]:
    """Two busy child processes."""
    yield from _children(_spin)


@pytest.fixture
def sleepers() -> Iterator[list[int]]:
    """Two idle child processes."""
    yield from _children(_sleep)


def _moved(mover: WorkerMover, at_least: int = 2, within: float = 10.0) -> bool:
    return poll(lambda: mover.moves >= at_least, within)


@pytest.mark.timeout(30)
def test_workers_trade_cpus_and_are_left_free(spinners: list[int]) -> None:
    mover = WorkerMover(lambda: spinners, period_s=0.01)
    try:
        assert mover.moves == 0  # (not before resume)
        mover.resume()
        assert _moved(mover)
        mover.pause()
        time.sleep(0.05)
        still = mover.moves
        # Free again after each move: the scheduler keeps its say.
        assert all(os.sched_getaffinity(pid) == ALL for pid in spinners)
        time.sleep(0.1)
        assert mover.moves == still  # paused: nothing moves between epochs
        mover.resume()
        assert _moved(mover, still + 2)
    finally:
        mover.close()
    assert not mover.thread.is_alive()


@pytest.mark.timeout(30)
def test_idle_workers_stay_put_and_are_looked_at_less_often(sleepers: list[int]) -> None:
    """An epoch left unfinished, or a training step slower than the loader: workers that wait
    are not moved (it would give nothing), and the looks slow down to one a second."""
    mover = WorkerMover(lambda: sleepers, period_s=0.01)
    mover.resume()
    try:
        assert poll(lambda: mover._delay == 1.0, 10)
        assert mover.moves == 0
        mover.pause()
        mover.resume()
        assert mover._delay == 0.01  # (a new epoch: looked at at the period again)
    finally:
        mover.close()


@pytest.mark.timeout(30)
def test_a_worker_someone_placed_is_left_where_it_was_put(spinners: list[int]) -> None:
    cpu = min(ALL)
    os.sched_setaffinity(spinners[0], {cpu})
    mover = WorkerMover(lambda: spinners, period_s=0.01)
    mover.resume()
    try:
        time.sleep(0.3)
        assert os.sched_getaffinity(spinners[0]) == {cpu}
        assert mover.moves == 0  # (one worker left to move: no one to trade with)
    finally:
        mover.close()
    assert os.sched_getaffinity(spinners[0]) == {cpu}


@pytest.mark.timeout(30)
def test_workers_trade_cpus_within_their_numa_node_only(spinners: list[int]) -> None:
    mover = WorkerMover(lambda: spinners, period_s=0.01)
    # Each CPU its own node: no two workers share one, so none may trade.
    mover._nodes = {cpu: cpu for cpu in ALL}
    mover.resume()
    try:
        time.sleep(0.3)
        assert mover.moves == 0
        mover._nodes = dict.fromkeys(ALL, 0)
        assert _moved(mover)
    finally:
        mover.close()


@pytest.mark.timeout(30)
def test_rotation_pins_each_worker_and_frees_it_when_paused(
    spinners: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(placement, "MODE", "rotate")
    mover = WorkerMover(lambda: spinners, period_s=0.01)
    mover.resume()
    try:
        assert _moved(mover)
        assert all(len(os.sched_getaffinity(pid)) == 1 for pid in spinners)
        assert os.sched_getaffinity(spinners[0]) != os.sched_getaffinity(spinners[1])
        mover.pause()
        assert poll(lambda: all(os.sched_getaffinity(pid) == ALL for pid in spinners), 5)
    finally:
        mover.close()
    assert all(os.sched_getaffinity(pid) == ALL for pid in spinners)


def test_what_the_system_says_is_read() -> None:
    cpu, used = _stat(os.getpid())
    assert cpu in ALL
    assert used > 0  # (the clock ticks this process has run: importing torch is many)
    with pytest.raises(OSError):
        _stat(2**22 + 1)  # (above the kernel's largest pid)
    nodes = numa_nodes(ALL)
    assert set(nodes) == ALL
    assert all(node >= 0 for node in nodes.values())


class Where(tud.Dataset[Any]):
    """Sample ``i``: ``[i, pid, how many CPUs it may run on]``, after some computing."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        began = time.perf_counter()
        while time.perf_counter() - began < 0.01:
            pass
        return torch.tensor([i, os.getpid(), len(os.sched_getaffinity(0))])


def _pin_to_first_cpu(worker_id: int) -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def _mover(loader: Any) -> WorkerMover | None:
    mover: WorkerMover | None = loader._iterator._crew.group.mover
    return mover


@pytest.mark.timeout(60)
def test_moved_workers_make_torchs_batches_and_stop_between_epochs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (a move needs the two workers last seen on two CPUs: many looks, on a busy machine)
    monkeypatch.setattr(placement, "PERIOD_S", 0.002)
    options: dict[str, Any] = {"batch_size": 4, "shuffle": True, "num_workers": 2}
    options["persistent_workers"] = True
    seed = torch.Generator().manual_seed(3)
    ours = ferry.DataLoader(Where(), generator=seed, move_workers=True, **options)
    theirs = tud.DataLoader(Where(), generator=torch.Generator().manual_seed(3), **options)
    for _ in range(2):
        got = torch.cat(list(ours))
        assert got[:, 0].tolist() == torch.cat(list(theirs))[:, 0].tolist()
        mover = _mover(ours)
        assert mover is not None
        assert mover.moves > 0
        assert not mover._active  # (the epoch ended: nothing moves until the next one)
        assert mover.thread.is_alive()
    pids = {w.pid for w in ours._iterator._crew.workers}
    assert set(got[:, 1].tolist()) == pids  # (each worker made its turns: 2 processes)
    del ours
    assert poll(lambda: not mover.thread.is_alive(), 10)


@pytest.mark.timeout(60)
def test_workers_that_do_not_persist_take_the_mover_with_them() -> None:
    loader = ferry.DataLoader(Where(), batch_size=4, num_workers=2, move_workers=True)
    iterator = iter(loader)
    next(iterator)
    mover = iterator._crew.group.mover  # type: ignore[attr-defined]
    assert mover is not None
    list(iterator)
    assert poll(lambda: not mover.thread.is_alive(), 10)


@pytest.mark.timeout(60)
def test_a_worker_init_fn_that_pins_its_worker_is_obeyed() -> None:
    loader = ferry.DataLoader(
        Where(), batch_size=4, num_workers=2, worker_init_fn=_pin_to_first_cpu, move_workers=True
    )
    got = torch.cat(list(loader))
    assert set(got[:, 2].tolist()) == {1}  # every sample made on the one CPU it was given


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "options",
    [
        {"move_workers": False, "num_workers": 2},
        {"num_workers": 2, "worker_type": "thread"},
        {"num_workers": 1},
        {"num_workers": 0},
    ],
    ids=["off", "threads", "one-worker", "main-process"],
)
def test_nothing_moves_where_it_is_off_or_cannot_help(options: dict[str, Any]) -> None:
    loader = ferry.DataLoader(Where(), batch_size=4, **options)
    seen: set[str] = set()
    for _ in loader:
        seen.update(t.name for t in threading.enumerate())
    assert "ferry-move" not in seen


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"move_workers": "yes", "num_workers": 2}, TypeError, "move_workers must be None"),
        ({"move_workers": 1, "num_workers": 2}, TypeError, "got 1"),
        ({"move_workers": True}, ValueError, "needs num_workers > 0"),
        (
            {"move_workers": True, "num_workers": 2, "worker_type": "thread"},
            ValueError,
            "needs worker_type='process'",
        ),
    ],
)
def test_bad_values_are_refused_by_name(options: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ferry.DataLoader(range(8), **options)


@pytest.mark.parametrize(
    "case",
    [
        (None, "process", 15, 16, True),  # a CPU for each worker, one for the main process
        (None, "process", 8, 16, True),
        (None, "process", 16, 16, False),  # as many workers as CPUs: the scheduler shares
        (None, "process", 2, 2, False),  # (this dev machine's, and CI's)
        (True, "process", 2, 2, True),
        (True, "process", 32, 16, True),
        (False, "process", 8, 16, False),
        (None, "process", 1, 16, False),  # one worker: no one to trade places with
        (True, "thread", 8, 16, False),
        (True, "process", 2, 1, False),  # one CPU
    ],
)
def test_ferry_moves_workers_where_each_can_have_a_cpu_or_where_asked(
    monkeypatch: pytest.MonkeyPatch, case: tuple[bool | None, str, int, int, bool]
) -> None:
    option, worker_type, workers, cpus, moves = case
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert should_move(option, worker_type, workers) is moves


def test_the_option_is_kept_as_an_attribute() -> None:
    assert ferry.DataLoader(range(8)).move_workers is None
    assert ferry.DataLoader(range(8), num_workers=2, move_workers=False).move_workers is False


# -- "even": those behind to the fastest CPUs ------------------------------------------------


def _evening(made: dict[int, int], speeds: dict[int, float]) -> placement._Evening:
    """An evening whose workers (by pid) made ``made`` samples this epoch, on CPUs of
    ``speeds``."""
    evening = placement._Evening(lambda: {pid: (count, 0) for pid, count in made.items()})
    evening.began = dict.fromkeys(made, 0)
    evening.last = dict(made)
    evening.speeds = dict(speeds)
    return evening


def test_the_workers_furthest_behind_go_to_the_fastest_cpus() -> None:
    evening = _evening({10: 30, 11: 10, 12: 20}, {0: 100.0, 1: 50.0, 2: 200.0})
    moves = evening.assign([(10, 0, 5), (11, 1, 5), (12, 2, 5)], set())
    assert dict(moves) == {10: 1, 11: 2, 12: 0}
    assert evening.put == {10: 1, 11: 2, 12: 0}  # (where each was put: read at the next look)


def test_behind_is_what_was_asked_of_a_worker_and_not_made_yet() -> None:
    """Batches of different sizes (a sampler that buckets by length): the worker that made the
    most samples may still owe the most, and it is the one the epoch waits for."""
    evening = _evening({10: 30, 11: 10}, {0: 100.0, 1: 50.0})
    evening.owed = {10: 90, 11: 20}
    assert dict(evening.assign([(10, 1, 5), (11, 0, 5)], set())) == {10: 0, 11: 1}


@pytest.mark.parametrize(
    ("key", "samples"),
    [
        ([3, 1, 2], 3),
        (torch.arange(4), 4),
        (torch.tensor(5), 1),  # (a key of its own, batch_size=None: a 0-d tensor has no len)
        (7, 1),
        ("a-key", 1),
        (None, 1),
    ],
)
def test_what_a_worker_is_asked_for_is_counted_in_samples(key: Any, samples: int) -> None:
    tally = placement.Tally.new(2)
    try:
        tally.asked(1, key)
        assert tally.sent == [0, samples]
        tally.new_epoch()
        assert tally.sent == [0, 0]
    finally:
        tally.close()


def test_cpus_idle_workers_left_are_given_to_those_still_at_work() -> None:
    """The end of an epoch: the workers done with their share left their CPUs free; the last
    one at work goes to the fastest CPU there is, not only among the busy ones'."""
    evening = _evening({10: 3, 11: 9}, {0: 50.0, 1: 90.0, 5: 300.0, 6: 20.0})
    moves = evening.assign([(10, 0, 5), (11, 1, 5)], {5, 6})
    assert moves == [(10, 5)]  # (11 stays on 1, the next fastest)
    assert evening.put == {10: 5, 11: 1}
    assert evening.assign([(10, 5, 5)], {0, 1, 6}) == []  # (already on the fastest)


def test_without_counts_or_speeds_the_workers_still_trade_places() -> None:
    """An iterable dataset, ``__getitems__``: nothing counted, no speed known; the order turns
    each look, so each worker runs on each CPU in turn, as with ``MODE = "swap"``."""
    evening = _evening({10: 0, 11: 0, 12: 0}, {})
    where = {10: 0, 11: 1, 12: 2}
    seen: dict[int, set[int]] = {pid: set() for pid in where}
    for _ in range(3):
        evening.read({})
        where.update(evening.assign([(pid, cpu, 5) for pid, cpu in where.items()], set()))
        for pid, cpu in where.items():
            seen[pid].add(cpu)
    assert all(cpus == {0, 1, 2} for cpus in seen.values())


def test_a_cpus_speed_is_read_from_a_worker_that_stayed_on_it_all_the_while() -> None:
    counts = {10: 100, 11: 100, 12: 100}
    evening = placement._Evening(lambda: {pid: (count, 0) for pid, count in counts.items()})
    evening.begin()
    evening.read({})  # (the epoch's first look: counts start here)
    evening.put = {10: 0, 11: 1, 12: 2}
    evening.at -= 0.1  # (the last look, 100 ms ago)
    counts.update({10: 130, 11: 110, 12: 130})
    ticks = round(0.1 / evening.TICK_S)
    # 10 stayed on CPU 0 and computed all the while: CPU 0 made 300 samples a second. 11 was
    # moved on by the scheduler (now on 3), 12 computed a tenth of the while: neither is read.
    evening.read({0: [(10, 0, ticks), (11, 3, ticks), (12, 2, 1)]})
    assert set(evening.speeds) == {0}
    assert evening.speeds[0] == pytest.approx(300, rel=0.2)
    evening.put = {10: 0}
    evening.at -= 0.1
    counts[10] += 10  # (100 a second now: the reading moves the speed by SPEED_WEIGHT)
    evening.read({0: [(10, 0, ticks)]})
    assert evening.speeds[0] == pytest.approx(300 - placement.SPEED_WEIGHT * 200, rel=0.2)
    assert evening._made(10) == 40  # (since the epoch's first look)
    evening.begin()
    assert evening._made(10) == 0  # (a new epoch)
    assert evening.speeds  # (the speeds are kept)


class Batched(Where):
    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        return [self[i] for i in indices]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("dataset", "context", "counted"),
    [
        (Where(), "fork", True),
        (Batched(), "fork", False),
        (Where(), "spawn", True),
        (Where(), "forkserver", True),
    ],
    ids=["one-by-one", "getitems", "spawn", "forkserver"],
)
def test_workers_count_their_samples_for_the_mover(
    dataset: Any, context: str, counted: bool
) -> None:
    """Each worker counts the samples it makes one by one (``__getitems__``: not counted, the
    mover trades places as before), forked or given the counts' descriptor as it starts."""
    loader = ferry.DataLoader(
        dataset,
        batch_size=4,
        num_workers=2,
        move_workers=True,
        persistent_workers=True,
        multiprocessing_context=context,
    )
    for epoch in range(1, 3):
        got = torch.cat(list(loader))
        assert sorted(got[:, 0].tolist()) == list(range(48))
        group = loader._iterator._crew.group
        assert group.mover is not None
        assert group.mover._mode == "even"
        made = {w.worker_id: (got[:, 1] == w.pid).sum().item() for w in group.workers}
        counts = list(group.tally.counts)
        assert counts == ([epoch * made[0], epoch * made[1]] if counted else [0, 0])
        assert group.tally.sent == [made[0], made[1]]  # (asked of each this epoch)
    tally = group.tally
    del loader, got, group
    gc.collect()
    assert not tally._closed or not tally._closed.alive  # (its descriptor went with the workers)
