"""Stall reports: what each worker is doing when no batch has come for ``stall_warning`` s.

The report names every worker that holds unfinished batches, the batch it is fetching (its
indices, and for how long), the batches queued behind it, and the Python stack of the
worker's main thread: read directly for a thread worker, and for a process worker asked of
its reader thread, which answers while the main thread is stuck (a worker stuck in native code
that holds the GIL cannot answer; the report says so). The training loop keeps waiting.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from ferry._engine.crew.group import ThreadHandle
from ferry._engine.transport.messages import Stack
from ferry.errors import describe_key

__all__ = ["STACK_REPLY_TIMEOUT", "stall_message", "thread_stacks"]

# How long the main process waits for process workers to answer with their stacks.
STACK_REPLY_TIMEOUT = 1.0


class Pending(NamedTuple):
    """An unfinished task."""

    task: int  # the engine's task number
    worker_id: int
    number: int  # the batch's number in the epoch
    key: Any
    sent: float  # time.perf_counter() when it was handed to the worker


class Holder(NamedTuple):
    """A worker holding unfinished tasks."""

    pid: int | None
    stack: Stack | None  # its answer (None: it gave none)
    starting_for: float | None  # seconds since it was started, if not ready yet


def thread_stacks(workers: Sequence[ThreadHandle], worker_ids: list[int]) -> dict[int, Stack]:
    """What thread workers ``worker_ids`` are doing, read from the main thread."""
    return {worker_id: workers[worker_id].stack() for worker_id in worker_ids}


def stall_message(
    *,
    waited: float,
    limit: float,
    pending: list[Pending],
    waiting_for: int,
    holders: dict[int, Holder],
    iterable: bool,
) -> str:
    """The report: ``pending`` tasks, the loop ``waiting_for`` task number, and each worker
    that holds some."""
    batch = next((p.number for p in pending if p.task == waiting_for), None)
    what = f"batch {batch}" if batch is not None else "the next batch"
    lines = [
        f"DataLoader stalled: the training loop has waited {_seconds(waited)} for {what} "
        f"(stall_warning={limit:g}). Workers holding unfinished batches:"
    ]
    for worker_id, holder in sorted(holders.items()):
        tasks = sorted(p for p in pending if p.worker_id == worker_id)
        lines.extend(
            _describe_holder(f"  worker {worker_id} (pid {holder.pid})", holder, tasks, iterable)
        )
    if not holders:
        lines.append("  none: every batch asked for has arrived (a bug of ferry's: please report)")
    lines.append(
        "Training goes on waiting. Set timeout=SECONDS to raise instead, or stall_warning=None "
        "to silence this report."
    )
    return "\n".join(lines)


def _describe_holder(head: str, holder: Holder, tasks: list[Pending], iterable: bool) -> list[str]:
    now = time.monotonic()
    stack = holder.stack
    current = next((t for t in tasks if stack is not None and t.task == stack.task), None)
    if holder.starting_for is not None and current is None:
        lines = [
            f"{head}: still starting, {holder.starting_for:.1f} s after it was started "
            + (
                "(in worker_init_fn or opening its dataset: see its stack)"
                if stack is not None
                else "(it cannot answer yet: a spawn or forkserver worker first imports the "
                "main module and unpickles the dataset; then worker_init_fn runs)"
            )
        ]
    elif current is not None:
        assert stack is not None
        lines = [
            f"{head}: fetching batch {current.number} ({describe_key(current.key, iterable)}) "
            f"for {now - stack.since:.1f} s"
        ]
        tasks = [t for t in tasks if t is not current]
    elif stack is not None:
        lines = [f"{head}: between batches (in user code outside a fetch, or starting up)"]
    else:
        lines = [
            f"{head}: did not answer within {STACK_REPLY_TIMEOUT:g} s (native code holding the "
            "GIL, or a stopped process)"
        ]
    lines += [
        f"    then batch {number} ({describe_key(key, iterable)}), handed to it "
        f"{time.perf_counter() - sent:.1f} s ago"
        for _, _, number, key, sent in tasks
    ]
    if stack is not None:
        lines.append("    its stack (most recent call last):")
        lines += ["    " + line for line in stack.stack.rstrip().splitlines()]
    return lines


def _seconds(waited: float) -> str:
    """Whole seconds from 10 s on; a sub-second or few-second threshold keeps its precision."""
    return f"{waited:.0f} s" if waited >= 10 else f"{waited:.2g} s"
