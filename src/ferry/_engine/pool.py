"""The worker engine: the loop that sends tasks, reads results and hands batches out.

It owns the loop and nothing else; what the loop asks is held as objects:

* the workers, their kind, their channel and their finalizer: the iterator's
  :class:`~ferry._engine.crew.crew.Crew` (started, replaced and stopped as a unit; a new crew
  for auto's move to threads, or for the next epoch of workers that do not persist);
* which worker makes which batch, and the order they are handed out in (torch's: round-robin,
  ``prefetch_factor`` tasks a worker, ``in_order``): the
  :class:`~ferry._engine.schedule.Scheduler`;
* where each worker stands after the batches it made: the track's
  :class:`~ferry._engine.position.track.InFlight`; the position moves in the track alone;
* dead, stalled or late workers: :class:`~ferry._engine.incidents.Incidents`;
  ``num_workers="auto"``'s held workers and move to threads:
  :class:`~ferry._engine.tuning.switch.ThreadMove`.

Tasks and typed messages travel through the crew's channel, which notices a dead worker as it
dies and measures ``timeout`` in the same wait. Teardown is
:meth:`ferry._engine.crew.group.WorkerGroup.shutdown` (layered, bounded), run through the
crew's ``weakref.finalize`` when the epoch ends, on a fatal error, when the iterator is
collected, or at interpreter exit. It may touch every room of the engine.
"""

from __future__ import annotations

import time
from typing import Any

from typing_extensions import assert_never

from ferry._engine.crew.channels import WorkerGone, WorkerMessage
from ferry._engine.crew.crew import Crew
from ferry._engine.crew.group import WorkerHandle
from ferry._engine.crew.kinds import worker_kind
from ferry._engine.crew.worker import WorkerConfig
from ferry._engine.failures import SkipBudget
from ferry._engine.incidents import Incidents
from ferry._engine.iterator import IteratorOver, LoaderIterator, _option
from ferry._engine.plan import EpochPlan
from ferry._engine.position.counted import snapshots_itself
from ferry._engine.position.cursor import Cursor, RunCounts
from ferry._engine.position.track import Delivery
from ferry._engine.schedule import Scheduler, TaskId
from ferry._engine.transport.messages import Done, Exhausted, Failed, FirstLook, Ready, Stack
from ferry._engine.transport.pin import PinJob
from ferry._engine.transport.slabfile import DescriptorLimitReached
from ferry._engine.tuning.switch import ThreadMove, measure_at_end
from ferry._engine.work.aio import AsyncReads, is_async_dataset
from ferry._engine.work.fetch import DROPPED
from ferry._engine.work.reads import POOL_LIMIT
from ferry.errors import WorkerDied, WorkerTimeout, describe_key

__all__ = ["WorkerIterator"]

# Longest single wait, so a timeout or a dead thread worker is noticed promptly.
_WAIT_SLICE = 0.5


class WorkerIterator(LoaderIterator):
    """``num_workers > 0``: batches are made by worker processes or threads.

    What it holds: its crew (the workers, :class:`~ferry._engine.crew.crew.Crew`), the
    scheduler (which worker makes which batch, and the order they are handed out in), the
    incidents (dead, stalled and late workers), auto's move to threads, and the error that
    ended it, if one did; the epoch's position is the
    track's (the base class's).
    """

    # torch's iterators mirror these options in attributes, which code reads.
    _num_workers = _option("num_workers")
    _timeout = _option("timeout")

    def __init__(
        self,
        plan: EpochPlan,
        resume: Cursor | None = None,
        budget: SkipBudget | None = None,
        run: RunCounts | None = None,
        *,
        base_seed: int | None = None,
    ) -> None:
        if not plan.prefetch_factor:
            # torch refuses it too (when the iterator is made): no batch could ever be asked.
            raise ValueError(
                f"prefetch_factor must be >= 1 with num_workers > 0, got {plan.prefetch_factor}"
            )
        super().__init__(plan, resume, budget, run, base_seed=base_seed)
        # Which worker makes which batch and which is handed out next (no transport).
        self._schedule = Scheduler(plan.num_workers, plan.in_order, plan.balance_workers)
        self._crew = self._new_crew()
        self._incidents = Incidents(self._crew, self._schedule, self._track, self._stats)
        self._fatal: BaseException | None = None
        self._fatal_raised = False  # whether the user was given self._fatal
        # num_workers="auto": workers that each hold a copy of the dataset (processes), whose
        # reads wait or whose memory grows past what the system has, give way to threads
        # (tuning/switch.py).
        self._auto = ThreadMove(plan, self._crew.kind.copies_dataset, self._crew.replays)
        self._start_crew()

    def _new_crew(self) -> Crew[Any]:
        """A crew of the plan's kind, its finalizer registered on this iterator. Its workers
        replay (see Crew) for a map-style dataset with a state of its own in processes."""
        plan = self._plan
        kind = worker_kind(plan.worker_type)
        replays = kind.copies_dataset and not plan.iterable_style and snapshots_itself(plan.dataset)
        return Crew(self, kind, replays=replays)

    def _start_crew(self) -> None:
        """Start the workers for the epoch just opened (each at its position), and begin it."""
        plan, crew, track = self._plan, self._crew, self._track
        named = crew.kind.slabs_by_name()
        crew.group.named_slabs = named
        if not plan.iterable_style and crew.group.reads is None:
            # Thread workers share per-sample reads; an async dataset's workers, processes too,
            # read on an event loop (aio.py; a process worker's is its own, made there).
            if is_async_dataset(plan.dataset):
                crew.group.reads = AsyncReads()
            else:
                crew.group.reads = crew.kind.shared_reads()
        recovered = track.keys.take_recovered()
        starts = [self.worker_resume(i) for i in range(plan.num_workers)]
        crew.configs = [
            WorkerConfig.of_plan(
                plan,
                i,
                self._base_seed,
                resume=start,
                track_rng=crew.kind.tracks_rng,
                named_slabs=named,
                # (the keys it fetches again as it starts: see WorkerCursor.since)
                replay=start.replay_with(recovered) if start and crew.replays else (),
                report_start=crew.replays,
                reads=crew.group.reads,
                read_limit=POOL_LIMIT // plan.num_workers if self._auto.switch.reads_alone else 0,
                tally=crew.tally(plan),
            )
            for i, start in enumerate(starts)
        ]
        configs = crew.configs
        # Worker 0 is sent its first task as soon as it has started, before the others start,
        # where its kind allows it (send_before_all_start): the first batch does not wait for
        # every worker to be forked.
        early = (
            len(configs) > 1
            and track.turn == 0  # (a resumed epoch may go on at another worker)
            and not crew.replays
            and crew.kind.send_before_all_start(plan, track.keys.first_draw_bytes())
        )
        crew.start(configs[:1] if early else configs, plan)
        self._begin_epoch(tasks=1 if early else None)
        if early:
            self._auto.held.hold(configs[1:])
            if not (self._auto.switch.active and plan.hold_workers):  # (see HeldWorkers)
                self._start_held()
                return
        crew.pin(plan)  # (a thread: started once no more processes are forked)
        crew.move(plan)  # (likewise)
        if any(config.replay for config in configs):
            self._await_states()  # the cursors hold keys that are not saved: replace them now

    def _start_held(self) -> None:
        """Start the workers held back (see HeldWorkers), and fill the prefetch queue."""
        self._crew.start(self._auto.held.take(), self._plan)
        self._fill()
        self._crew.pin(self._plan)
        self._crew.move(self._plan)

    def _fill(self) -> None:
        """Send tasks until ``prefetch_factor * num_workers`` are out (handed out to the user
        is not out; made and waiting here is), as torch bounds them, or (balanced) until no
        worker can take one more."""
        for _ in range(self._depth() - len(self._schedule.tasks)):
            if not self._dispatch():
                return

    def _depth(self) -> int:
        """How many tasks may be out at once: ``prefetch_factor`` a worker."""
        return (self._plan.prefetch_factor or 0) * self._plan.num_workers

    def _await_states(self) -> None:
        """Wait until every worker has said what its user states are as the epoch begins, so
        a state taken from here on holds them (torchdata waits for the same)."""
        self._incidents.waiting()
        crew = self._crew
        while not all(worker.ready for worker in crew.workers) and not crew.closed:
            got = self._receive(None)
            self._handle(*got)

    # -- epoch bookkeeping ---------------------------------------------------------------------

    def _begin_epoch(self, tasks: int | None = None) -> None:
        """Open the epoch's tasks and send ``tasks`` of them (None: a full prefetch queue)."""
        # The keys were opened with the epoch (before the base seed was drawn, as torch asks
        # the sampler for its iterator first); they are drawn from right away to fill the
        # prefetch queue, as torch does, so RNG draws happen in the same order.
        track = self._track
        self._stats.reads = self._crew.group.reads  # (None but for thread workers, map-style)
        self._stats.shared = self._crew.channel  # (what the process workers' slabs hold here)
        self._schedule.begin_epoch(track.next_key, track.turn, self._depth())
        track.open_flight(self._crew.replays)
        for _ in range(self._depth() if tasks is None else tasks):
            if not self._dispatch():
                return

    @property
    def stopped_by_error(self) -> bool:
        return self._fatal is not None

    def _restart(self, plan: EpochPlan) -> None:
        """Next epoch with the same (persistent) workers; stale results are dropped as they come."""
        if self._fatal is not None or self._crew.closed:
            raise RuntimeError("this DataLoader's persistent workers were shut down after an error")
        self._plan = plan
        self._open_epoch(self._track.next_epoch())
        self._reopen()

    def _reopen(self) -> None:
        if self._plan.persistent_workers:
            gone = self._crew.resume()
            if gone:
                # Replaced at the new epoch's start, with nothing of the old epoch to redo
                # (a late result of it is dropped by its task number).
                self._schedule.tasks = {}
                self._track.open_flight(self._crew.replays)
                for worker in gone:
                    try:
                        self._incidents.replace(worker)
                    except WorkerDied as exc:
                        self._fail(exc)
                        raise
            self._begin_epoch()
            self._crew.pin(self._plan)
            self._crew.move(self._plan)
            if self._crew.replays:
                self._await_states()
            return
        # Workers of a new epoch are seeded anew, from its base seed: start a new crew.
        self._crew.stop()
        self._set_crew(self._new_crew())
        self._start_crew()

    def _set_crew(self, crew: Crew[Any]) -> None:
        self._crew = self._incidents.crew = crew

    def _dispatch(self) -> bool:
        """Hand the next key of the epoch to a worker, if there is a key and a free worker;
        whether one was sent (or its worker found gone and replaced)."""
        schedule = self._schedule
        if schedule.keys_done or not schedule.can_assign() or self._crew.closed:
            return False
        if self._auto.held.configs:  # (the next key may be a held worker's: see HeldWorkers)
            return False
        track, timer = self._track, self._stats.timers["sampler"]
        start = timer.clock()
        try:
            index, key = next(track.keys)
        except StopIteration:
            schedule.keys_done = True
            # The slabs the main process lets go of from now on are retired, not kept for
            # tasks that will not come this epoch (a worker with nothing left keeps no GBs).
            # Persistent workers keep theirs for the next epoch (given back with Resume, within
            # the bound a task's are): retired, every epoch made and faulted its slabs again,
            # in both processes (+25-40 ms a 50 ms epoch of 2 workers, measured).
            if not self._plan.persistent_workers:
                self._crew.channel.no_more_tasks()
            return False
        finally:
            timer.total += timer.clock() - start
        task_id, task = schedule.assign(index, key, sent=start)
        try:
            self._crew.send(task.worker_id, task_id, key)
        except WorkerGone as gone:
            self._incidents.replace(gone.worker)
        return True

    # -- the main loop -------------------------------------------------------------------------

    def _fail(self, exc: BaseException) -> None:
        """``exc`` ends this iterator, and the caller raises it now: the workers stop now. The
        next ``next()`` raises StopIteration (a loop that retries on errors ends, as over
        torch's iterator when its worker died); the position stays at the last batch handed
        out, so a state saved then resumes the epoch there."""
        self._fatal = exc
        self._fatal_raised = True
        self._crew.stop()

    def _next_batch(self) -> Delivery:
        if self._fatal is not None:
            if self._fatal_raised:
                raise IteratorOver
            self._fatal_raised = True
            raise self._fatal
        if self._auto.due:
            self._become_threads()
        elif self._auto.held.due():
            self._start_held()
        try:
            return self._next_result()
        except StopIteration:
            workers = [(w.worker_id, w.pid) for w in self._crew.workers]
            self._crew.rest()  # (no moving round the CPUs until the next epoch)
            measure_at_end(self._stats, workers)  # (the workers' memory, within its share)
            if not self._plan.persistent_workers:
                self._crew.stop()
            raise
        except WorkerDied as exc:
            self._fail(exc)
            raise
        # (WorkerTimeout: the workers go on, and the next next() waits for the same batch
        # again, as torch's does)

    def _become_threads(self) -> None:
        """``num_workers="auto"``: the process workers become threads here (ThreadMove.move)."""
        try:
            crew = self._auto.move(self, self._crew, self._track, self._schedule, self._stats)
        except BaseException as exc:
            self._fail(exc)
            raise
        self._plan = self._track.plan
        self._set_crew(crew)
        self._fill()  # (not full where tasks waited for workers held back)

    def _next_result(self) -> Delivery:
        timeout = self._plan.timeout
        deadline = time.monotonic() + timeout if timeout > 0 else None
        stats = self._stats
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
                    self._incidents.waiting()
                got = self._receive(deadline)
            self._handle(*got)
            if not self._plan.in_order:
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
        if self._crew.pinner is None:
            return
        try:
            while (got := self._poll(0.0)) is not None:
                self._handle(*got)
        except Exception as exc:
            if self._fatal is None:
                self._fail(exc)
            self._fatal_raised = False  # raised at the next next(), not now

    def _pinned(self, batch: Any, number: int) -> Any:
        if isinstance(batch, PinJob):  # pinned by the pin thread since it arrived
            return self._take_pinned(batch, number)
        return super()._pinned(batch, number)

    def _take_pinned(self, job: PinJob, number: int) -> Any:
        try:
            return job.take(self._plan.timeout)
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
        self._auto.held.delivered = True
        self._fill()  # (its place in the window; balanced, maybe to a worker that was full)
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
                self._crew.workers[worker_id].ready = True
                if states is not None:
                    self._track.worker_began(worker_id, states)
                return
            case Stack():
                self._incidents.stacks[worker_id] = message
                return
            case FirstLook(waits=waits):
                self._auto.held.waits = waits  # (held workers start at the next look if not)
                return
            case Failed(task=None):  # a bug of ours ended a thread worker
                exc = self._incidents.worker_exception(message, f"while starting ({message.stage})")
                self._fail(exc)
                raise exc
            case Done(task=task_id) | Exhausted(task=task_id) | Failed(task=int() as task_id) if (
                self._schedule.stale(task_id)
            ):
                # From an abandoned epoch (in-flight counts were reset when the new one began):
                # dropped unread, so what it holds goes straight back.
                if isinstance(message, Done):
                    self._crew.drop(worker_id, message)
                return
            case Exhausted(task=task_id):
                self._schedule.stream_ended(worker_id, TaskId(task_id))
                self._dispatch()
            case Failed(task=task_id):
                assert task_id is not None  # (a failure of ours in a thread is matched above)
                task = self._schedule.arrived(TaskId(task_id))
                what = describe_key(task.key, self._plan.iterable_style)
                if message.stage:  # its set-up raised: the loader cannot go on without it
                    what = f"while starting ({message.stage}), so it could not fetch {what}"
                    task.fatal = True
                elif message.sending:  # (pickling the batch, or its shared memory)
                    what = f"while sending its batch of {what} to the main process"
                else:
                    what = "while fetching " + what
                task.error = self._incidents.worker_exception(message, what)
                if self._schedule.pace is not None:
                    self._fill()
            case Done(task=task_id):
                self._made(worker_id, TaskId(task_id), message)
                if self._schedule.pace is not None:
                    self._fill()  # (this worker can take another task now)
            case _:
                assert_never(message)

    def _made(self, worker_id: int, task_id: TaskId, done: Done) -> None:
        """Worker ``worker_id`` made task ``task_id``'s batch: where it then stood, its
        figures, and the batch, ready to be handed out (or pinned first)."""
        timing = done.timing
        task = self._schedule.arrived(task_id, timing.made_s)
        task.position = self._track.flight.made(worker_id, task.index, done.report)
        stats = self._stats
        stats.worker_made(worker_id, timing, done.cpu)
        if done.memory >= 0:
            stats.worker_memory(worker_id, done.memory, done.memory_faults)
        switch = self._auto.switch
        if switch.active:
            switch.after(done, task.key, stats, self.__len__)
            if switch.judge.decided and not switch.why:
                self._track.reads_compute = True
        task.outcome = done.outcome
        if done.empty:
            task.result = DROPPED
            return
        crew, timer = self._crew, stats.timers["hand_off"]
        start = timer.clock()
        try:
            task.result = crew.batch(worker_id, done)
        finally:
            timer.total += timer.clock() - start
        if crew.pinner is not None:
            task.result = crew.pinner.submit(task.result)

    def _receive(self, deadline: float | None) -> tuple[int, WorkerMessage]:
        """The next message from any worker; raises if a worker died or ``deadline`` passed."""
        held = self._auto.held
        while True:
            if held.due():
                self._start_held()
            left = (
                _WAIT_SLICE if deadline is None else min(_WAIT_SLICE, deadline - time.monotonic())
            )
            if left <= 0:
                raise self._incidents.timeout_error()
            got = self._poll(held.wait_for(left))
            if got is not None:
                return got
            self._incidents.check_stall(self._pump)

    def _pump(self, wait_for: float) -> bool:
        """Handle the next message within ``wait_for`` seconds; False if none came."""
        got = self._poll(wait_for)
        if got is None:
            return False
        self._handle(*got)
        return True

    def _poll(self, wait_for: float) -> tuple[int, WorkerMessage] | None:
        """A message from any worker within ``wait_for`` seconds (0: one already there)."""
        try:
            return self._crew.receive(wait_for, self._schedule.in_flight)
        except WorkerGone as gone:
            self._incidents.replace(gone.worker)
            return None
        except DescriptorLimitReached as exc:
            # Out of descriptors in this process, a slab was lost on its way: the worker's
            # later batches may refer to it, so the iterator cannot go on. (The same error
            # raised in a worker fails only its batch: that worker lives on.)
            self._fail(exc)
            raise

    # -- teardown ------------------------------------------------------------------------------

    @property
    def _workers(self) -> list[WorkerHandle]:
        """The workers' handles, as torch's ``_workers`` (code reads their pids)."""
        return self._crew.workers

    def _shutdown_workers(self) -> None:
        """Stop the workers now (also called by the finalizer)."""
        self._crew.stop()
