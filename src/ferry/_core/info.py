"""Which worker is running this code: :class:`WorkerInfo` and :func:`get_worker_info`.

A process worker sets the process-wide value once at start-up; a thread worker sets a
thread-local value, so two thread workers of one loader each see their own. The main process
sees None.

Interplay with torch, both ways, so datasets written for either library shard correctly:

* a ferry process worker also publishes its info where ``torch.utils.data.get_worker_info()``
  reads it, so datasets that ask torch (third-party ones included) see the worker they run in;
* inside one of torch's own workers, :func:`get_worker_info` returns torch's info.

* thread workers cannot publish to torch's value (it is process-wide), so when the first thread
  workers start, torch's ``get_worker_info`` is replaced by :func:`torch_get_worker_info` (the
  calling thread's ferry info if it is a ferry worker thread, else exactly what torch's
  function returns) wherever a loaded module holds it: the module attribute in torch's two
  modules that export it, and every name a module bound it to at import
  (``from torch.utils.data import get_worker_info``, as MosaicML Streaming, litdata and many
  user datasets do). A module imported later can only bind the replacement. Datasets written
  for torch then shard across thread workers as they do across processes. Outside ferry's
  worker threads the replacement answers what torch's function does, so nothing else changes.
  What it cannot reach is a copy of the function kept elsewhere than a module's globals (a
  default argument, a container).

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
        rng: as torch's field (its thread workers' own generators): None, since ferry's
            thread workers share the process's generators.
        worker_method: ``"multiprocessing"`` for a process worker, ``"thread"`` for a thread
            worker, as torch names them.

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
    rng: Any = None
    worker_method: str | None = "multiprocessing"

    def __repr__(self) -> str:
        # torch's form: every field, each value's repr (the dataset's included)
        fields = ("id", "num_workers", "seed", "dataset", "rng", "worker_method")
        return f"WorkerInfo({', '.join(f'{name}={getattr(self, name)!r}' for name in fields)})"


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
    # The modules already looked at, by name (a module replaced under its name is new).
    seen: dict[str, Any] = {}  # noqa: RUF012


def _torch_original() -> Any:
    if _TorchFunction.original is None:
        module = sys.modules.get(_TORCH_WORKER_MODULE)
        _TorchFunction.original = getattr(module, "get_worker_info", None)
    return _TorchFunction.original


_publish_lock = threading.Lock()


def publish_threads_to_torch() -> None:
    """Make torch's ``get_worker_info`` see ferry's worker threads, wherever a loaded module
    holds it (idempotent; each module is looked at once, the first time thread workers start
    after it was loaded)."""
    with _publish_lock:
        original = _torch_original()
        if original is None:
            return
        seen = _TorchFunction.seen
        for key, module in list(sys.modules.items()):
            if seen.get(key) is module:
                continue
            seen[key] = module
            names = getattr(module, "__dict__", None)
            if not isinstance(names, dict):
                continue
            try:
                bound = [name for name, value in list(names.items()) if value is original]
                for name in bound:
                    setattr(module, name, torch_get_worker_info)
            except Exception:  # an odd module object: leave it as it is
                continue
