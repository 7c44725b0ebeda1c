"""The two kinds of workers, each one object that knows how its workers start, are replaced,
say what they are doing, and talk to the main process: chosen once per iterator
(:func:`worker_kind`), so the engine asks the kind instead of testing a flag.

* :class:`ProcessWorkers`: one process each, started with the loader's multiprocessing context;
  batches come back through shared-memory slabs (by name under torch's ``file_system`` sharing
  strategy); each worker seeds and reports its own generators; a dead one can be replaced
  (``max_worker_restarts``); a stuck one says its stack when asked (its reader thread answers).
* :class:`ThreadWorkers`: one thread each in the main process, sharing the dataset (a dataset
  resumed from a count of samples: a copy each, see
  :func:`~ferry._engine.position.counted.own_copies`), its generators and one pool of
  per-sample reads; batches are handed over as they are; a thread dies only of a bug of
  ferry's, so it is never replaced; its stack is read from here.

Each kind's workers are held by handles of its own
(:class:`~ferry._engine.crew.group.ProcessHandle`,
:class:`~ferry._engine.crew.group.ThreadHandle`), which its channel and its methods take. The
teardown of both is :meth:`ferry._engine.crew.group.WorkerGroup.shutdown`, which runs the steps of
the group's kind.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Generic, TypeVar

from ferry._core.info import publish_threads_to_torch
from ferry._engine.crew.channels import Channel, ProcessChannel, ThreadChannel
from ferry._engine.crew.group import (
    ProcessHandle,
    ThreadHandle,
    WorkerGroup,
    WorkerHandle,
    replace_process,
    start_processes,
    start_threads,
)
from ferry._engine.crew.stall import thread_stacks
from ferry._engine.crew.worker import WorkerConfig
from ferry._engine.plan import EpochPlan
from ferry._engine.position.counted import own_copies
from ferry._engine.transport.messages import Stack, StackRequest
from ferry._engine.transport.slabfile import named_slabs
from ferry._engine.work.reads import SampleReads

__all__ = ["ProcessWorkers", "ThreadWorkers", "WorkerKind", "worker_kind"]

H = TypeVar("H", bound=WorkerHandle)

# The most bytes the epoch's first key may leave in the main process, for worker 0 to be sent
# its first task before the other workers are forked (each of which would keep that much).
EARLY_DRAW_LIMIT = 1 << 20


class WorkerKind(Generic[H]):
    """What differs between process and thread workers, whose handles are ``H`` (see the
    module docstring)."""

    name = ""
    # Each worker reports (and, on resume, restores) its own generators: processes have
    # their own; thread workers draw from the main process's, which are the user's.
    tracks_rng = False
    # A worker that died can be started again in its place.
    replaceable = False
    # Each worker holds its own copy of the dataset (a state of the dataset's own moves with
    # the worker, and is replayed on resume: see WorkerCursor.since).
    copies_dataset = False

    def slabs_by_name(self) -> bool:
        """Whether batches travel in named shared-memory files (torch's ``file_system``)."""
        return False

    def shared_reads(self) -> SampleReads | None:
        """The pool of per-sample reads every worker of the group shares, if any."""
        return None

    def start(self, group: WorkerGroup[H], configs: list[WorkerConfig], plan: EpochPlan) -> None:
        """Start the workers of ``configs`` (more may be started later, in order)."""
        raise NotImplementedError

    def send_before_all_start(self, plan: EpochPlan, first_draw_bytes: int | None) -> bool:
        """Whether worker 0 may be sent its first task before the others are started, drawing
        the epoch's first key (leaving up to ``first_draw_bytes`` here; None: unknown)."""
        return False

    def channel(self, group: WorkerGroup[H]) -> Channel[H]:
        raise NotImplementedError

    def replace(self, group: WorkerGroup[H], config: WorkerConfig, plan: EpochPlan) -> H:
        """Start a worker in the place of ``config.worker_id``, which died."""
        raise NotImplementedError(f"{self.name} workers are not replaced")

    def stacks(
        self,
        workers: list[H],
        holding: list[int],
        answers: Callable[[list[int]], dict[int, Stack]],
    ) -> dict[int, Stack]:
        """What workers ``holding`` are doing (for a stall report); ``answers`` waits for
        the :class:`Stack` messages of the workers asked."""
        raise NotImplementedError


class ProcessWorkers(WorkerKind[ProcessHandle]):
    name = "process"
    tracks_rng = True
    replaceable = True
    copies_dataset = True

    def slabs_by_name(self) -> bool:
        return named_slabs()

    def start(
        self, group: WorkerGroup[ProcessHandle], configs: list[WorkerConfig], plan: EpochPlan
    ) -> None:
        start_processes(group, configs, _context(plan))

    def send_before_all_start(self, plan: EpochPlan, first_draw_bytes: int | None) -> bool:
        # Starting a process takes milliseconds (a fork copies the page tables of a process
        # holding torch; spawn pickles the dataset), so the first batch begins a worker's start
        # sooner. A worker forked after the draw shares the pages it left, and keeps them alone
        # once this process has let them go: only a draw known to be small goes first.
        if _context(plan).get_start_method() != "fork":
            return True
        return first_draw_bytes is not None and first_draw_bytes <= EARLY_DRAW_LIMIT

    def channel(self, group: WorkerGroup[ProcessHandle]) -> Channel[ProcessHandle]:
        return ProcessChannel(group)

    def replace(
        self, group: WorkerGroup[ProcessHandle], config: WorkerConfig, plan: EpochPlan
    ) -> ProcessHandle:
        return replace_process(group, config, _context(plan))

    def stacks(
        self,
        workers: list[ProcessHandle],
        holding: list[int],
        answers: Callable[[list[int]], dict[int, Stack]],
    ) -> dict[int, Stack]:
        # The worker's reader thread answers, while its main thread may be the one stuck.
        for worker_id in holding:
            with contextlib.suppress(OSError):
                workers[worker_id].send(StackRequest())
        return answers(holding)


class ThreadWorkers(WorkerKind[ThreadHandle]):
    name = "thread"

    def shared_reads(self) -> SampleReads | None:
        reads = SampleReads()
        reads.warm()
        return reads

    def start(
        self, group: WorkerGroup[ThreadHandle], configs: list[WorkerConfig], plan: EpochPlan
    ) -> None:
        copies = own_copies(plan.dataset, len(configs)) if plan.iterable_style else None
        if copies is not None:  # (each thread iterates its own: see own_copies)
            configs = [replace(c, dataset=d) for c, d in zip(configs, copies, strict=True)]
        publish_threads_to_torch()
        start_threads(group, configs, plan)

    def channel(self, group: WorkerGroup[ThreadHandle]) -> Channel[ThreadHandle]:
        return ThreadChannel(group)

    def stacks(
        self,
        workers: list[ThreadHandle],
        holding: list[int],
        answers: Callable[[list[int]], dict[int, Stack]],
    ) -> dict[int, Stack]:
        return thread_stacks(workers, holding)  # (read from here: they share this process)


def worker_kind(worker_type: str) -> WorkerKind[Any]:
    """The kind of workers ``worker_type`` ("process" or "thread") names."""
    return ThreadWorkers() if worker_type == "thread" else ProcessWorkers()


def _context(plan: EpochPlan) -> multiprocessing.context.BaseContext:
    """The loader's multiprocessing context, or the default one."""
    return plan.multiprocessing_context or multiprocessing.get_context()
