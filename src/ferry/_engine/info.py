"""Which worker is running this code: :class:`WorkerInfo` and :func:`get_worker_info`.

A process worker sets the process-wide value once at start-up; a thread worker sets a
thread-local value, so two thread workers of one loader each see their own. The main process
sees None.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["WorkerInfo", "get_worker_info"]


@dataclass(frozen=True, repr=False)
class WorkerInfo:
    """What a worker knows about itself.

    Attributes:
        id: this worker's index, in ``[0, num_workers)``.
        num_workers: how many workers the loader runs.
        seed: the torch seed this worker was given (``base_seed + id``).
        dataset: this worker's copy of the dataset (the shared object for thread workers).

    Example::

        >>> def __iter__(self):
        ...     info = get_worker_info()
        ...     start = 0 if info is None else info.id
        ...     step = 1 if info is None else info.num_workers
        ...     return itertools.islice(self.stream(), start, None, step)
    """

    id: int
    num_workers: int
    seed: int
    dataset: Any

    def __repr__(self) -> str:
        return (
            f"WorkerInfo(id={self.id}, num_workers={self.num_workers}, seed={self.seed}, "
            f"dataset={type(self.dataset).__name__})"
        )


class _ProcessSlot:
    info: WorkerInfo | None = None


_process = _ProcessSlot()
_thread_info = threading.local()


def get_worker_info() -> WorkerInfo | None:
    """The :class:`WorkerInfo` of the worker running the caller, or None in the main process."""
    info: WorkerInfo | None = getattr(_thread_info, "value", None)
    return info if info is not None else _process.info


def set_process_worker_info(info: WorkerInfo | None) -> None:
    """Called once by a process worker before any user code runs."""
    _process.info = info


def set_thread_worker_info(info: WorkerInfo | None) -> None:
    """Called by a thread worker on its own thread."""
    _thread_info.value = info
