"""Which worker is running this code: :class:`WorkerInfo` and :func:`get_worker_info`.

A process worker sets the process-wide value once at start-up; a thread worker sets a
thread-local value, so two thread workers of one loader each see their own. The main process
sees None.

Interplay with torch, both ways, so datasets written for either library shard correctly:

* a ferry process worker also publishes its info where ``torch.utils.data.get_worker_info()``
  reads it, so datasets that ask torch (third-party ones included) see the worker they run in;
* inside one of torch's own workers, :func:`get_worker_info` returns torch's info.

Neither needs an import: ``import torch`` has already loaded torch's worker module, which is
looked up in ``sys.modules``. Thread workers cannot publish to torch (its value is
process-wide), so datasets run by thread workers must ask ferry.
"""

from __future__ import annotations

import sys
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


# Where torch keeps the info of its own workers (a module torch loads on ``import torch``).
_TORCH_WORKER_MODULE = "torch.utils.data._utils.worker"


def _torch_worker_module() -> Any:
    module = sys.modules.get(_TORCH_WORKER_MODULE)
    return module if module is not None and hasattr(module, "_worker_info") else None


def get_worker_info() -> WorkerInfo | None:
    """The :class:`WorkerInfo` of the worker running the caller, or None in the main process.

    Inside a worker of torch's own ``DataLoader``, torch's worker info (same attributes).
    """
    info: WorkerInfo | None = getattr(_thread_info, "value", None)
    if info is None:
        info = _process.info
    if info is None and (torch_module := _torch_worker_module()) is not None:
        info = torch_module._worker_info
    return info


def set_process_worker_info(info: WorkerInfo | None) -> None:
    """Called once by a process worker before any user code runs; also tells torch."""
    _process.info = info
    torch_module = _torch_worker_module()
    if torch_module is not None:
        torch_module._worker_info = info


def set_thread_worker_info(info: WorkerInfo | None) -> None:
    """Called by a thread worker on its own thread."""
    _thread_info.value = info
