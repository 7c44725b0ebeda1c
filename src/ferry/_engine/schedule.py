"""Which worker makes which batch, and which batch is handed out next: the worker engine's
bookkeeping, with no transport, so it is tested without starting a process or a thread.

A *task* is one batch asked of a worker. Its :data:`TaskId` numbers tasks across epochs (a late
result of an abandoned epoch is told apart by its id: ids below :attr:`Scheduler.first` are
stale); its ``index`` is the batch's number within the epoch (the key's number, what the cursor
counts). :meth:`Scheduler.assign` picks the worker as torch does: round-robin over the workers
whose stream has not ended (``in_order=True``), or the next in turn that holds fewer than its
share of the ``prefetch_factor * num_workers`` tasks out (``in_order=False``); the engine keeps
that many out, assigning one new task per batch handed out. With ``balance``
(``balance_workers=True``) the next task goes to the worker that would finish it first: when
its current task began, plus its pace (the time its recent batches took, in the worker) for
each task it would then hold; and it is sent only if that worker holds fewer than
:data:`BALANCED_IN_FLIGHT` unanswered, else it waits for a worker to answer. So a worker on a
faster CPU makes more of the epoch's batches instead of waiting for its turn, and a slow one is
given a batch only when it would still finish it first.
:meth:`Scheduler.next_task` says which task is handed out next: in order, the lowest id not
handed out yet (skipping those of ended streams); out of order, any that has arrived, the
lowest first.

The engine (``pool.py``) asks the keys, sends the tasks, reads the results and records them on
the :class:`Task`; a restart asks :meth:`Scheduler.unfinished` which tasks to send again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, NewType

from ferry._engine.position.cursor import WorkerCursor
from ferry._engine.work.fetch import Outcome

__all__ = ["BALANCED_IN_FLIGHT", "Scheduler", "Task", "TaskId", "WorkerPace"]

TaskId = NewType("TaskId", int)

# Balanced assignment: the most tasks a worker holds unanswered. Two, so that its next task is
# there when it finishes one (no round trip to the main process between batches), and no more,
# so that the rest of the window goes to whichever worker answers first.
BALANCED_IN_FLIGHT = 2
# A worker's pace: how much its latest batch's making time moves it (a moving average); and
# what is left of the pace of a worker with nothing to do each time a task goes to another,
# so that one found slow once (a burst of load on its CPU) is tried again before long.
_PACE_WEIGHT = 0.3
_IDLE_DECAY = 0.9


@dataclass(slots=True)
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


class WorkerPace:
    """What balanced assignment knows of each worker: how long a batch takes it (``seconds``:
    a moving average, its first batch left out, as it pays for warming up, imports and caches)
    and when the task it is making began."""

    def __init__(self, num_workers: int) -> None:
        self.seconds = [0.0] * num_workers  # 0: not known yet
        self.made = [0] * num_workers
        self.began = [0.0] * num_workers
        self.clock = time.perf_counter

    def record(self, worker_id: int, seconds: float) -> None:
        """Worker ``worker_id`` took ``seconds`` to make its latest batch."""
        self.made[worker_id] += 1
        if self.made[worker_id] == 1:
            return
        old = self.seconds[worker_id]
        self.seconds[worker_id] = seconds if not old else old + _PACE_WEIGHT * (seconds - old)

    def task_began(self, worker_id: int) -> None:
        self.began[worker_id] = self.clock()

    def finish(self, worker_id: int, held: int, now: float) -> float:
        """When worker ``worker_id``, holding ``held`` unanswered tasks, would finish one more."""
        pace = self.seconds[worker_id]
        free = max(now, self.began[worker_id] + held * pace) if held else now
        return free + pace

    def passed_over(self, worker_id: int) -> None:
        """A task went to another worker while this one had nothing to do."""
        self.seconds[worker_id] *= _IDLE_DECAY


class Scheduler:
    """Tasks, the worker each is assigned to, and the order they are handed out in (see the
    module docstring)."""

    def __init__(self, num_workers: int, in_order: bool, balance: bool = False) -> None:
        self.num_workers = num_workers
        self.in_order = in_order
        # The most tasks out at once, the epoch's ``prefetch_factor * num_workers`` (tuned
        # between epochs with prefetch_factor="auto"): out of order, a worker holding its
        # share of them is passed over.
        self.depth = 2 * num_workers
        self.tasks: dict[TaskId, Task] = {}
        self.next_id = TaskId(0)  # the id the next task gets
        self.first = TaskId(0)  # the epoch's first id: lower ids are an abandoned epoch's
        self.next_yield = TaskId(0)  # in order: the id handed out next
        self._base = 0  # the id of the epoch's batch index 0
        self.in_flight = [0] * num_workers
        self.active = [True] * num_workers  # False: the worker's stream ended
        # Balanced: each worker's pace (kept across epochs, as persistent workers keep their
        # CPUs); None: torch's turns.
        self.pace = WorkerPace(num_workers) if balance else None
        self._turn = 0
        self.keys_done = False  # the epoch's keys ran out: no task is left to assign

    # -- epochs ------------------------------------------------------------------------------------

    def begin_epoch(self, next_index: int, turn: int, depth: int = 0) -> None:
        """A new epoch, whose next batch index is ``next_index`` (not 0 when it resumes), with
        worker ``turn`` next in the round-robin, and at most ``depth`` tasks out (0: torch's
        default prefetch_factor, 2 a worker)."""
        self.depth = depth or 2 * self.num_workers
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
        """Some worker's stream has not ended (balanced: and it holds fewer than
        :data:`BALANCED_IN_FLIGHT` unanswered tasks)."""
        if self.pace is not None:
            return self._fastest() is not None
        return any(self.active)

    def assign(self, index: int, key: Any, sent: float = 0.0) -> tuple[TaskId, Task]:
        """Record batch ``index`` of the epoch (``key``) as a task of the worker it goes to."""
        worker_id = self._pick_worker()
        task_id = TaskId(self._base + index)
        self.next_id = TaskId(task_id + 1)
        task = Task(worker_id, key, index, sent=sent)
        self.tasks[task_id] = task
        if self.pace is not None and not self.in_flight[worker_id]:
            self.pace.task_began(worker_id)
        self.in_flight[worker_id] += 1
        return task_id, task

    def _next_turn(self) -> int:
        candidate = self._turn
        self._turn = (candidate + 1) % self.num_workers
        return candidate

    def _fastest(self) -> int | None:
        """Balanced: the worker that would finish one more task first (ties, as between
        workers whose pace is not known yet: the one holding fewer tasks, then the next in
        turn), if it may take one now (see the module docstring)."""
        pace = self.pace
        assert pace is not None
        best, best_rank = None, (0.0, 0)
        now = pace.clock()
        for step in range(self.num_workers):
            worker = (self._turn + step) % self.num_workers
            if self.active[worker]:
                held = self.in_flight[worker]
                rank = (pace.finish(worker, held, now), held)
                if best is None or rank < best_rank:
                    best, best_rank = worker, rank
        if best is None or self.in_flight[best] >= BALANCED_IN_FLIGHT:
            return None
        return best

    def _pick_worker(self) -> int:
        if self.pace is not None:
            worker = self._fastest()
            if worker is not None:
                self._turn = (worker + 1) % self.num_workers
                for other in range(self.num_workers):
                    if other != worker and not self.in_flight[other]:
                        self.pace.passed_over(other)
                return worker
        if self.in_order and self.pace is None:
            for _ in range(self.num_workers):
                candidate = self._next_turn()
                if self.active[candidate]:
                    return candidate
        # Out of order, as torch: the next in turn that holds fewer than its share of the
        # tasks out (so a slow worker with a full queue is passed over, and the fast ones make
        # more of the epoch); the turn moves past those passed over. A task a worker holds is
        # one not handed out yet, made or not, as torch counts them: results that arrived
        # together and wait to be handed out still count against their workers.
        active = [w for w in range(self.num_workers) if self.active[w]]
        share = self.depth // len(active)
        held = [0] * self.num_workers
        for task in self.tasks.values():
            held[task.worker_id] += 1
        for _ in range(self.num_workers):
            candidate = self._next_turn()
            if self.active[candidate] and held[candidate] < share:
                return candidate
        return min(active, key=lambda w: held[w])  # (none below its share)

    # -- results -----------------------------------------------------------------------------------

    def arrived(self, task_id: TaskId, made_s: float | None = None) -> Task:
        """The worker answered ``task_id`` (a batch or an error, recorded by the caller);
        ``made_s``: the seconds it took to make the batch, its pace when balanced."""
        task = self.tasks[task_id]
        self.in_flight[task.worker_id] -= 1
        if self.pace is not None:
            if made_s is not None:
                self.pace.record(task.worker_id, made_s)
            if self.in_flight[task.worker_id]:
                self.pace.task_began(task.worker_id)  # (its next task begins now)
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
