"""The worker engine: the loop that sends tasks, reads results and hands batches out.

Which worker makes which batch, and the order they are handed out in (torch's: round-robin,
``prefetch_factor`` tasks a worker, ``in_order``), is the scheduler's
(:class:`~ferry._engine.schedule.Scheduler`); how workers of one kind start, talk and are
replaced is their kind's (:mod:`ferry._engine.crew.kinds`).
Tasks and typed messages travel through one :class:`~ferry._engine.crew.channels.Channel`, which
notices a dead worker as it dies and measures ``timeout`` in the same wait. Dead, stalled or late
workers: :mod:`ferry._engine.incidents`; ``num_workers="auto"``'s move to threads:
:mod:`ferry._engine.tuning.switch`. Teardown is
:meth:`ferry._engine.crew.group.WorkerGroup.shutdown` (layered, bounded), run through
``weakref.finalize`` when the epoch ends, on a fatal error, when the iterator is collected, or
at interpreter exit.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from typing_extensions import assert_never

from ferry._engine.crew.channels import WorkerGone, WorkerMessage
from ferry._engine.crew.group import (
    WorkerGroup,
)
from ferry._engine.crew.kinds import worker_kind
from ferry._engine.crew.worker import WorkerConfig
from ferry._engine.failures import SkipBudget
from ferry._engine.incidents import Incidents
from ferry._engine.iterator import LoaderIterator
from ferry._engine.plan import EpochPlan
from ferry._engine.position.counted import snapshots_itself
from ferry._engine.position.cursor import Cursor, RunCounts, WorkerCursor
from ferry._engine.position.track import Delivery
from ferry._engine.schedule import Scheduler, TaskId
from ferry._engine.transport.messages import (
    Done,
    Exhausted,
    Failed,
    FirstLook,
    Ready,
    Resume,
    Stack,
)
from ferry._engine.transport.pin import PinJob, Pinner
from ferry._engine.transport.slabfile import DescriptorLimitReached
from ferry._engine.tuning.switch import EndMeasure, HeldWorkers, ThreadMove, ThreadSwitch
from ferry._engine.work.aio import AsyncReads, is_async_dataset
from ferry._engine.work.fetch import DROPPED
from ferry._engine.work.reads import POOL_LIMIT
from ferry.errors import (
    WorkerDied,
    WorkerTimeout,
    add_note,
    describe_key,
    rebuild_exception,
)

__all__ = ["WorkerIterator"]

# Longest single wait, so a timeout or a dead thread worker is noticed promptly.
_WAIT_SLICE = 0.5


class WorkerIterator(Incidents, ThreadMove, LoaderIterator):
    """``num_workers > 0``: batches are made by worker processes or threads."""

    def __init__(
        self,
        plan: EpochPlan,
        resume: Cursor | None = None,
        budget: SkipBudget | None = None,
        run: RunCounts | None = None,
    ) -> None:
        if not plan.prefetch_factor:
            # torch refuses it too (when the iterator is made): no batch could ever be asked.
            raise ValueError(
                f"prefetch_factor must be >= 1 with num_workers > 0, got {plan.prefetch_factor}"
            )
        super().__init__(plan, resume, budget, run)
        self._num_workers = plan.num_workers
        self._prefetch = plan.prefetch_factor
        self._in_order = plan.in_order
        # Which worker makes which batch and which is handed out next (no transport).
        self._schedule = Scheduler(plan.num_workers, plan.in_order)
        self._timeout = plan.timeout
        self._kind = worker_kind(plan.worker_type)  # how its workers start, talk, are replaced
        self._group = WorkerGroup()
        self._finalizer = weakref.finalize(self, self._group.shutdown)
        self._fatal: BaseException | None = None
        self._restarts = 0  # dead workers replaced by this iterator (max_worker_restarts)
        self._stall = plan.failures.stall_warning
        self._waiting_since = 0.0  # when the loop began waiting for the batch it waits for
        self._stall_reported = False
        self._stacks: dict[int, Stack] = {}  # workers' answers to a stall report's request
        # A map-style dataset with a state of its own in process workers: each worker's cursor
        # keeps the keys it fetched since its last snapshot (fetched again on resume), and its
        # states as each epoch begins (see WorkerCursor.since).
        self._replays = (
            self._kind.copies_dataset and not plan.iterable_style and snapshots_itself(plan.dataset)
        )
        # num_workers="auto": workers that each hold a copy of the dataset (processes), whose
        # reads wait or whose memory grows past what the system has, give way to threads
        # (switch.py, _become_threads).
        self._switch = ThreadSwitch(plan, self._kind.copies_dataset, self._replays)
        self._held = HeldWorkers()  # (auto: workers not started until the first look, see there)
        self._measure_at_end = EndMeasure()  # (the workers' memory, when the epoch ends)
        self._start_group()

    def _start_group(self) -> None:
        """Start the workers for the epoch just opened (each at its position), and begin it."""
        plan = self._plan
        named = self._kind.slabs_by_name()
        self._group.named_slabs = named
        if not plan.iterable_style and self._group.reads is None:
            # Thread workers share per-sample reads; an async dataset's workers, processes too,
            # read on an event loop (aio.py; a process worker's is its own, made there).
            if is_async_dataset(plan.dataset):
                self._group.reads = AsyncReads()
            else:
                self._group.reads = self._kind.shared_reads()
        recovered = self._track.keys.take_recovered()
        starts = [self.worker_resume(i) for i in range(self._num_workers)]
        configs = [
            WorkerConfig.of_plan(
                plan,
                i,
                self._base_seed,
                resume=start,
                track_rng=self._kind.tracks_rng,
                named_slabs=named,
                # (the keys it fetches again as it starts: see WorkerCursor.since)
                replay=start.replay_with(recovered) if start and self._replays else (),
                report_start=self._replays,
                reads=self._group.reads,
                read_limit=POOL_LIMIT // self._num_workers if self._switch.active else 0,
            )
            for i, start in enumerate(starts)
        ]
        self._configs = configs
        # Worker 0 is sent its first task as soon as it has started, before the others start,
        # where its kind allows it (send_before_all_start): the first batch does not wait for
        # every worker to be forked.
        early = (
            len(configs) > 1
            and self._track.turn == 0  # (a resumed epoch may go on at another worker)
            and not self._replays
            and self._kind.send_before_all_start(plan, self._track.keys.first_draw_bytes())
        )
        self._start_workers(configs[:1] if early else configs)
        self._workers = self._group.workers
        self._channel = self._kind.channel(self._group)
        self._begin_epoch(tasks=1 if early else None)
        if early:
            self._held.hold(configs[1:])
            if not self._switch.active:  # (only auto's process workers are held back)
                self._start_held()
                return
        self._pin()  # (a thread: started once no more processes are forked)
        if any(config.replay for config in configs):
            self._await_states()  # the cursors hold keys that are not saved: replace them now

    def _start_held(self) -> None:
        """Start the workers held back (see HeldWorkers), and fill the prefetch queue."""
        count = len(self._workers)
        self._start_workers(self._held.take())
        self._channel.joined(self._workers[count:])
        self._fill()
        self._pin()

    def _fill(self) -> None:
        """Send tasks until ``prefetch_factor * num_workers`` are out (handed out to the user
        is not out; made and waiting here is), as torch bounds them."""
        for _ in range(self._prefetch * self._num_workers - len(self._schedule.tasks)):
            self._dispatch()

    def _start_workers(self, configs: list[WorkerConfig]) -> None:
        try:
            self._kind.start(self._group, configs, self._plan)
        except BaseException:
            self._finalizer()
            raise

    def _await_states(self) -> None:
        """Wait until every worker has said what its user states are as the epoch begins, so
        a state taken from here on holds them (torchdata waits for the same)."""
        self._waiting_since, self._stall_reported = time.monotonic(), False
        while not all(worker.ready for worker in self._workers) and not self._group.closed:
            got = self._receive(None)
            self._handle(*got)

    # -- epoch bookkeeping ---------------------------------------------------------------------

    def _begin_epoch(self, tasks: int | None = None) -> None:
        """Open the epoch's tasks and send ``tasks`` of them (None: a full prefetch queue)."""
        # The keys were opened with the epoch (before the base seed was drawn, as torch asks
        # the sampler for its iterator first); they are drawn from right away to fill the
        # prefetch queue, as torch does, so RNG draws happen in the same order.
        self._keys_done = False
        self._track.stats.reads = self._group.reads  # (None but for thread workers, map-style)
        self._track.stats.shared = self._channel  # (what the process workers' slabs hold here)
        self._schedule.begin_epoch(self._track.next_key, self._track.turn)
        self._latest = list(self._track.workers)
        self._replaced: set[int] = set()  # workers started in a dead one's place this epoch
        for _ in range(self._prefetch * self._num_workers if tasks is None else tasks):
            self._dispatch()

    def _pin(self) -> None:
        """Start (or stop, when turned off between epochs) the thread that pins batches."""
        group = self._group
        if self._plan.pin and group.pinner is None and not group.closed:
            group.pinner = Pinner(self._plan.pin_memory_device)
        elif not self._plan.pin and group.pinner is not None:
            group.pinner.close()
            group.pinner = None

    def _restart(self, plan: EpochPlan) -> None:
        """Next epoch with the same (persistent) workers; stale results are dropped as they come."""
        if self._fatal is not None or self._group.closed:
            raise RuntimeError("this DataLoader's persistent workers were shut down after an error")
        self._plan = plan
        self._open_epoch(self._track.next_epoch())
        self._reopen()

    def _reopen(self) -> None:
        if self._plan.persistent_workers:
            dead = []
            for worker in list(self._workers):
                try:
                    worker.ready = not self._replays  # (it says its states again)
                    worker.send(Resume(worker.slabs.take_freed(epoch=True)))
                except OSError:  # it died between epochs
                    dead.append(worker)
            if dead:
                # Replaced at the new epoch's start, with nothing of the old epoch to redo
                # (a late result of it is dropped by its task number).
                self._latest, self._schedule.tasks = list(self._track.workers), {}
                for worker in dead:
                    try:
                        self._replace(worker)
                    except WorkerDied as exc:
                        self._fail(exc)
                        raise
            self._begin_epoch()
            self._pin()
            if self._replays:
                self._await_states()
            return
        # Workers of a new epoch are seeded anew, from its base seed: start new ones.
        self._finalizer()
        self._group = WorkerGroup()
        self._finalizer = weakref.finalize(self, self._group.shutdown)
        self._start_group()

    def _dispatch(self) -> None:
        """Hand the next key of the epoch to a worker, if there is a key and a free worker."""
        if self._keys_done or not self._schedule.can_assign() or self._group.closed:
            return
        if self._held.configs:  # (the next key may be a held worker's: see HeldWorkers)
            return
        try:
            with self._track.stats.timing("sampler") as start:
                index, key = next(self._track.keys)
        except StopIteration:
            self._keys_done = True
            # The slabs the main process lets go of from now on are retired, not kept for
            # tasks that will not come this epoch (a worker with nothing left keeps no GBs).
            # Persistent workers keep theirs for the next epoch (given back with Resume, within
            # the bound a task's are): retired, every epoch made and faulted its slabs again,
            # in both processes (issue 33: +25-40 ms a 50 ms epoch of 2 workers).
            if not self._plan.persistent_workers:
                self._channel.no_more_tasks()
            return
        task_id, task = self._schedule.assign(index, key, sent=start)
        try:
            self._channel.send_task(self._workers[task.worker_id], task_id, key)
        except WorkerGone as gone:
            self._replace(gone.worker)

    # -- the main loop -------------------------------------------------------------------------

    def _fail(self, exc: BaseException) -> None:
        """``exc`` ends this iterator: the workers stop now, and every later ``next()`` raises
        it again."""
        self._fatal = exc
        self._finalizer()

    def _next_batch(self) -> Delivery:
        if self._fatal is not None:
            raise self._fatal
        if self._switch.why:
            self._become_threads()
        elif self._held.due():
            self._start_held()
        try:
            return self._next_result()
        except StopIteration:
            self._measure_at_end(self._track.stats, [(w.worker_id, w.pid) for w in self._workers])
            if not self._plan.persistent_workers:
                self._finalizer()
            raise
        except (WorkerDied, WorkerTimeout) as exc:
            self._fail(exc)
            raise

    def _next_result(self) -> Delivery:
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        stats = self._track.stats
        waited = False
        schedule = self._schedule
        while True:
            task = schedule.next_task()
            if task is None:
                raise StopIteration
            if task.arrived:
                self._read_ahead()
                break
            # Messages already there are read first: only a batch that was not made yet when
            # the loop asked counts as waited for.
            got = None if waited else self._poll(0.0)
            if got is None:
                if not waited:
                    waited = True
                    self._waiting_since, self._stall_reported = time.monotonic(), False
                got = self._receive(deadline)
            self._handle(*got)
            if not self._in_order:
                ready = schedule.first_arrived()
                if ready is not None:
                    stats.batch_waited()
                    self._read_ahead()
                    return self._deliver(ready)
        if waited:
            stats.batch_waited()
        else:
            stats.batch_ready()
        return self._deliver(schedule.next_yield)

    def _read_ahead(self) -> None:
        """Handle the messages already there, so the batches in them are pinned while the
        training step runs (pin_memory=True). The batch about to be handed out has arrived: an
        error found here is raised at the next ``next()``, as it would be without pinning."""
        if self._group.pinner is None:
            return
        try:
            while (got := self._poll(0.0)) is not None:
                self._handle(*got)
        except Exception as exc:
            if self._fatal is None:
                self._fail(exc)

    def _pinned(self, batch: Any, number: int) -> Any:
        if isinstance(batch, PinJob):  # pinned by the pin thread since it arrived
            return self._take_pinned(batch, number)
        return super()._pinned(batch, number)

    def _take_pinned(self, job: PinJob, number: int) -> Any:
        try:
            return job.take(self._timeout)
        except TimeoutError:
            # A copy that takes longer than the whole timeout is a hung accelerator call: the
            # iterator stops, as for a late worker.
            exc = WorkerTimeout(
                f"DataLoader timed out after {self._plan.timeout} seconds waiting for the "
                f"pin_memory thread to pin batch {number} of the epoch (it is stuck in "
                "Tensor.pin_memory; a hung or busy accelerator driver is the usual cause)"
            )
            self._fail(exc)
            raise exc from None

    def _deliver(self, task_id: TaskId) -> Delivery:
        task = self._schedule.take(task_id)
        self._held.delivered = True
        self._dispatch()
        error, task.error = task.error, None
        if error is None:
            return Delivery(task.result, task.index, task.worker_id, task.position, task.outcome)
        if task.fatal:
            self._fail(error)
        try:
            raise error
        finally:
            # This frame goes on the traceback: holding the exception in a local too would
            # make a cycle that keeps the iterator, and its workers, alive until a GC pass.
            del error, task

    def _handle(self, worker_id: int, message: WorkerMessage) -> None:
        match message:
            case Ready(states=states):
                self._workers[worker_id].ready = True
                # (a worker started in a dead one's place starts at the dead one's position)
                if states is not None and worker_id not in self._replaced:
                    # The worker's position as its epoch begins, before any batch of it.
                    began = WorkerCursor(0, self._latest[worker_id].rng, states)
                    self._latest[worker_id] = began
                    self._track.workers[worker_id] = began
                return
            case Stack():
                self._stacks[worker_id] = message
                return
            case FirstLook(waits=waits):
                self._held.waits = waits  # (held workers start at the next look if it does not)
                return
            case Failed(task=None):  # a bug of ours ended a thread worker
                exc = self._worker_exception(message, f"while starting ({message.stage})")
                self._fail(exc)
                raise exc
            case Done(task=task_id) | Exhausted(task=task_id) | Failed(task=int() as task_id) if (
                self._schedule.stale(task_id)
            ):
                # From an abandoned epoch (in-flight counts were reset when the new one began):
                # dropped unread, so its slabs go straight back.
                if isinstance(message, Done) and message.slabs:
                    self._workers[worker_id].slabs.release(message.slabs)
                return
            case Exhausted(task=task_id):
                self._schedule.stream_ended(worker_id, TaskId(task_id))
                self._dispatch()
            case Failed(task=task_id):
                assert task_id is not None  # (a failure of ours in a thread is matched above)
                task = self._schedule.arrived(TaskId(task_id))
                what = describe_key(task.key, self._iterable_style)
                if message.stage:  # its set-up raised: the loader cannot go on without it
                    what = f"while starting ({message.stage}), so it could not fetch {what}"
                    task.fatal = True
                else:
                    what = "while fetching " + what
                task.error = self._worker_exception(message, what)
            case Done(task=task_id, report=report):
                task = self._schedule.arrived(TaskId(task_id))
                latest = self._latest[worker_id]
                if report is not None:
                    latest = report.resolve(latest)
                if self._replays and (report is None or report.snapshot is None):
                    latest = latest.fetched(task.index)
                self._latest[worker_id] = task.position = latest
                stats = self._track.stats
                stats.worker_made(worker_id, message.timing)
                stats.cpu_used(message.timing.made_s, message.cpu)
                if message.memory >= 0:
                    stats.worker_memory(worker_id, message.memory)
                self._switch.after(message, task.key, stats, self.__len__)
                task.outcome = message.outcome
                if message.empty:
                    task.result = DROPPED
                    return
                with stats.timing("hand_off"):
                    task.result = self._channel.batch(worker_id, message)
                if self._group.pinner is not None:
                    task.result = self._group.pinner.submit(task.result)
            case _:
                assert_never(message)

    def _worker_exception(self, message: Failed, what: str) -> BaseException:
        exc = rebuild_exception(message.exception, message.type_name, message.message)
        kind = message.type_name.rsplit(".", 1)[-1]
        add_note(
            exc,
            f"Caught {kind} in DataLoader worker process {message.worker_id} "
            f"(pid {message.pid}) {what}",
        )
        add_note(exc, "worker traceback:\n" + message.traceback.rstrip())
        return exc

    def _receive(self, deadline: float | None) -> tuple[int, WorkerMessage]:
        """The next message from any worker; raises if a worker died or ``deadline`` passed."""
        while True:
            if self._held.due():
                self._start_held()
            left = (
                _WAIT_SLICE if deadline is None else min(_WAIT_SLICE, deadline - time.monotonic())
            )
            if left <= 0:
                raise self._timeout_error()
            got = self._poll(self._held.wait_for(left))
            if got is not None:
                return got
            if self._stall is not None and not self._stall_reported:
                waited = time.monotonic() - self._waiting_since
                if waited >= self._stall:
                    self._stall_reported = True  # once per stall
                    self._report_stall(waited)

    def _poll(self, wait_for: float) -> tuple[int, WorkerMessage] | None:
        """A message from any worker within ``wait_for`` seconds (0: one already there)."""
        try:
            return self._channel.receive(wait_for, self._schedule.in_flight)
        except WorkerGone as gone:
            self._replace(gone.worker)
            return None
        except DescriptorLimitReached as exc:
            # Out of descriptors in this process, a slab was lost on its way: the worker's
            # later batches may refer to it, so the iterator cannot go on. (The same error
            # raised in a worker fails only its batch: that worker lives on.)
            self._fail(exc)
            raise

    # -- teardown ------------------------------------------------------------------------------

    def _shutdown_workers(self) -> None:
        """Stop the workers now (also called by the finalizer)."""
        self._finalizer()
