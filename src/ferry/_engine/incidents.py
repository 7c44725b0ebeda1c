"""What the worker engine does when a worker dies, stalls, or does not answer in time.

A mixin of :class:`~ferry._engine.pool.WorkerIterator`, kept apart from the dispatch and
reorder loop: replacing a dead worker (``max_worker_restarts``), the stall report
(``stall_warning``), and the :class:`~ferry.errors.WorkerDied` and
:class:`~ferry.errors.WorkerTimeout` errors, which name the worker, its pid and what it held.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

from ferry._engine.crew.channels import Channel, WorkerGone, WorkerMessage
from ferry._engine.crew.group import WorkerGroup, WorkerHandle
from ferry._engine.crew.kinds import WorkerKind
from ferry._engine.crew.stall import (
    STACK_REPLY_TIMEOUT,
    Holder,
    Pending,
    stall_message,
)
from ferry._engine.crew.worker import WorkerConfig
from ferry._engine.plan import EpochPlan
from ferry._engine.position.cursor import WorkerCursor
from ferry._engine.position.track import EpochTrack
from ferry._engine.schedule import Scheduler
from ferry._engine.transport.messages import Stack
from ferry.errors import (
    StallWarning,
    WorkerDied,
    WorkerRestartWarning,
    WorkerTimeout,
    add_note,
    describe_key,
    warn_from_user_code,
)

__all__ = ["Incidents"]


class Incidents:
    """Dead, stalled and late workers (see the module docstring)."""

    _plan: EpochPlan
    _iterable_style: bool
    _kind: WorkerKind[Any]
    _group: WorkerGroup[Any]
    _workers: list[WorkerHandle]
    _channel: Channel[Any]
    _configs: list[WorkerConfig]
    _schedule: Scheduler
    _latest: list[WorkerCursor]
    _replaced: set[int]
    _restarts: int
    _stall: float | None
    _stacks: dict[int, Stack]
    _track: EpochTrack

    def _poll(self, wait_for: float) -> tuple[int, WorkerMessage] | None:
        raise NotImplementedError

    def _handle(self, worker_id: int, message: WorkerMessage) -> None:
        raise NotImplementedError

    def _report_stall(self, waited: float) -> None:
        """Warn (:class:`StallWarning`) with what each worker holding unfinished batches is
        doing (see :mod:`ferry._engine.crew.stall`)."""
        assert self._stall is not None
        holding = self._schedule.holding()
        self._stacks = self._kind.stacks(self._workers, holding, self._stack_answers)
        message = stall_message(
            waited=waited,
            limit=self._stall,
            pending=[
                Pending(n, t.worker_id, t.index, t.key, t.sent) for n, t in self._schedule.pending()
            ],
            waiting_for=self._schedule.next_yield,
            holders={
                w: Holder(self._workers[w].pid, self._stacks.get(w), self._starting_for(w))
                for w in holding
            },
            iterable=self._iterable_style,
        )
        warn_from_user_code(message, StallWarning)

    def _stack_answers(self, asked: list[int]) -> dict[int, Stack]:
        """The :class:`Stack` messages of the process workers ``asked``, as they come within
        ``STACK_REPLY_TIMEOUT`` (a worker whose reader thread is stuck too says nothing)."""
        self._stacks = {}
        deadline = time.monotonic() + STACK_REPLY_TIMEOUT
        while set(asked) - self._stacks.keys():
            left = deadline - time.monotonic()
            got = self._poll(left) if left > 0 else None
            if got is None:
                break
            self._handle(*got)  # a Stack is stored in self._stacks
        return self._stacks

    def _starting_for(self, worker_id: int) -> float | None:
        """Seconds since worker ``worker_id`` was started, if it has not said it is ready."""
        worker = self._workers[worker_id]
        return None if worker.ready else time.monotonic() - worker.started

    def _in_flight_of(self, worker_id: int) -> str:
        """What ``worker_id`` was making: each distinct key once, with a count if repeated
        (a stream's keys all read "the next batch of its dataset stream")."""
        counts: dict[str, int] = {}
        for _, task in self._schedule.pending():
            if task.worker_id == worker_id:
                what = describe_key(task.key, self._iterable_style)
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

    def _replace(self, dead: WorkerHandle) -> None:
        """A worker died: start another in its place, at the position after the last batch
        it sent, and hand it the dead one's unfinished tasks again, in order, so the epoch's
        batches are those an undisturbed run makes. Past ``max_worker_restarts`` (or for a
        thread, which dies only of a bug of ours), raise :class:`WorkerDied`."""
        died = self._died(dead)
        limit = self._plan.failures.max_worker_restarts
        if not self._kind.replaceable or self._restarts >= limit:
            if limit and self._kind.replaceable:
                add_note(died, f"(max_worker_restarts={limit}: {self._restarts} restarts used)")
            raise died from None
        self._restarts += 1
        worker_id = dead.worker_id
        self._replaced.add(worker_id)
        self._track.stats.worker_restarted(worker_id)
        position = self._latest[worker_id]
        config = replace(
            self._configs[worker_id],
            resume=None if position == WorkerCursor() else position,
            replay=(),  # (the keys since its snapshot are not kept: it resumes at the snapshot)
            parent_pid=os.getpid(),
        )
        new = self._kind.replace(self._group, config, self._plan)
        self._workers = self._group.workers
        self._channel.replaced(dead, new)
        unfinished = self._schedule.unfinished(worker_id)
        warn_from_user_code(
            f"{died}. It was replaced by a new worker process (pid {new.pid}; restart "
            f"{self._restarts} of max_worker_restarts={limit}), which fetches its "
            f"{len(unfinished)} unfinished batches again: the epoch goes on unchanged.",
            WorkerRestartWarning,
        )
        for task_id in unfinished:
            try:
                self._channel.send_task(new, task_id, self._schedule.tasks[task_id].key)
            except WorkerGone:
                raise self._died(new) from None

    def _died(self, worker: WorkerHandle) -> WorkerDied:
        worker.join(0.1)  # (a thread has no exit code)
        return WorkerDied(
            worker.worker_id, worker.pid, worker.exitcode, self._in_flight_of(worker.worker_id)
        )

    def _timeout_error(self) -> WorkerTimeout:
        # torch's words, with the timeout as the user gave it ("after 5 seconds").
        waited = f"DataLoader timed out after {self._plan.timeout} seconds"
        task = self._schedule.tasks.get(self._schedule.next_yield)
        if task is None:
            return WorkerTimeout(f"{waited} waiting for a batch (timeout={self._plan.timeout})")
        worker = self._workers[task.worker_id]
        return WorkerTimeout(
            f"{waited} waiting for worker {task.worker_id} (pid {worker.pid}) to fetch "
            f"{describe_key(task.key, self._iterable_style)}"
        )
