"""Async datasets: a map-style dataset whose ``__getitem__`` (or ``__getitems__``) is a coroutine
function, read on an event loop that ferry owns.

``async def __getitem__`` is the natural way to read from an object store with an async client;
torch hands the coroutine objects to ``collate_fn`` (a ``TypeError``, and "coroutine was never
awaited" warnings). ferry awaits them: :class:`AsyncReads` owns an asyncio event loop on a
daemon thread (``ferry-aio``, started at the first read), and a fetcher hands it the keys of a
batch, from whatever thread fetches (the main thread inline, a worker thread, a worker
process's main thread):

* Without ``__getitems__``, ``dataset[key]`` is called for every key in the fetching thread
  (for ``async def`` that only makes the coroutine; a wrapper such as :class:`~ferry.Subset`
  maps its index there and returns the inner dataset's coroutine), then every awaitable is
  awaited on the loop at once, at most :data:`IN_FLIGHT` in flight per loop (a semaphore).
* An async ``__getitems__(keys)`` is awaited as one coroutine (one of the :data:`IN_FLIGHT`),
  and so is a sync one that returns an awaitable; a batch whose samples are awaitables (a
  wrapper's ``__getitems__`` over an async ``__getitem__``) has them awaited as above.
* A batch is what the equivalent sync dataset gives: samples in key order, the error of the
  first failing key in key order (reads after it are cancelled and awaited before it is
  raised), and with ``on_error="skip"`` every failing key reported, in order. ``StopIteration``
  raised in a coroutine (which Python turns into ``RuntimeError``) is raised as itself, so it
  ends the epoch as a sync ``__getitem__``'s does.

One loop per process that reads: the main process's (inline; the loader's thread workers share
one), and one in each worker process (its own, made there; it dies with the process). The loop
stops when its owner is done: the worker group's shutdown, the inline iterator's epoch end or
its garbage collection (a ``weakref.finalize``: the loop's thread holds no reference to its
owner).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ferry._engine.work.reads import Failed
from ferry._torch_types import TorchConcatDataset, TorchSubset

__all__ = ["IN_FLIGHT", "AsyncReads", "is_async_dataset"]

# At most this many awaits in flight on one loop (one per process that reads).
IN_FLIGHT = 64
# How long a stopping loop gives the reads still in flight to take their cancellation.
_CANCEL_GRACE = 1.0


def _coroutine_method(obj: object, name: str) -> bool:
    return inspect.iscoroutinefunction(getattr(type(obj), name, None))


def is_async_dataset(dataset: object, _depth: int = 0) -> bool:
    """Whether reading ``dataset`` gives awaitables: its ``__getitem__`` or ``__getitems__`` is
    a coroutine function, or it is a :class:`~ferry.Subset` or :class:`~ferry.ConcatDataset`
    (ferry's or torch's) over such a dataset (a ``StackDataset``'s samples would be tuples of
    coroutines: not supported). Decided once per fetcher: a sync dataset's reads are
    untouched."""
    if _coroutine_method(dataset, "__getitem__") or _coroutine_method(dataset, "__getitems__"):
        return True
    if _depth > 16:
        return False
    inner: Any = ()
    if isinstance(dataset, TorchSubset):
        inner = (dataset.dataset,)
    elif isinstance(dataset, TorchConcatDataset):
        inner = dataset.datasets
    return any(is_async_dataset(part, _depth + 1) for part in inner)


def _unwrapped(exc: BaseException) -> BaseException:
    """A coroutine that raised StopIteration raises RuntimeError from it (PEP 479): give back
    the StopIteration, which ends a map-style epoch."""
    if isinstance(exc, RuntimeError) and isinstance(exc.__cause__, StopIteration):
        return exc.__cause__
    return exc


async def _first(samples: Awaitable[Sequence[Any]]) -> Any:
    """The one sample of an awaited ``__getitems__([key])``, awaited if it is awaitable."""
    sample = (await samples)[0]
    return (await sample) if inspect.isawaitable(sample) else sample


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    """The ``ferry-aio`` thread: run ``loop`` until it is stopped, then cancel what is left."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        try:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.wait(tasks, timeout=_CANCEL_GRACE))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread, pid: int, wait: float) -> None:
    """Stop ``loop`` and wait up to ``wait`` seconds for its thread (only in the process that
    started it: a forked child has a copy of neither)."""
    if os.getpid() != pid:
        return
    with contextlib.suppress(RuntimeError):  # (closed already)
        loop.call_soon_threadsafe(loop.stop)
    if thread is not threading.current_thread():
        thread.join(wait)


class AsyncReads:
    """Reads an async dataset's samples on an event loop of its own (see the module docstring).
    Thread-safe: the thread workers of a loader share one. Takes the place of
    :class:`~ferry._engine.work.reads.SampleReads` in a
    :class:`~ferry._engine.work.fetch.MapFetcher`."""

    ratio = 0.0  # (statistics: the wait over CPU of a read is not measured on a loop)
    cpu_seconds = 0.0  # (nor its CPU)

    def __init__(self, limit: int = IN_FLIGHT) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = 0  # the process whose loop ``_loop`` is
        self._slots: asyncio.Semaphore | None = None
        self._stopper: Any = None  # the weakref.finalize that stops the loop
        # The most reads of one batch in flight at once (for the statistics, as SampleReads').
        self.peak_width = 1

    def __reduce__(self) -> tuple[Callable[..., AsyncReads], tuple[int]]:
        return AsyncReads, (self.limit,)  # (a process worker gets a fresh one, its loop unmade)

    # -- what a fetcher asks ---------------------------------------------------------------------

    def read(self, dataset: Any, keys: Sequence[Any], collect: bool = False) -> list[Any]:
        """The samples of ``keys`` as the sync equivalent of ``dataset`` would fetch them
        (``__getitems__`` when it has one, else ``dataset[key]`` per key), awaited. With
        ``collect``, a key whose read raises gives a :class:`Failed` in its place
        (``StopIteration`` still ends the epoch); else the first failing key's error is raised."""
        getitems = getattr(dataset, "__getitems__", None)
        if not callable(getitems):
            return self._settle(self._each(lambda key: dataset[key], keys, collect), collect)
        try:
            return self._batch(getitems, keys)
        except StopIteration:
            raise
        except Exception:
            if not collect:
                raise

        # on_error="skip": the batch in one go failed; key by key (at once), as the sync path
        # does one after another.
        def single(key: Any) -> Any:
            samples = getitems([key])
            return _first(samples) if inspect.isawaitable(samples) else samples[0]

        return self._settle(self._each(single, keys, True), True)

    def one(self, dataset: Any, key: Any) -> Any:
        """``dataset[key]``, awaited (batching off)."""
        item = dataset[key]
        if not inspect.isawaitable(item):
            return item
        return self._settle([item], False)[0]

    def _batch(self, getitems: Callable[[Any], Any], keys: Sequence[Any]) -> list[Any]:
        """``__getitems__(keys)``, awaited if it is awaitable, and so are its samples."""
        samples = getitems(keys)
        if inspect.isawaitable(samples):
            samples = self._settle([samples], False)[0]
        if any(inspect.isawaitable(sample) for sample in samples):
            return self._settle(list(samples), False)
        return samples  # type: ignore[no-any-return]

    @staticmethod
    def _each(read: Callable[[Any], Any], keys: Sequence[Any], collect: bool) -> list[Any]:
        """``read(key)`` for every key, in this thread; one that raises gives a :class:`Failed`,
        and no key after it is read (as in a sync loop) unless ``collect`` and it is not
        StopIteration."""
        items: list[Any] = []
        for key in keys:
            try:
                items.append(read(key))
            except StopIteration as exc:
                items.append(Failed(exc))
                break
            except Exception as exc:
                items.append(Failed(exc))
                if not collect:
                    break
        return items

    def _settle(self, items: list[Any], collect: bool) -> list[Any]:
        """``items`` with every awaitable awaited on the loop (at once, bounded), then checked in
        key order: the first :class:`Failed` is raised (always, if StopIteration), unless
        ``collect``."""
        if any(inspect.isawaitable(item) for item in items):
            try:
                loop = self._running_loop()
            except RuntimeError:
                for item in items:
                    if inspect.iscoroutine(item):
                        item.close()
                raise
            future = asyncio.run_coroutine_threadsafe(self._await_all(items, collect), loop)
            try:
                items = future.result()
            except BaseException:
                future.cancel()  # (the thread was interrupted: the reads stop too)
                raise
        for item in items:
            if isinstance(item, Failed) and (not collect or isinstance(item.error, StopIteration)):
                raise item.error
        return items

    # -- on the loop -----------------------------------------------------------------------------

    async def _await_all(self, items: list[Any], collect: bool) -> list[Any]:
        assert self._slots is not None
        slots = self._slots
        tasks = [
            asyncio.ensure_future(self._await_one(item, slots))
            if inspect.isawaitable(item)
            else None
            for item in items
        ]
        width = min(sum(task is not None for task in tasks), self.limit)
        self.peak_width = max(self.peak_width, width)
        out = list(items)
        try:
            for i, task in enumerate(tasks):
                if task is not None:
                    out[i] = await task
                failed = out[i]
                if isinstance(failed, Failed) and (
                    not collect or isinstance(failed.error, StopIteration)
                ):
                    return out[: i + 1]  # (the reads after it are cancelled below)
            return out
        finally:
            rest = [task for task in tasks if task is not None and not task.done()]
            for task in rest:
                task.cancel()
            if rest:
                await asyncio.gather(*rest, return_exceptions=True)
            for item in items:  # (one cancelled before it began: no "never awaited" warning)
                if inspect.iscoroutine(item):
                    item.close()

    async def _await_one(self, item: Awaitable[Any], slots: asyncio.Semaphore) -> Any:
        async with slots:
            try:
                return await item
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # (a KeyboardInterrupt here must not end the loop)
                return Failed(_unwrapped(exc))

    # -- the loop --------------------------------------------------------------------------------

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._closed:
                raise RuntimeError("the loader's async reads were shut down")
            if self._loop is None or self._pid != os.getpid():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=_serve, args=(loop,), name="ferry-aio", daemon=True
                )
                self._slots = asyncio.Semaphore(self.limit)
                self._loop, self._pid = loop, os.getpid()
                self._stopper = weakref.finalize(self, _stop, loop, thread, self._pid, 2.0)
                thread.start()
            return self._loop

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop: reads still in flight are cancelled (their callers get
        ``CancelledError``), none start after; waits up to ``timeout`` seconds for its thread."""
        with self._lock:
            self._closed = True
            stopper, self._stopper, self._loop = self._stopper, None, None
        detached = stopper.detach() if stopper is not None else None
        if detached is not None:
            loop, thread, pid, _ = detached[2]
            _stop(loop, thread, pid, timeout)
