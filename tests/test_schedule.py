"""The worker engine's bookkeeping without workers (``ferry._engine.schedule.Scheduler``): which
worker gets which batch, which batch is handed out next, what a replaced worker is asked again.
No process or thread is started: results "arrive" when the test says so."""

from __future__ import annotations

import itertools

import torch.utils.data.dataloader as tdl
from hypothesis import given
from hypothesis import strategies as st

from _support.clock import Clock
from _support.compare import HYPOTHESIS
from _support.torch_versions import needs_torch
from ferry._engine.schedule import BALANCED_IN_FLIGHT, Scheduler, TaskId


def _fill(scheduler: Scheduler, count: int, start: int = 0) -> list[TaskId]:
    return [scheduler.assign(i, f"key{i}")[0] for i in range(start, start + count)]


def test_in_order_tasks_go_round_robin_and_come_out_by_id() -> None:
    s = Scheduler(num_workers=3, in_order=True)
    s.begin_epoch(0, turn=0)
    ids = _fill(s, 6)
    assert ids == [0, 1, 2, 3, 4, 5]
    assert [s.tasks[t].worker_id for t in ids] == [0, 1, 2, 0, 1, 2]
    assert s.in_flight == [2, 2, 2]
    s.arrived(TaskId(2))  # out of order: the loop still waits for task 0
    next_task = s.next_task()
    assert next_task is not None
    assert (next_task.index, next_task.arrived) == (0, False)
    s.arrived(TaskId(0))
    assert s.take(TaskId(0)).key == "key0"
    assert s.next_yield == 1
    assert s.in_flight == [1, 2, 1]


def test_the_round_robin_starts_at_the_turn_it_is_given() -> None:
    s = Scheduler(num_workers=3, in_order=True)
    s.begin_epoch(0, turn=2)
    ids = _fill(s, 3)
    assert [s.tasks[t].worker_id for t in ids] == [2, 0, 1]
    assert s.turn == 2


def test_out_of_order_hands_out_what_arrived_and_feeds_a_worker_below_its_share() -> None:
    s = Scheduler(num_workers=2, in_order=False)
    s.begin_epoch(0, turn=0)
    _fill(s, 4)  # workers 0, 1, 0, 1
    assert s.first_arrived() is None
    s.arrived(TaskId(3))
    assert s.first_arrived() == 3
    s.take(TaskId(3))
    assert s.next_yield == 0  # (task 0 is still the next in order)
    task_id, task = s.assign(4, "key4")
    # Worker 0's turn, but it holds its share (2 of the 4 out): passed over, as torch does.
    assert (task_id, task.worker_id) == (4, 1)
    s.arrived(TaskId(0))
    s.take(TaskId(0))
    s.arrived(TaskId(1))
    s.take(TaskId(1))
    s.arrived(TaskId(2))
    s.take(TaskId(2))
    # Task 3 was handed out already: the next in order is 4.
    next_task = s.next_task()
    assert next_task is not None
    assert next_task.index == 4


def test_out_of_order_goes_to_the_next_in_turn_below_its_share_not_to_the_least_busy() -> None:
    """torch's dispatch with ``in_order=False`` (``_try_put_index``): round the workers from the
    turn, passing over those that hold ``prefetch_factor * num_workers // active`` tasks; the
    turn moves past each one looked at. Not the least busy worker: worker 0, below its share
    and next in turn, gets the task although worker 1 holds none."""
    s = Scheduler(num_workers=3, in_order=False)
    s.begin_epoch(0, turn=0, depth=6)  # (prefetch_factor 2)
    ids = _fill(s, 6)
    assert [s.tasks[t].worker_id for t in ids] == [0, 1, 2, 0, 1, 2]
    for done in (0, 1, 4):  # worker 0 answers one, worker 1 both of its tasks
        s.arrived(TaskId(done))
        s.take(TaskId(done))
    assert s.in_flight == [1, 0, 2]
    assert s.turn == 0
    picked = [s.assign(i, f"key{i}")[1].worker_id for i in range(6, 9)]
    # 6: worker 0 (1 < 2); 7: worker 1 (0 < 2); 8: worker 2 holds 2 and worker 0 now 2, so
    # both are passed over, and worker 1 (1 < 2) gets it.
    assert picked == [0, 1, 1]
    assert s.in_flight == [2, 2, 2]


def test_out_of_order_share_grows_as_streams_end() -> None:
    """The share is of the workers still active: with one of two streams ended, the other may
    hold the whole prefetch window."""
    s = Scheduler(num_workers=2, in_order=False)
    s.begin_epoch(0, turn=0, depth=4)
    ids = _fill(s, 2)  # worker 0, worker 1
    s.stream_ended(1, ids[1])
    picked = [s.assign(i, f"key{i}")[1].worker_id for i in range(2, 5)]
    assert picked == [0, 0, 0]
    assert s.in_flight == [4, 0]


def test_a_worker_whose_stream_ended_gets_no_more_tasks_and_its_tasks_are_skipped() -> None:
    s = Scheduler(num_workers=2, in_order=True)
    s.begin_epoch(0, turn=0)
    _fill(s, 4)  # 0:w0 1:w1 2:w0 3:w1
    s.stream_ended(1, TaskId(1))
    # Task 3 of worker 1 will never come: skipped when its turn comes.
    assert [s.tasks[t].worker_id for t in _fill(s, 2, start=4)] == [0, 0]
    for task_id in (0, 2):
        s.arrived(TaskId(task_id))
        assert s.next_task() is s.tasks[TaskId(task_id)]
        s.take(TaskId(task_id))
    s.arrived(TaskId(4))
    next_task = s.next_task()
    assert next_task is not None
    assert next_task.index == 4  # tasks 1 and 3 skipped
    s.stream_ended(0, TaskId(5))
    s.take(TaskId(4))
    assert not s.can_assign()
    assert s.next_task() is None  # the epoch is over


def test_a_replaced_worker_is_asked_again_for_what_had_not_arrived_in_order() -> None:
    s = Scheduler(num_workers=2, in_order=True)
    s.begin_epoch(0, turn=0)
    _fill(s, 6)  # worker 0: 0, 2, 4
    s.arrived(TaskId(2))
    assert s.unfinished(0) == [0, 4]
    assert s.holding() == [0, 1]
    assert [t for t, _ in s.pending()] == [0, 1, 3, 4, 5]


def test_results_of_an_abandoned_epoch_are_told_apart_by_their_id() -> None:
    s = Scheduler(num_workers=2, in_order=True)
    s.begin_epoch(0, turn=0)
    _fill(s, 4)
    s.begin_epoch(0, turn=1)  # the next epoch begins before these arrive
    assert s.stale(3)
    assert not s.stale(4)
    task_id, task = s.assign(0, "key0")
    assert (task_id, task.index, task.worker_id) == (4, 0, 1)


def test_a_resumed_epoch_numbers_its_tasks_from_its_first_batch() -> None:
    s = Scheduler(num_workers=2, in_order=True)
    s.begin_epoch(5, turn=1)  # resumed: batches 0-4 were handed out before the save
    task_id, task = s.assign(5, "key5")
    assert task.index == 5
    assert task_id == s.first == s.next_yield
    assert s.next_task() is task


def test_replacing_every_worker_keeps_what_arrived_when_asked() -> None:
    s = Scheduler(num_workers=2, in_order=True)
    s.begin_epoch(0, turn=0)
    _fill(s, 4)
    s.arrived(TaskId(0)).result = "batch0"
    s.arrived(TaskId(1)).result = "batch1"
    assert s.reassign_all(keep_arrived=True) == [2, 3]
    assert s.in_flight == [1, 1]
    assert s.tasks[TaskId(0)].result == "batch0"
    again = s.reassign_all(keep_arrived=False)
    assert again == [0, 1, 2, 3]
    assert s.tasks[TaskId(0)].result is None
    assert not s.tasks[TaskId(0)].arrived
    assert s.in_flight == [2, 2]


# -- balance_workers=True ------------------------------------------------------------------------


def test_balanced_workers_hold_at_most_two_unanswered_tasks() -> None:
    s = Scheduler(num_workers=3, in_order=True, balance=True)
    s.begin_epoch(0, turn=0)
    ids = []
    while s.can_assign():
        ids.append(s.assign(len(ids), f"key{len(ids)}")[0])
    # No pace is known yet: the workers take turns, up to BALANCED_IN_FLIGHT each.
    assert [s.tasks[t].worker_id for t in ids] == [0, 1, 2, 0, 1, 2]
    assert s.in_flight == [BALANCED_IN_FLIGHT] * 3
    s.arrived(TaskId(4))  # worker 1 answered: it, and only it, can take one more
    assert s.can_assign()
    assert s.assign(6, "key6")[1].worker_id == 1
    assert not s.can_assign()
    # Handing out stays in order: task 0 first, though task 4 came first.
    next_task = s.next_task()
    assert next_task is not None
    assert next_task.index == 0


def test_balanced_task_goes_to_the_worker_that_would_finish_it_first() -> None:
    s = Scheduler(num_workers=2, in_order=True, balance=True)
    assert s.pace is not None
    s.pace.clock = Clock()
    s.begin_epoch(0, turn=0)
    for worker, seconds in ((0, 9.0), (1, 9.0), (0, 0.4), (1, 0.1)):
        s.pace.record(worker, seconds)  # (each worker's first batch, 9 s, is not counted)
    assert s.pace.seconds == [0.4, 0.1]
    a = s.assign(0, "key0")[1]
    b = s.assign(1, "key1")[1]
    c = s.assign(2, "key2")[1]
    # Worker 1 would finish one task at 0.1 s, two at 0.2 s, before worker 0 finishes one.
    assert [a.worker_id, b.worker_id] == [1, 1]
    # Worker 1 holds two unanswered: the next goes to worker 0, the only one that may take one.
    assert c.worker_id == 0
    assert not s.can_assign()  # (worker 1 would still finish first: the task waits for it)
    s.arrived(TaskId(0))
    assert s.assign(3, "key3")[1].worker_id == 1


def test_a_balanced_worker_nearly_done_with_its_task_gets_the_next() -> None:
    """Equal paces, one task each: the worker whose task began earlier is free sooner."""
    s = Scheduler(num_workers=2, in_order=True, balance=True)
    assert s.pace is not None
    clock = s.pace.clock = Clock()
    s.begin_epoch(0, turn=0)
    s.pace.seconds = [1.0, 1.0]
    assert s.assign(0, "key0")[1].worker_id == 0  # began at 100.0
    clock.now = 100.9
    assert s.assign(1, "key1")[1].worker_id == 1  # began at 100.9
    clock.now = 100.95
    # Worker 0 is free at 101.0, worker 1 at 101.9: the task goes to worker 0.
    assert s.assign(2, "key2")[1].worker_id == 0
    # Worker 0 now holds two (free at 102.0); worker 1 is free at 101.9.
    assert s.assign(3, "key3")[1].worker_id == 1
    assert not s.can_assign()
    clock.now = 101.0
    s.arrived(TaskId(0))  # worker 0 answered: its second task begins now
    assert s.assign(4, "key4")[1].worker_id == 0  # (free at 102.0, worker 1 at 102.9)


def test_a_balanced_worker_found_slow_is_tried_again_later() -> None:
    """A worker passed over while it has nothing to do has its pace lowered each time, so a
    slowness of the moment (a burst of load on its CPU) does not keep it idle for good."""
    s = Scheduler(num_workers=2, in_order=True, balance=True)
    assert s.pace is not None
    s.pace.clock = Clock()
    s.begin_epoch(0, turn=0)
    for worker, seconds in ((0, 1.0), (0, 1.0), (1, 1.0), (1, 0.1)):
        s.pace.record(worker, seconds)
    workers = []
    for index in range(40):
        task_id, task = s.assign(index, index)
        workers.append(task.worker_id)
        s.arrived(task_id)
        s.take(task_id)
    assert workers.count(1) > workers.count(0) >= 1
    assert workers.index(0) > 10  # (ten times slower: passed over at first)


def test_without_balance_the_pace_is_not_kept() -> None:
    s = Scheduler(num_workers=2, in_order=True)
    s.begin_epoch(0, turn=0)
    assert s.pace is None
    ids = _fill(s, 4)
    s.arrived(ids[1], made_s=0.1)  # (a pace given without balance is not kept)
    assert s.pace is None
    assert [s.tasks[t].worker_id for t in ids] == [0, 1, 0, 1]


class _TorchDispatch:
    """The state torch's ``_MultiProcessingDataLoaderIter._try_put_index`` reads and writes,
    with no workers: torch's own method, called on this, is the oracle of which worker gets
    each task (``_next_index`` stands in for the sampler; the queues record the worker)."""

    def __init__(self, num_workers: int, prefetch_factor: int) -> None:
        self._num_workers = num_workers
        self._prefetch_factor = prefetch_factor
        self._in_order = False
        self._tasks_outstanding = 0
        self._send_idx = 0
        self._task_info: dict[int, tuple[int]] = {}
        self._workers_status = [True] * num_workers
        self._workers_num_tasks = [0] * num_workers
        self._worker_queue_idx_cycle = itertools.cycle(range(num_workers))
        self._index_queues = [_Queue() for _ in range(num_workers)]

    def _next_index(self) -> int:
        return self._send_idx

    def put(self) -> int:
        """torch's dispatch of one task; the worker it went to."""
        tdl._MultiProcessingDataLoaderIter._try_put_index(self)  # type: ignore[arg-type]
        return self._task_info[self._send_idx - 1][0]

    def hand_out(self, task: int) -> None:
        """What torch does with a result as it hands it out (``_next_data`` receiving it, then
        ``_process_data``), without the put that follows."""
        worker = self._task_info.pop(task)[0]
        self._tasks_outstanding -= 1
        self._workers_num_tasks[worker] -= 1


class _Queue:
    def put(self, item: object) -> None:
        pass


@needs_torch("2.9", "the dispatch of DataLoader(in_order=False)")
@HYPOTHESIS
@given(
    workers=st.integers(1, 5),
    prefetch=st.integers(1, 4),
    steps=st.lists(st.tuples(st.booleans(), st.integers(0, 1_000)), min_size=1, max_size=80),
)
def test_out_of_order_assignment_is_torchs_over_generated_arrivals(
    workers: int, prefetch: int, steps: list[tuple[bool, int]]
) -> None:
    """``in_order=False`` with torch's own dispatch as the oracle. The window is filled; then,
    in a generated order, results arrive (any task not arrived yet: the main process may have
    several waiting) and are handed out (the lowest arrived first), a new task after each hand
    out. A task counts against its worker until it is handed out, as in torch, where a result
    is received only when it is handed out. Every task goes to the worker torch's
    ``_try_put_index`` sends it to."""
    torch_side = _TorchDispatch(workers, prefetch)
    s = Scheduler(num_workers=workers, in_order=False)
    s.begin_epoch(0, turn=0, depth=prefetch * workers)
    want = [torch_side.put() for _ in range(prefetch * workers)]
    got = [s.assign(i, i)[1].worker_id for i in range(prefetch * workers)]
    for hand_out, pick in steps:
        waiting = sorted(t for t, task in s.tasks.items() if not task.arrived)
        if waiting and not (hand_out and s.first_arrived() is not None):
            s.arrived(waiting[pick % len(waiting)])
            continue
        task = s.first_arrived()
        assert task is not None
        s.take(task)
        torch_side.hand_out(task)
        got.append(s.assign(len(got), len(got))[1].worker_id)
        want.append(torch_side.put())
    assert got == want
