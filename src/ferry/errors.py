"""Errors of worker loading, and how a worker's exception is raised again in the main process.

An exception raised by user code in a worker (``__getitem__``, ``__iter__``, ``collate_fn``,
``worker_init_fn``) reaches the training loop as the same exception type, with notes naming the
worker id, its pid, the indices it was fetching, and the worker's own traceback.

Example::

    >>> try:
    ...     next(iter(DataLoader(BrokenDataset(), num_workers=2)))
    ... except KeyError as exc:
    ...     print(exc.__notes__[0])
    Caught KeyError in DataLoader worker process 0 (pid 4242) while fetching indices [0]

The note starts with torch's words, which torch puts in the message itself (torch raises a new
exception of the same type whose message is that line and the traceback, losing the original's
arguments and attributes). ferry keeps the original object, so ``pytest.raises(match=...)``,
which also searches notes, matches torch's phrase, and ``str(exc)`` is the user's own message.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback
import warnings
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EpochReplayWarning",
    "MalformedState",
    "SharedMemoryWarning",
    "SkippedSample",
    "StallWarning",
    "StateMismatch",
    "TooManyErrors",
    "WorkerDied",
    "WorkerRestartWarning",
    "WorkerTimeout",
    "WorkerTraceback",
    "add_note",
    "describe_key",
]


class StateMismatch(ValueError):
    """A well-formed loader state saved from a loader built otherwise: another dataset length,
    sampler, batch size or option, or a number of workers it cannot be split over. Raised by
    ``DataLoader.load_state_dict`` (or the next ``iter()``), naming what differs; a ValueError,
    as torch's loaders raise for a state they cannot take.

    Example::

        >>> state = DataLoader(range(10), batch_size=2).state_dict()
        >>> DataLoader(range(12), batch_size=2).load_state_dict(state)
        Traceback (most recent call last):
        ferry.errors.StateMismatch: DataLoader state does not fit this loader: ...
    """


class MalformedState(ValueError):
    """A loader state that is not what ``state_dict()`` returned (damaged or edited)."""


class WorkerTraceback(Exception):
    """Carries a worker's notes and traceback as an exception's cause, where Python (3.10)
    does not print ``__notes__``: the traceback printer shows the cause above the error."""


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (Python >= 3.11); on 3.10, the same ``__notes__`` list, also
    shown through a :class:`WorkerTraceback` cause so that the note is printed."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
        return
    _add_note_by_hand(exc, note)


def _add_note_by_hand(exc: BaseException, note: str) -> None:
    notes = getattr(exc, "__notes__", None)
    if notes is None:
        notes = []
        exc.__notes__ = notes  # type: ignore[attr-defined]
    notes.append(note)
    if exc.__cause__ is None or isinstance(exc.__cause__, WorkerTraceback):
        exc.__cause__ = WorkerTraceback("\n".join(notes))


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_from_user_code(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the first caller outside ferry (the training loop), where
    the engine that warns is called from varies in depth."""
    level, frame = 2, sys._getframe(1)  # 2: the caller of this function
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        level, frame = level + 1, frame.f_back  # type: ignore[assignment]
    warnings.warn(message, category, stacklevel=level)


def describe_key(key: Any, iterable: bool, limit: int = 16) -> str:
    """What a task was fetching, for error messages."""
    if iterable:
        return "the next batch of its dataset stream" if key else "the next sample of its stream"
    if hasattr(key, "tolist"):
        key = key.tolist()
    if isinstance(key, list):
        shown = ", ".join(repr(k) for k in key[:limit])
        more = f", ... ({len(key)} in all)" if len(key) > limit else ""
        return f"indices [{shown}{more}]"
    return f"index {key!r}"


class WorkerDied(RuntimeError):
    """A worker process ended without being asked to (killed, crashed, out of memory)."""

    def __init__(self, worker_id: int, pid: int | None, exitcode: int | None, in_flight: str):
        self.worker_id = worker_id
        self.pid = pid
        self.exitcode = exitcode
        if exitcode is not None and exitcode < 0:
            try:
                how = f"was killed by signal {signal.Signals(-exitcode).name}"
            except ValueError:
                how = f"was killed by signal {-exitcode}"
            if exitcode == -signal.SIGKILL:
                how += " (often the kernel's out-of-memory killer: check dmesg)"
            elif exitcode == -signal.SIGBUS:
                how += " (often shared memory ran out: check free memory and /dev/shm size)"
        else:
            how = f"exited with code {exitcode}"
        super().__init__(
            f"DataLoader worker (pid(s) {pid}) exited unexpectedly: worker {worker_id} "
            f"(pid {pid}) {how} while fetching {in_flight}"
        )

    def __reduce__(self) -> Any:
        return (_rebuild_died, (self.worker_id, self.pid, self.exitcode, str(self)))


def _rebuild_died(worker_id: int, pid: int | None, exitcode: int | None, text: str) -> Any:
    exc = WorkerDied.__new__(WorkerDied)
    RuntimeError.__init__(exc, text)
    exc.worker_id, exc.pid, exc.exitcode = worker_id, pid, exitcode
    return exc


class WorkerTimeout(RuntimeError):
    """No batch came from a worker within the loader's ``timeout``."""


class TooManyErrors(RuntimeError):
    """``on_error="skip"`` dropped more samples than ``max_errors`` allows; the message lists
    them."""


class WorkerRestartWarning(UserWarning):
    """A worker process died and was replaced (``max_worker_restarts``); the epoch goes on with
    the same batches."""


class EpochReplayWarning(UserWarning):
    """An epoch begins with torch's global RNG where an earlier epoch began, so it repeats that
    epoch's shuffle and worker seeds: typically a resumed run that reseeded the global RNG
    without restoring it (``docs/design/state.md``, "generator=None")."""


class StallWarning(UserWarning):
    """No batch came for ``stall_warning`` seconds; the message says what each worker is doing
    (filter it with ``warnings.simplefilter("ignore", ferry.errors.StallWarning)``)."""


class SharedMemoryWarning(UserWarning):
    """Under ``set_sharing_strategy("file_system")``, ``/dev/shm`` had no room for a batch, so
    a worker's batches travel in anonymous shared memory instead (which ``/dev/shm``'s size does
    not limit); training goes on. The message names the size of ``/dev/shm`` and the fix."""


@dataclass(frozen=True)
class SkippedSample:
    """A sample ``on_error="skip"`` dropped: which, where, and why.

    ``index``: the dataset key (map-style), or the sample's number in its worker's stream
    (iterable-style). ``worker_id`` is 0 and ``pid`` the main process's with ``num_workers=0``.
    """

    index: Any
    stream: bool  # index is a position in a stream, not a key
    worker_id: int
    pid: int
    type_name: str
    message: str
    where: str  # the line of user code that raised

    @classmethod
    def of(
        cls, index: Any, stream: bool, worker_id: int, pid: int, exc: BaseException
    ) -> SkippedSample:
        frames = traceback.extract_tb(exc.__traceback__)
        where = ""
        if frames:
            last = frames[-1]
            where = f"{last.filename}:{last.lineno} in {last.name}"
        return cls(index, stream, worker_id, pid, type(exc).__qualname__, str(exc), where)

    def describe(self) -> str:
        what = f"stream item {self.index}" if self.stream else f"index {self.index!r}"
        at = f" at {self.where}" if self.where else ""
        return (
            f"{what} (worker {self.worker_id}, pid {self.pid}): "
            f"{self.type_name}: {self.message}{at}"
        )


def rebuild_exception(blob: bytes | None, type_name: str, message: str) -> BaseException:
    """The worker's exception object; where it could not travel, its class called with its
    message, as torch rebuilds a worker's exception (so ``except ValueError`` still catches
    it); a RuntimeError standing in where neither can be had (a class that cannot be pickled,
    or called with one message)."""
    if blob is not None:
        try:
            sent = pickle.loads(blob)
            if isinstance(sent, BaseException):
                return sent
            if isinstance(sent, type) and issubclass(sent, BaseException):
                return sent(message)
        except Exception:
            pass
    return RuntimeError(f"{type_name}: {message}")
