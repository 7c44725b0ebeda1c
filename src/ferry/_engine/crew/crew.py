"""One iterator's workers as one unit: :class:`Crew`.

A crew is the workers of one kind (:mod:`~ferry._engine.crew.kinds`) that an iterator runs:
their handles (:class:`~ferry._engine.crew.group.WorkerGroup`), the channel that carries tasks
to them and their messages back, the configuration each was started with, and the finalizer
that stops them all. It is started (all at once, or the first worker before the others),
has a dead worker replaced, and is stopped as a unit; ``num_workers="auto"``'s move to
threads, and the next epoch of workers that do not persist, are a new crew.

The crew holds no reference to its iterator: its finalizer is registered on the iterator
(``weakref.finalize``), so a collected iterator stops its workers, and so does the end of the
epoch, a fatal error, or the interpreter's exit. It knows nothing of keys, positions or
order: the main loop (``pool.py``) asks the scheduler which task goes where and the track
where each worker stands, and tells the crew what to send.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from ferry._engine.crew.channels import Channel, WorkerMessage
from ferry._engine.crew.group import WorkerGroup, WorkerHandle
from ferry._engine.crew.kinds import WorkerKind
from ferry._engine.crew.placement import Tally, WorkerMover
from ferry._engine.crew.worker import WorkerConfig
from ferry._engine.plan import EpochPlan
from ferry._engine.transport.messages import Done
from ferry._engine.transport.pin import Pinner

__all__ = ["Crew"]

H = TypeVar("H", bound=WorkerHandle)


class Crew(Generic[H]):
    """The workers of one kind that one iterator runs (see the module docstring).

    ``owner``: the iterator, on which the finalizer that stops the crew is registered;
    ``replays``: resumed workers fetch again the keys they had fetched since their snapshot
    (process workers of a map-style dataset with a state of its own; see
    :class:`~ferry._engine.position.cursor.WorkerCursor`).
    """

    def __init__(self, owner: object, kind: WorkerKind[H], *, replays: bool = False) -> None:
        self.kind = kind
        self.replays = replays
        self.group: WorkerGroup[H] = WorkerGroup()
        self.stop = weakref.finalize(owner, self.group.shutdown)
        self.channel: Channel[H] = kind.channel(self.group)
        # What each worker was started with (the held ones' too), by worker id.
        self.configs: list[WorkerConfig] = []

    @property
    def workers(self) -> list[H]:
        """The workers' handles, by worker id (a replaced one's place holds the new one)."""
        return self.group.workers

    @property
    def closed(self) -> bool:
        """Whether the crew was stopped."""
        return self.group.closed

    @property
    def pinner(self) -> Pinner | None:
        """The thread that pins the crew's batches as they arrive (``pin_memory=True``)."""
        return self.group.pinner

    def start(self, configs: Sequence[WorkerConfig], plan: EpochPlan) -> None:
        """Start a worker for each of ``configs`` (the crew's first, or those held back); the
        crew is stopped if one cannot start."""
        count = len(self.group.workers)
        try:
            self.kind.start(self.group, list(configs), plan)
        except BaseException:
            self.stop()
            raise
        self.channel.joined(self.group.workers[count:])

    def replace(self, dead: H, config: WorkerConfig, plan: EpochPlan) -> H:
        """Start a worker in ``dead``'s place, with ``config``; it is watched from now on."""
        new = self.kind.replace(self.group, config, plan)
        self.channel.replaced(dead, new)
        self.configs[config.worker_id] = config
        return new

    def send(self, worker_id: int, task: int, key: Any) -> None:
        """Ask worker ``worker_id`` for batch ``task`` from ``key`` (WorkerGone: it is gone)."""
        self.channel.send_task(self.group.workers[worker_id], task, key)
        if self.group.tally is not None:
            self.group.tally.asked(worker_id, key)

    def receive(
        self, wait_for: float, in_flight: Sequence[int]
    ) -> tuple[int, WorkerMessage] | None:
        """The next message of any worker within ``wait_for`` seconds (see Channel.receive)."""
        return self.channel.receive(wait_for, in_flight)

    def resume(self) -> list[H]:
        """A new epoch begins (persistent workers): each worker is told, and will say again
        what its states are if the crew replays. The workers found gone are returned."""
        gone = []
        if self.group.tally is not None:
            self.group.tally.new_epoch()
        for worker in list(self.group.workers):
            try:
                worker.ready = not self.replays
                self.channel.resume(worker)
            except OSError:  # it died between epochs
                gone.append(worker)
        return gone

    def batch(self, worker_id: int, done: Done) -> Any:
        """The batch ``done`` carries, ready for the user (or for the pin thread)."""
        return self.channel.batch(worker_id, done)

    def drop(self, worker_id: int, done: Done) -> None:
        """``done`` belongs to an abandoned epoch: it is dropped unread."""
        self.channel.drop(worker_id, done)

    def pin(self, plan: EpochPlan) -> None:
        """Start (or stop, when turned off between epochs) the thread that pins batches."""
        group = self.group
        if plan.pin and group.pinner is None and not group.closed:
            group.pinner = Pinner(plan.pin_memory_device)
        elif not plan.pin and group.pinner is not None:
            group.pinner.close()
            group.pinner = None

    def move(self, plan: EpochPlan) -> None:
        """Move the process workers round their CPUs from now on, this epoch
        (``move_workers``; see :mod:`~ferry._engine.crew.placement`): the thread that does it
        is started on the first call, once every worker is forked."""
        group = self.group
        if not plan.move_workers or self.kind.name != "process" or group.closed:
            return
        if group.mover is None:
            workers, tally = group.workers, group.tally
            progress = None
            if tally is not None:

                def progress() -> dict[int, tuple[int, int]]:
                    made, asked = tally.counts, tally.sent
                    return {
                        w.pid: (made[w.worker_id], asked[w.worker_id])
                        for w in list(workers)
                        if w.pid is not None
                    }

            group.mover = WorkerMover(
                lambda: [w.pid for w in list(workers) if w.pid is not None], progress=progress
            )
        group.mover.resume()

    def tally(self, plan: EpochPlan) -> Tally | None:
        """Where the workers count the samples they make, for the thread that moves them
        (process workers that are moved: see :class:`~ferry._engine.crew.placement.Tally`);
        made with the crew's first workers."""
        group = self.group
        if group.tally is None and plan.move_workers and self.kind.name == "process":
            group.tally = Tally.new(plan.num_workers)
        return group.tally

    def rest(self) -> None:
        """The epoch ended: the workers stay where they are until :meth:`move` again."""
        if self.group.mover is not None:
            self.group.mover.pause()
