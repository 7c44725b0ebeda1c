"""Copying batches into page-locked (pinned) host memory for fast transfer to an accelerator.

In the main process (``num_workers=0``) a batch is pinned when it is handed out, as torch
does. With workers, a :class:`Pinner` pins each batch in a background thread as soon as it
arrives from its worker, so the copy overlaps the training step (the copy releases the GIL)
instead of adding to every ``next()``; the loop then only waits for a batch that is not pinned
yet. The thread works on the accelerator device that was current where the loader was iterated
(a new thread starts on device 0, which would make a context there on every rank of a
multi-GPU job).
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ferry._core.intra_op import one_intra_op_thread, settle
from ferry._structure import rebuild_mapping, rebuild_sequence

__all__ = [
    "PinJob",
    "Pinner",
    "accelerator_available",
    "accelerator_type",
    "device_setter",
    "pin_batch",
]

# How often a wait for a pinned batch checks that the pin thread is still there.
_CHECK_EVERY = 0.5
# How long shutdown waits for a pin in progress (one batch's copy).
_JOIN_TIMEOUT = 2.0


def accelerator_available() -> bool:
    """Whether pinning means anything here: an accelerator (CUDA, XPU, MPS, ...) is present."""
    return accelerator_type() is not None


def accelerator_type() -> str | None:
    """The kind of the current accelerator ("cuda", "xpu", "mps", ...), None without one."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None:
        if not accelerator.is_available():
            return None
        current = accelerator.current_accelerator()
        return None if current is None else str(current.type)
    return "cuda" if torch.cuda.is_available() else None


def _pin_tensor(tensor: torch.Tensor, device: str) -> torch.Tensor:
    if not device:
        return tensor.pin_memory()
    with warnings.catch_warnings():
        # Naming the device is deprecated in recent torch but still what the user asked for.
        warnings.simplefilter("ignore", DeprecationWarning)
        return tensor.pin_memory(device)


def pin_batch(batch: Any, device: str = "") -> Any:
    """``batch`` with its tensors in pinned memory, rebuilt as torch rebuilds it.

    In torch's order: a tensor is pinned; any object with a ``pin_memory()`` method pins
    itself (containers too); str and bytes stay; mappings, tuples (namedtuples and plain, type
    kept) and sequences are rebuilt around pinned items; anything else is returned as is.
    """
    if isinstance(batch, torch.Tensor):
        return _pin_tensor(batch, device)
    if hasattr(batch, "pin_memory"):
        return batch.pin_memory()
    if isinstance(batch, (str, bytes)):
        return batch
    if isinstance(batch, Mapping):
        return rebuild_mapping(batch, {k: pin_batch(v, device) for k, v in batch.items()})
    if isinstance(batch, tuple):
        items = (pin_batch(v, device) for v in batch)
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    if isinstance(batch, Sequence):
        return rebuild_sequence(batch, [pin_batch(v, device) for v in batch])
    return batch


def device_setter() -> Callable[[], None] | None:
    """A function that makes the calling thread use the accelerator device that is current in
    this thread now (None if there is no accelerator to choose)."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None and hasattr(accelerator, "current_device_index"):
        if not accelerator.is_available():
            return None
        index = accelerator.current_device_index()
        return lambda: accelerator.set_device_index(index)
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        return lambda: torch.cuda.set_device(index)
    return None


class PinJob:
    """A batch on its way to pinned memory; :meth:`Pinner.take` returns the pinned batch."""

    __slots__ = ("batch", "claimed", "done", "error", "pinned", "pinner")

    def __init__(self, batch: Any, pinner: Pinner) -> None:
        self.batch = batch
        self.pinner = pinner
        self.claimed = False  # a thread has begun pinning it
        self.pinned: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def take(self, timeout: float = 0) -> Any:
        """The pinned batch, waiting for it if need be (see :meth:`Pinner.take`)."""
        return self.pinner.take(self, timeout)


class Pinner:
    """One background thread that pins batches in the order they are submitted.

    An error raised while pinning a batch is raised where that batch is taken, as torch raises
    an error of its pin thread at that batch. After :meth:`close`, a batch not pinned yet is
    pinned by the thread that takes it.
    """

    def __init__(self, device: str = "") -> None:
        self._device = device
        self._jobs: queue.SimpleQueue[PinJob | None] = queue.SimpleQueue()
        self._claims = threading.Lock()
        self._closed = False
        settle()
        self._thread = threading.Thread(
            target=self._run, args=(device_setter(),), name="ferry-pin", daemon=True
        )
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def submit(self, batch: Any) -> PinJob:
        job = PinJob(batch, self)
        if not self._closed:
            self._jobs.put(job)
        return job

    def take(self, job: PinJob, timeout: float = 0) -> Any:
        """The pinned batch of ``job``, waiting for it if need be: at most ``timeout`` seconds
        if it is positive (then :class:`TimeoutError`), as the loader's ``timeout`` bounds
        torch's wait for its pin thread."""
        deadline = time.monotonic() + timeout if timeout > 0 else None
        while not job.done.is_set():
            alive = self._thread.is_alive()
            if (self._closed or not alive) and self._claim(job):
                self._pin(job, None)
            elif not alive and not job.done.is_set():  # (gone in the middle of it: at exit)
                raise RuntimeError("the pin_memory thread ended while pinning a batch")
            elif deadline is None:
                job.done.wait(_CHECK_EVERY)
            elif (left := deadline - time.monotonic()) > 0:
                job.done.wait(min(left, _CHECK_EVERY))
            else:
                raise TimeoutError(f"the batch was not pinned within {timeout} s")
        batch, error = job.pinned, job.error
        job.pinned = job.error = None
        if error is not None:
            try:
                raise error
            finally:
                del error  # (no cycle through this frame)
        return batch

    def close(self) -> None:
        """Stop the thread once the batch it is pinning, if any, is done; bounded."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(_JOIN_TIMEOUT)

    def _claim(self, job: PinJob) -> bool:
        with self._claims:
            if job.claimed:
                return False
            job.claimed = True
            return True

    def _pin(self, job: PinJob, failed: BaseException | None) -> None:
        try:
            if failed is not None:
                raise RuntimeError(
                    "pin_memory=True: the pin_memory thread could not select the accelerator "
                    "device this loader was iterated on"
                ) from failed
            job.pinned = pin_batch(job.batch, self._device)
        except BaseException as exc:
            job.error = exc
        job.batch = None
        job.done.set()

    def _run(self, use_device: Callable[[], None] | None) -> None:
        # As torch's pin thread: one intra-op thread here, so that the copy does not take
        # cores from the workers and the training step (and, unlike torch's, the training
        # step's own count is left alone: one_intra_op_thread's docstring).
        one_intra_op_thread()
        failed: BaseException | None = None
        if use_device is not None:
            try:
                use_device()
            except Exception as exc:
                failed = exc
        while (job := self._jobs.get()) is not None:
            if not self._closed and self._claim(job):
                self._pin(job, failed)
