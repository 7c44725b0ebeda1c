"""Which worker is running this code: :class:`WorkerInfo` and :func:`get_worker_info`.

A process worker sets the process-wide value once at start-up; a thread worker sets a
thread-local value, so two thread workers of one loader each see their own. The main process
sees None.

Interplay with torch, both ways, so datasets written for either library shard correctly:

* a ferry process worker also publishes its info where ``torch.utils.data.get_worker_info()``
  reads it, so datasets that ask torch (third-party ones included) see the worker they run in;
* inside one of torch's own workers, :func:`get_worker_info` returns torch's info.

* thread workers cannot publish to torch's value (it is process-wide), so when the first thread
  workers start, ``torch.utils.data.get_worker_info`` (the module attribute, in both modules
  that hold it) is replaced by :func:`torch_get_worker_info`: the calling thread's ferry info
  if it is a ferry worker thread, else exactly what torch's function returns. Datasets that
  call ``torch.utils.data.get_worker_info()`` (Hugging Face ``datasets`` streams do) then shard
  across thread workers as they do across processes. A module that bound torch's function to a
  name of its own before that (``from torch.utils.data import get_worker_info`` at import
  time) still holds torch's, which answers None in every thread: :func:`check_thread_sharding`
  finds such a dataset and the loader refuses it at ``iter()`` rather than let every thread
  read the whole stream.

None of this needs an import: ``import torch`` has already loaded torch's modules, which are
looked up in ``sys.modules``.
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


# Where torch keeps the info of its own workers (a module torch loads on ``import torch``), and
# the modules that export its get_worker_info.
_TORCH_WORKER_MODULE = "torch.utils.data._utils.worker"
_TORCH_EXPORTING_MODULES = ("torch.utils.data", _TORCH_WORKER_MODULE)


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
    """Called by a thread worker on its own thread (and by a read it asks of another thread)."""
    _thread_info.value = info


def thread_worker_info() -> WorkerInfo | None:
    """The :class:`WorkerInfo` of the thread worker that is this thread (None: not one)."""
    return getattr(_thread_info, "value", None)


def torch_get_worker_info() -> Any:
    """What ``torch.utils.data.get_worker_info()`` answers once thread workers have started.

    In a ferry worker thread, that thread's :class:`WorkerInfo`; anywhere else, torch's own
    value (its workers' info, or None), read as torch's function reads it.
    """
    info = getattr(_thread_info, "value", None)
    if info is not None:
        return info
    torch_module = _torch_worker_module()
    return None if torch_module is None else torch_module._worker_info


class _TorchFunction:
    """torch's own ``get_worker_info``, kept when :func:`publish_threads_to_torch` replaces it."""

    original: Any = None


def _torch_original() -> Any:
    if _TorchFunction.original is None:
        module = sys.modules.get(_TORCH_WORKER_MODULE)
        _TorchFunction.original = getattr(module, "get_worker_info", None)
    return _TorchFunction.original


_publish_lock = threading.Lock()


def publish_threads_to_torch() -> None:
    """Make ``torch.utils.data.get_worker_info()`` see ferry's worker threads (idempotent)."""
    with _publish_lock:
        _torch_original()
        for name in _TORCH_EXPORTING_MODULES:
            module = sys.modules.get(name)
            if module is not None and getattr(module, "get_worker_info", None) is not (
                torch_get_worker_info
            ):
                module.get_worker_info = torch_get_worker_info  # type: ignore[attr-defined]


def check_thread_sharding(dataset: object) -> None:
    """Refuse a stream that would be read whole by every worker thread.

    That is a dataset whose class is defined in a module that holds torch's original
    ``get_worker_info`` under a name of its own: that function answers None in every thread,
    so each thread would take itself for the only reader.
    """
    original = _torch_original()
    if original is None:
        return
    for cls in type(dataset).__mro__:
        module = sys.modules.get(cls.__module__)
        if module is None or cls.__module__.startswith(("torch.", "ferry.")):
            continue
        names = [k for k, v in vars(module).items() if v is original]
        if names:
            raise RuntimeError(
                f"worker_type='thread' cannot shard {type(dataset).__name__}: its module "
                f"{cls.__module__} holds torch's get_worker_info as {names[0]!r} (imported with "
                "`from torch.utils.data import get_worker_info` before the workers started), "
                "which answers None in every thread, so each thread would read the whole "
                "stream. Call torch.utils.data.get_worker_info() through the module, or "
                "ferry.get_worker_info(), or use worker_type='process'."
            )
