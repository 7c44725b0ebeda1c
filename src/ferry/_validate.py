"""Argument checks shared by the public constructors.

Each check raises the exception type torch raises for the same mistake (passed in by the
caller) with a message that names the option, what was expected and what was got.
"""

from __future__ import annotations

import multiprocessing
import numbers
import operator
import os
from multiprocessing.context import BaseContext
from typing import Any


def _got(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_positive_int(name: str, value: object, *, error: type[Exception]) -> None:
    """``value`` must be an ``int`` (not a ``bool``) greater than zero."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise error(
            f"{name} should be a positive integer value, but got {name}={value} "
            f"({type(value).__name__})"
        )


def check_bool(name: str, value: object, *, error: type[Exception]) -> bool:
    """``value`` must be exactly ``True`` or ``False``; returns it."""
    if not isinstance(value, bool):
        raise error(
            f"{name} should be a boolean value, but got {name}={value} ({type(value).__name__}); "
            "pass True or False"
        )
    return value


def as_int(name: str, value: object, *, allow_bool: bool) -> int:
    """``value`` as an ``int``: any integer type (numpy's too), never a float; a ``bool`` only
    where torch takes one (``num_workers=True`` works there). TypeError otherwise."""
    if isinstance(value, bool) and not allow_bool:
        raise TypeError(f"{name} must be an integer, got {_got(value)}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {_got(value)}") from None


_NEGATIVE = {
    "num_workers": "num_workers option should be non-negative; use num_workers=0 to disable "
    "multiprocessing (load in the main process), got num_workers={}",
    "prefetch_factor": "prefetch_factor option should be non-negative (batches loaded ahead "
    "per worker), got prefetch_factor={}",
}


def _compared_count(name: str, value: object) -> Any:
    """``num_workers`` or ``prefetch_factor`` (``name``) as torch's constructor reads it: an
    integer (a bool and numpy's integers too) as an ``int``, a ValueError below 0. Anything
    else torch only compares there (it counts with it later, in ``iter()``), so it is what that
    comparison makes of it: the same ValueError below 0, 0 where it equals 0 (``0.0``,
    ``numpy.False_``: torch loads in the main process), a TypeError where it cannot be compared
    (a string, None), and the value itself otherwise, for the caller to refuse once torch's
    constructor checks have passed (:func:`_counted`)."""
    try:
        count = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        try:
            negative, zero = bool(value < 0), bool(value == 0)  # type: ignore[operator]
        except Exception:
            raise TypeError(f'{name} must be an integer or "auto", got {_got(value)}') from None
        if negative:
            raise ValueError(_NEGATIVE[name].format(value)) from None
        return 0 if zero else value
    if count < 0:
        raise ValueError(_NEGATIVE[name].format(count))
    return count


def _counted(name: str, value: Any) -> int:
    """``value`` from :func:`_compared_count`, which torch counts with (``range(value)``):
    anything but an integer is a TypeError there, as in torch's ``iter()``."""
    if not isinstance(value, int):
        raise TypeError(
            f'{name} must be an integer or "auto", got {_got(value)}: it is a count, and '
            "torch's DataLoader fails on it too, at iter()"
        )
    return value


def as_count(name: str, value: object) -> int:
    """``num_workers`` or ``prefetch_factor`` (``name``): a non-negative integer, as torch
    reads it (:func:`_compared_count`: ``0.0`` is 0); ValueError below 0, TypeError if not
    an integer."""
    return _counted(name, _compared_count(name, value))


def worker_options(
    num_workers: object, prefetch_factor: object, timeout: object, persistent_workers: bool
) -> tuple[int, int | None]:
    """``num_workers`` and ``prefetch_factor`` checked (with ``timeout`` and
    ``persistent_workers``, which depend on them) in torch's order, so that of two bad options
    the same one is named; prefetch_factor defaults to 2 with workers."""
    workers = _compared_count("num_workers", num_workers)
    # Any real number, as torch takes: numpy's scalars and bools included.
    if not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
    if timeout < 0:
        raise ValueError(
            "timeout option should be non-negative: it is the seconds to wait for a batch "
            f"from a worker (0 waits forever), got timeout={timeout}"
        )
    if workers == 0 and prefetch_factor is not None:
        raise ValueError(
            "prefetch_factor option could only be specified in multiprocessing: it is the "
            "number of batches each worker loads ahead, so with num_workers=0 leave it None "
            f"(or set num_workers > 0), got prefetch_factor={prefetch_factor!r}"
        )
    prefetch: Any = None
    if prefetch_factor is not None:
        prefetch = _compared_count("prefetch_factor", prefetch_factor)
    elif workers > 0:
        prefetch = 2
    if persistent_workers and workers == 0:
        raise ValueError(
            "persistent_workers option needs num_workers > 0: it keeps the worker "
            "processes alive between epochs, got num_workers=0"
        )
    count = _counted("num_workers", workers)
    return count, None if prefetch is None else _counted("prefetch_factor", prefetch)


def available_cpus() -> tuple[int | None, bool]:
    """The CPUs this process may run on (None: unknown), and whether that count respects its
    CPU affinity (cpusets, ``taskset``) or is the machine's count."""
    affinity = hasattr(os, "sched_getaffinity")  # respects cpusets; os.cpu_count does not
    try:
        return (len(os.sched_getaffinity(0)) if affinity else os.cpu_count()), affinity
    except OSError:
        return os.cpu_count(), False


def too_many_workers(num_workers: int, worker_type: str) -> str | None:
    """The warning for more workers than the CPUs this process may run on (None if fine)."""
    if num_workers == 0:
        return None
    cpus, affinity = available_cpus()
    if cpus is not None and num_workers <= cpus:
        return None
    if cpus is None:
        limit = (
            "DataLoader is not able to compute a suggested max number of worker in current "
            "system (the CPU count is unknown)."
        )
    else:
        cpuset = "" if affinity else " (`cpuset` is not taken into account)"
        limit = (
            f"Our suggested max number of worker in current system is {cpus}{cpuset}, which "
            "is smaller than what this DataLoader is going to create."
        )
    kind = "threads" if worker_type == "thread" else "processes"
    head = f"This DataLoader will create {num_workers} worker {kind} in total. {limit} "
    if worker_type == "thread":
        # torch's phrase (code matches it), and what is true of threads: the CPU count bounds
        # only the threads that compute; threads that wait on I/O do not compete for it.
        return head + (
            "Please be aware that excessive worker creation might get DataLoader running slow "
            "or even freeze when the threads compete for the CPUs: thread workers that compute "
            "in Python share one CPU (the GIL), so more of them than CPUs gain nothing. Threads "
            "that wait on I/O (network, object stores) are not bound by the CPU count, and "
            "each thread worker already reads the samples of its batch at once when they wait "
            "(loader.stats() shows the concurrency): a few usually suffice."
        )
    return head + (
        "Please be aware that excessive worker creation might get DataLoader running slow or "
        "even freeze: workers beyond the CPU count compete for the CPUs; lower num_workers to "
        "avoid potential slowness/freeze if necessary."
    )


NO_ACCELERATOR = (
    "'pin_memory' argument is set as true but no accelerator is found, then device pinned "
    "memory won't be used: batches are returned in ordinary (unpinned) memory"
)


PIN_ON_MPS = (
    "'pin_memory' argument is set as true but not supported on MPS now, device pinned memory "
    "won't be used: pinning fails on Apple's MPS backend, so batches are returned in ordinary "
    "memory (set pin_memory=False to silence this)"
)


def pin_device_deprecated(device: str) -> str:
    """The warning for ``pin_memory_device``, deprecated in torch."""
    return (
        "pin_memory_device is deprecated, the current accelerator will be used as the device in "
        f"torch's DataLoader; ferry still passes pin_memory_device={device!r} to "
        "Tensor.pin_memory for now. Leave it unset to pin for the current accelerator."
    )


def as_context(context: str | BaseContext | None, num_workers: int) -> BaseContext | None:
    """The ``multiprocessing_context`` option as a context object (None: the default)."""
    if context is None:
        return None
    if num_workers == 0:
        raise ValueError(
            "multiprocessing_context can only be used with multi-process loading "
            f"(num_workers > 0), but got num_workers={num_workers}; it chooses how "
            "worker processes start"
        )
    if isinstance(context, str):
        methods = multiprocessing.get_all_start_methods()
        if context not in methods:
            raise ValueError(
                "multiprocessing_context option should specify a valid start method in "
                f"{methods!r}, but got multiprocessing_context={context!r}"
            )
        context = multiprocessing.get_context(context)
    if not isinstance(context, BaseContext):
        raise TypeError(
            "multiprocessing_context option should be a valid context object or a string "
            f"specifying the start method, but got multiprocessing_context={context} "
            f"({type(context).__name__}); pass a start method name or "
            "multiprocessing.get_context(name)"
        )
    return context


def move_problem(move: object, num_workers: object, worker_type: object) -> Exception | None:
    """What is wrong with ``move_workers`` for these options (None: nothing)."""
    if move is not None and not isinstance(move, bool):
        return TypeError(f"move_workers must be None (ferry decides), True or False, got {move!r}")
    if move is not True:
        return None
    if num_workers == 0:
        return ValueError(
            "move_workers=True needs num_workers > 0 (or 'auto'): it moves worker processes "
            "round the CPUs, and with num_workers=0 the main process makes every batch"
        )
    if worker_type != "process":
        return ValueError(
            f"move_workers=True needs worker_type='process', got worker_type={worker_type!r}: "
            "thread workers run in the main process, which is not moved"
        )
    return None


def balance_problem(balance: object, num_workers: object, iterable: bool) -> Exception | None:
    """What is wrong with ``balance_workers`` for these options (None: nothing)."""
    if not isinstance(balance, bool):
        return TypeError(f"balance_workers must be True or False, got {balance!r}")
    if not balance:
        return None
    if num_workers == 0:
        return ValueError(
            "balance_workers=True needs num_workers > 0 (or 'auto'): it chooses which worker "
            "makes each batch, and with num_workers=0 the main process makes them all"
        )
    if iterable:
        return ValueError(
            "balance_workers=True needs a map-style dataset, got an IterableDataset: each "
            "worker reads its own copy of the stream, so which worker makes the next batch "
            "decides which samples come next; use in_order=False to take batches as they come"
        )
    return None
