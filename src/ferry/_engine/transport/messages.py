"""Messages between the main process and its workers.

Every message is a small frozen dataclass. Tasks flow main -> worker; results flow back in the
order the worker finishes them. ``task`` numbers are the loader's batch numbers within an epoch.

main -> worker
    :class:`Fetch`  make batch ``task`` from ``key``; ``freed`` lists this worker's slabs the
                    main process no longer uses, so the worker may write them again.
    :class:`Resume` a new epoch begins (persistent workers): reopen the iterable stream.
    :class:`Retire` close these slabs (freed, and not to be given back): their memory goes
                    back to the system. Handled by the reader thread, at once.
    :class:`Stop`   finish: exit after the current task.
    :class:`StackRequest` the loader is stalled: say what you are doing (answered by the
                    process worker's reader thread, while its main thread is stuck).

worker -> main
    :class:`Ready`     the worker ran its set-up (seeding, ``worker_init_fn``) and waits for tasks.
    :class:`NewSlab`   a new shared-memory slab: found by ``name``, or (no name) its file
                       descriptor follows on the same connection; ``fallback`` says why
                       a worker whose slabs travel by name made this one anonymous.
    :class:`Done`      batch ``task`` is ready; ``payload`` is the pickled batch whose tensors
                       refer to slabs by id (see :mod:`ferry._engine.transport.shm`), or
                       the batch object itself for thread workers; ``report`` is the
                       worker's position after it
                       (:class:`ferry._engine.position.keeper.WorkerReport`); with
                       ``on_error="skip"``, ``outcome`` lists the samples dropped
                       (``empty``: all of them).
    :class:`Exhausted` the worker's iterable stream has ended; it had nothing for ``task``.
    :class:`Failed`    user code raised; carries the exception and its formatted traceback.
    :class:`Stop`      leaving: the worker's loop ended and its process is exiting.
    :class:`Stack`     the answer to a :class:`StackRequest`: the task in progress, since
                       when, and the Python stack of the worker's main thread.
    :class:`FirstLook` what the watcher of the worker's first read saw, once (a process
                       worker's own per-sample reads, ``num_workers="auto"``): whether the
                       read waits, so the main process knows whether to start the other
                       workers now or after the first batch (see ``switch.HeldWorkers``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from ferry._engine.work.fetch import Timing

if TYPE_CHECKING:
    from ferry._engine.position.keeper import WorkerReport
    from ferry._engine.work.fetch import Outcome

__all__ = [
    "Done",
    "Exhausted",
    "Failed",
    "Fetch",
    "FirstLook",
    "IndexTensor",
    "NewSlab",
    "Ready",
    "Resume",
    "Retire",
    "Stack",
    "StackRequest",
    "Stop",
    "key_length",
]


def key_length(key: Any) -> int:
    """How many samples a batch's key names: its length (a batch's indices), else 1 (a key of
    its own with ``batch_size=None``: an int, a 0-d tensor, a string), and at least 1."""
    if isinstance(key, (str, bytes)):
        return 1
    try:
        return max(len(key), 1)
    except TypeError:
        return 1


@dataclass(frozen=True)
class IndexTensor:
    """An ``int64`` index tensor (a batch key) in transit, held as plain ints.

    torch pickles tensors through its serializer, about a millisecond per small tensor; a list
    of ints pickles in microseconds.
    """

    values: list[int]

    @classmethod
    def pack(cls, key: Any) -> Any:
        """``key`` ready to send: index tensors become an :class:`IndexTensor`."""
        return cls(key.tolist()) if isinstance(key, torch.Tensor) else key

    @staticmethod
    def unpack(key: Any) -> Any:
        """The key as the fetcher takes it."""
        if isinstance(key, IndexTensor):
            return torch.tensor(key.values, dtype=torch.int64)
        return key


@dataclass(frozen=True)
class Fetch:
    task: int
    key: Any
    freed: tuple[int, ...] = ()


@dataclass(frozen=True)
class Resume:
    freed: tuple[int, ...] = ()


@dataclass(frozen=True)
class Retire:
    slabs: tuple[int, ...]


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class StackRequest:
    pass


@dataclass(frozen=True)
class Stack:
    worker_id: int
    task: int | None  # the task being fetched (None: between tasks)
    since: float  # time.monotonic() when it began (the clock is system-wide on Linux)
    stack: str


@dataclass(frozen=True)
class FirstLook:
    waits: bool  # True: the read waits and the rest of its batch was begun at once


@dataclass(frozen=True)
class Ready:
    worker_id: int
    pid: int
    # The user states as the worker's epoch begins (after what it fetched again on resume):
    # sent by a process worker over a map-style dataset with a state of its own, when it starts
    # and when a persistent worker begins an epoch (see WorkerConfig.report_start).
    states: Any = None


@dataclass(frozen=True)
class NewSlab:
    slab_id: int
    size: int
    name: str | None = None
    # Set once, on the first anonymous slab of a worker whose named slab found no room in
    # /dev/shm: the system's reason (the main process warns).
    fallback: str = ""
    # False: the slab carries one batch; the worker has let go of it, and the main process
    # unmaps it when that batch is dropped (see shm.REUSE_LIMIT).
    reuse: bool = True
    # Idle slabs the worker closed as it made this one (too small for its batches now).
    replaces: tuple[int, ...] = ()


@dataclass(frozen=True)
class Done:
    task: int
    payload: Any
    slabs: tuple[int, ...] = ()
    report: WorkerReport | None = None
    timing: Timing = field(default_factory=Timing)
    # on_error="skip": (samples tried, samples dropped); ``empty``: all were, there is no batch
    outcome: Outcome | None = None
    empty: bool = False
    # CPU seconds the worker's thread used making it (against the fetch and collate seconds of
    # ``timing``: how much of the batch was waiting; num_workers="auto" reads it).
    cpu: float = -1.0  # (-1: not measured, see fetch.CPU_SAMPLE)
    # Measured, and its reads ran at once on other threads: their wall and CPU seconds, summed,
    # and their count (what num_workers="auto" judges instead; see fetch._TimedFetch.parallel).
    reads: tuple[float, float, int] | None = None
    # The process worker's share of anonymous memory in bytes, measured after its previous
    # batch went (-1: not measured; see ferry._core.memory, which says when it is), and the
    # process's page-fault count when that figure was read.
    memory: int = -1
    memory_faults: int = -1

    def __reduce__(self) -> tuple[Any, ...]:
        # One of these crosses with every batch: pickled as a plain tuple and rebuilt by one
        # call (a dataclass's default pickling, with its Timing, costs about 2 us more on each
        # side).
        values = [*_DONE_VALUES(self)]
        values[_TIMING_AT] = tuple(values[_TIMING_AT])
        return (_done, tuple(values))


_DONE_FIELDS = tuple(done_field.name for done_field in fields(Done))
_DONE_VALUES = operator.attrgetter(*_DONE_FIELDS)
_TIMING_AT = _DONE_FIELDS.index("timing")


def _done(*values: Any) -> Done:
    """A :class:`Done` from its fields' values, as :meth:`Done.__reduce__` sent them."""
    done = object.__new__(Done)
    state = done.__dict__
    state.update(zip(_DONE_FIELDS, values, strict=True))
    state["timing"] = tuple.__new__(Timing, values[_TIMING_AT])
    return done


@dataclass(frozen=True)
class Exhausted:
    task: int


@dataclass(frozen=True)
class Failed:
    """User code raised in a worker.

    ``task`` is None when the failure happened before any task; ``stage`` then says where
    (in ``worker_init_fn``, or opening the dataset's stream). ``sending``: the task's batch was
    made, and sending it to the main process raised (pickling it, or writing it to shared
    memory). ``exception`` is the pickled
    exception, or None if it could not be pickled; then ``type_name`` and ``message`` describe
    it.
    """

    task: int | None
    worker_id: int
    pid: int
    type_name: str
    message: str
    traceback: str
    exception: bytes | None = field(default=None, repr=False)
    stage: str = ""
    sending: bool = False
