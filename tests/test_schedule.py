"""The worker engine's bookkeeping without workers (``ferry._engine.schedule.Scheduler``): which
worker gets which batch, which batch is handed out next, what a replaced worker is asked again.
No process or thread is started: results "arrive" when the test says so."""

from __future__ import annotations

from ferry._engine.schedule import Scheduler, TaskId


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


def test_out_of_order_hands_out_what_arrived_and_feeds_the_least_busy_worker() -> None:
    s = Scheduler(num_workers=2, in_order=False)
    s.begin_epoch(0, turn=0)
    _fill(s, 4)  # workers 0, 1, 0, 1
    assert s.first_arrived() is None
    s.arrived(TaskId(3))
    assert s.first_arrived() == 3
    s.take(TaskId(3))
    assert s.next_yield == 0  # (task 0 is still the next in order)
    task_id, task = s.assign(4, "key4")
    assert (task_id, task.worker_id) == (4, 1)  # worker 1 has one task in flight, worker 0 two
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
