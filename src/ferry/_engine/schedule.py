"""Which worker makes which batch, and which batch is handed out next: the worker engine's
bookkeeping, with no transport, so it is tested without starting a process or a thread.

A *task* is one batch asked of a worker. Its :data:`TaskId` numbers tasks across epochs (a late
result of an abandoned epoch is told apart by its id: ids below :attr:`Scheduler.first` are
stale); its ``index`` is the batch's number within the epoch (the key's number, what the cursor
counts). :meth:`Scheduler.assign` picks the worker as torch does: round-robin over the workers
whose stream has not ended (``in_order=True``), or the least busy of them (``in_order=False``);
at most ``prefetch_factor`` tasks a worker are in flight, and the engine assigns one new task
per batch handed out. :meth:`Scheduler.next_task` says which task is handed out next: in order,
the lowest id not handed out yet (skipping those of ended streams); out of order, any that has
arrived, the lowest first.

The engine (``pool.py``) asks the keys, sends the tasks, reads the results and records them on
the :class:`Task`; a restart asks :meth:`Scheduler.unfinished` which tasks to send again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NewType

from ferry._engine.position.cursor import WorkerCursor
from ferry._engine.work.fetch import Outcome

__all__ = ["Scheduler", "Task", "TaskId"]

TaskId = NewType("TaskId", int)


@dataclass
class Task:
    """A batch asked of a worker, until it is handed to the user."""

    worker_id: int
    key: Any
    index: int  # the batch's number in the epoch (its key's)
    result: Any = None
    arrived: bool = False
    error: BaseException | None = None
    fatal: bool = False  # the error ends the iterator (its worker could not start)
    position: WorkerCursor | None = None  # the worker's, after this batch
    outcome: Outcome | None = None  # on_error="skip": samples tried and dropped
    sent: float = 0.0  # time.perf_counter() when it was handed to the worker (stall reports)

    def forget_result(self) -> None:
        """The result will not come (its worker was replaced): the task is asked again."""
        self.arrived, self.result, self.error, self.outcome = False, None, None, None


class Scheduler:
    """Tasks, the worker each is assigned to, and the order they are handed out in (see the
    module docstring)."""

    def __init__(self, num_workers: int, in_order: bool) -> None:
        self.num_workers = num_workers
        self.in_order = in_order
        self.tasks: dict[TaskId, Task] = {}
        self.next_id = TaskId(0)  # the id the next task gets
        self.first = TaskId(0)  # the epoch's first id: lower ids are an abandoned epoch's
        self.next_yield = TaskId(0)  # in order: the id handed out next
        self._base = 0  # the id of the epoch's batch index 0
        self.in_flight = [0] * num_workers
        self.active = [True] * num_workers  # False: the worker's stream ended
        self._turn = 0
        self.keys_done = False  # the epoch's keys ran out: no task is left to assign

    # -- epochs ------------------------------------------------------------------------------------

    def begin_epoch(self, next_index: int, turn: int) -> None:
        """A new epoch, whose next batch index is ``next_index`` (not 0 when it resumes), with
        worker ``turn`` next in the round-robin."""
        self.tasks = {}
        self.first = self.next_yield = self.next_id
        self._base = self.next_id - next_index
        self.in_flight = [0] * self.num_workers
        self.active = [True] * self.num_workers
        self._turn = turn
        self.keys_done = False

    def stale(self, task_id: int) -> bool:
        """A result for a task of an abandoned epoch."""
        return task_id < self.first

    @property
    def turn(self) -> int:
        """The worker next in the round-robin."""
        return self._turn

    # -- assigning ---------------------------------------------------------------------------------

    def can_assign(self) -> bool:
        """Some worker's stream has not ended."""
        return any(self.active)

    def assign(self, index: int, key: Any, sent: float = 0.0) -> tuple[TaskId, Task]:
        """Record batch ``index`` of the epoch (``key``) as a task of the worker it goes to."""
        worker_id = self._pick_worker()
        task_id = TaskId(self._base + index)
        self.next_id = TaskId(task_id + 1)
        task = Task(worker_id, key, index, sent=sent)
        self.tasks[task_id] = task
        self.in_flight[worker_id] += 1
        return task_id, task

    def _next_turn(self) -> int:
        candidate = self._turn
        self._turn = (candidate + 1) % self.num_workers
        return candidate

    def _pick_worker(self) -> int:
        if self.in_order:
            for _ in range(self.num_workers):
                candidate = self._next_turn()
                if self.active[candidate]:
                    return candidate
        active = [w for w in range(self.num_workers) if self.active[w]]
        least = min(self.in_flight[w] for w in active)
        for _ in range(self.num_workers):
            candidate = self._next_turn()
            if self.active[candidate] and self.in_flight[candidate] == least:
                return candidate
        return active[0]

    # -- results -----------------------------------------------------------------------------------

    def arrived(self, task_id: TaskId) -> Task:
        """The worker answered ``task_id`` (a batch or an error, recorded by the caller)."""
        task = self.tasks[task_id]
        self.in_flight[task.worker_id] -= 1
        task.arrived = True
        return task

    def stream_ended(self, worker_id: int, task_id: TaskId) -> None:
        """Worker ``worker_id``'s stream had nothing for ``task_id``: it gets no more tasks."""
        self.in_flight[worker_id] -= 1
        self.active[worker_id] = False
        self.tasks.pop(task_id, None)  # (already skipped if its turn came first)

    # -- handing out -------------------------------------------------------------------------------

    def next_task(self) -> Task | None:
        """The task handed out next in order, skipping those handed out already (out of order)
        and those of workers whose stream ended; None when the epoch is over."""
        while self.next_yield < self.next_id:
            task = self.tasks.get(self.next_yield)
            if task is not None and (task.arrived or self.active[task.worker_id]):
                return task
            self.tasks.pop(self.next_yield, None)
            self.next_yield = TaskId(self.next_yield + 1)
        return None

    def first_arrived(self) -> TaskId | None:
        """Out of order: the lowest task that has arrived, if any."""
        return next((t for t, task in self.tasks.items() if task.arrived), None)

    def take(self, task_id: TaskId) -> Task:
        """Hand task ``task_id`` out (its result goes to the user)."""
        task = self.tasks.pop(task_id)
        if task_id == self.next_yield:
            self.next_yield = TaskId(self.next_yield + 1)
        return task

    # -- workers that go ---------------------------------------------------------------------------

    def unfinished(self, worker_id: int) -> list[TaskId]:
        """The tasks of ``worker_id`` that have not arrived, in order: what a worker started in
        its place is asked again."""
        return sorted(
            t for t, task in self.tasks.items() if task.worker_id == worker_id and not task.arrived
        )

    def holding(self) -> list[int]:
        """The workers with tasks that have not arrived."""
        return sorted({task.worker_id for task in self.tasks.values() if not task.arrived})

    def pending(self) -> list[tuple[TaskId, Task]]:
        """The tasks that have not arrived, with their ids."""
        return [(t, task) for t, task in self.tasks.items() if not task.arrived]

    def reassign_all(self, keep_arrived: bool) -> list[TaskId]:
        """Every worker was replaced (``num_workers="auto"``'s move to threads): the tasks not
        handed out are asked again of the new worker with the same id, in order, except, with
        ``keep_arrived``, those whose result is here already."""
        self.in_flight = [0] * self.num_workers
        again = []
        for task_id in sorted(self.tasks):
            task = self.tasks[task_id]
            if task.arrived and keep_arrived:
                continue
            task.forget_result()
            self.in_flight[task.worker_id] += 1
            again.append(task_id)
        return again
