"""What the worker engine does when a worker dies, stalls, or does not answer in time:
:class:`Incidents`, an object over the crew, the scheduler and the track.

Replacing a dead worker (``max_worker_restarts``) at the position the track has for it, the
stall report (``stall_warning``), and the :class:`~ferry.errors.WorkerDied` and
:class:`~ferry.errors.WorkerTimeout` errors, which name the worker, its pid and what it held.
The main loop (``pool.py``) calls it; it reads the loader's options from the track's plan,
which follows ``num_workers="auto"``'s move to threads.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ferry._engine.crew.channels import WorkerGone
from ferry._engine.crew.crew import Crew
from ferry._engine.crew.group import WorkerHandle
from ferry._engine.crew.stall import (
    STACK_REPLY_TIMEOUT,
    Holder,
    Pending,
    stall_message,
)
from ferry._engine.position.track import EpochTrack
from ferry._engine.schedule import Scheduler
from ferry._engine.transport.messages import Failed, Stack
from ferry.errors import (
    StallWarning,
    WorkerDied,
    WorkerRestartWarning,
    WorkerTimeout,
    add_note,
    describe_key,
    rebuild_exception,
    warn_from_user_code,
)
from ferry.stats import StatsRecorder

__all__ = ["Incidents"]


class Incidents:
    """Dead, stalled and late workers of one iterator (see the module docstring).

    ``crew`` is replaced when the iterator's crew is (auto's move to threads, a new epoch of
    workers that do not persist); ``restarts`` spans them all.
    """

    def __init__(
        self, crew: Crew[Any], schedule: Scheduler, track: EpochTrack, stats: StatsRecorder
    ) -> None:
        self.crew = crew
        self.schedule = schedule
        self.track = track
        self.stats = stats
        self.restarts = 0  # dead workers replaced by this iterator (max_worker_restarts)
        self.stacks: dict[int, Stack] = {}  # workers' answers to a stall report's request
        self.waiting_since = 0.0  # when the loop began waiting for the batch it waits for
        self.stall_reported = False

    # -- stalls ----------------------------------------------------------------------------------

    def waiting(self) -> None:
        """The loop begins waiting for a batch that is not there yet."""
        self.waiting_since, self.stall_reported = time.monotonic(), False

    def check_stall(self, pump: Callable[[float], bool]) -> None:
        """Report a stall once the loop has waited ``stall_warning`` seconds (once per wait).
        ``pump(seconds)`` handles the next message within that long (False: none came)."""
        limit = self.track.plan.failures.stall_warning
        if limit is None or self.stall_reported:
            return
        waited = time.monotonic() - self.waiting_since
        if waited >= limit:
            self.stall_reported = True
            self._report_stall(waited, limit, pump)

    def _report_stall(self, waited: float, limit: float, pump: Callable[[float], bool]) -> None:
        """Warn (:class:`StallWarning`) with what each worker holding unfinished batches is
        doing (see :mod:`ferry._engine.crew.stall`)."""
        schedule, workers = self.schedule, self.crew.workers
        holding = schedule.holding()
        self.stacks = self.crew.kind.stacks(
            workers, holding, lambda asked: self._stack_answers(asked, pump)
        )
        message = stall_message(
            waited=waited,
            limit=limit,
            pending=[
                Pending(n, t.worker_id, t.index, t.key, t.sent) for n, t in schedule.pending()
            ],
            waiting_for=schedule.next_yield,
            holders={
                w: Holder(workers[w].pid, self.stacks.get(w), self._starting_for(w))
                for w in holding
            },
            iterable=self.track.plan.iterable_style,
        )
        warn_from_user_code(message, StallWarning)

    def _stack_answers(self, asked: list[int], pump: Callable[[float], bool]) -> dict[int, Stack]:
        """The :class:`Stack` messages of the process workers ``asked``, as they come within
        ``STACK_REPLY_TIMEOUT`` (a worker whose reader thread is stuck too says nothing)."""
        self.stacks = {}
        deadline = time.monotonic() + STACK_REPLY_TIMEOUT
        while set(asked) - self.stacks.keys():
            left = deadline - time.monotonic()
            if left <= 0 or not pump(left):  # (a Stack is stored in self.stacks)
                break
        return self.stacks

    def _starting_for(self, worker_id: int) -> float | None:
        """Seconds since worker ``worker_id`` was started, if it has not said it is ready."""
        worker = self.crew.workers[worker_id]
        return None if worker.ready else time.monotonic() - worker.started

    # -- dead workers ----------------------------------------------------------------------------

    def in_flight_of(self, worker_id: int) -> str:
        """What ``worker_id`` was making: each distinct key once, with a count if repeated
        (a stream's keys all read "the next batch of its dataset stream")."""
        counts: dict[str, int] = {}
        iterable = self.track.plan.iterable_style
        for _, task in self.schedule.pending():
            if task.worker_id == worker_id:
                what = describe_key(task.key, iterable)
                counts[what] = counts.get(what, 0) + 1
        if not counts:
            return "nothing"
        described = "; ".join(
            what if count == 1 else f"{what} ({count} batches in flight)"
            for what, count in counts.items()
        )
        if len(counts) == 1:
            return described
        return f"{sum(counts.values())} batches: {described}"

    def replace(self, dead: WorkerHandle) -> None:
        """A worker died: start another in its place, at the position after the last batch
        it sent, and hand it the dead one's unfinished tasks again, in order, so the epoch's
        batches are those an undisturbed run makes. Past ``max_worker_restarts`` (or for a
        thread, which dies only of a bug of ours), raise :class:`WorkerDied`."""
        died = self.died(dead)
        crew, plan = self.crew, self.track.plan
        limit = plan.failures.max_worker_restarts
        if not crew.kind.replaceable or self.restarts >= limit:
            if limit and crew.kind.replaceable:
                add_note(died, f"(max_worker_restarts={limit}: {self.restarts} restarts used)")
            raise died from None
        self.restarts += 1
        worker_id = dead.worker_id
        self.stats.worker_restarted(worker_id)
        config = replace(
            crew.configs[worker_id],
            resume=self.track.flight.restart(worker_id),
            replay=(),  # (the keys since its snapshot are not kept: it resumes at the snapshot)
            parent_pid=os.getpid(),
        )
        new = crew.replace(dead, config, plan)
        unfinished = self.schedule.unfinished(worker_id)
        warn_from_user_code(
            f"{died}. It was replaced by a new worker process (pid {new.pid}; restart "
            f"{self.restarts} of max_worker_restarts={limit}), which fetches its "
            f"{len(unfinished)} unfinished batches again: the epoch goes on unchanged.",
            WorkerRestartWarning,
        )
        for task_id in unfinished:
            try:
                crew.send(worker_id, task_id, self.schedule.tasks[task_id].key)
            except WorkerGone:
                raise self.died(new) from None

    def died(self, worker: WorkerHandle) -> WorkerDied:
        worker.join(0.1)  # (a thread has no exit code)
        return WorkerDied(
            worker.worker_id, worker.pid, worker.exitcode, self.in_flight_of(worker.worker_id)
        )

    # -- errors ----------------------------------------------------------------------------------

    def timeout_error(self) -> WorkerTimeout:
        # torch's words, with the timeout as the user gave it ("after 5 seconds").
        plan = self.track.plan
        waited = f"DataLoader timed out after {plan.timeout} seconds"
        task = self.schedule.tasks.get(self.schedule.next_yield)
        if task is None:
            return WorkerTimeout(f"{waited} waiting for a batch (timeout={plan.timeout})")
        worker = self.crew.workers[task.worker_id]
        return WorkerTimeout(
            f"{waited} waiting for worker {task.worker_id} (pid {worker.pid}) to fetch "
            f"{describe_key(task.key, plan.iterable_style)}"
        )

    @staticmethod
    def worker_exception(message: Failed, what: str) -> BaseException:
        """The exception a worker's user code raised, rebuilt here, with notes that say which
        worker (id and pid), ``what`` it was doing, and its traceback."""
        exc = rebuild_exception(message.exception, message.type_name, message.message)
        kind = message.type_name.rsplit(".", 1)[-1]
        add_note(
            exc,
            f"Caught {kind} in DataLoader worker process {message.worker_id} "
            f"(pid {message.pid}) {what}",
        )
        add_note(exc, "worker traceback:\n" + message.traceback.rstrip())
        return exc
