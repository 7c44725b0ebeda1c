"""Datasets and collate functions of :mod:`workers.test_skip` (``on_error="skip"``).

Module level, so that process workers can unpickle them (by reference to
``workers.skip_datasets``). A sample is its own index (or stream value), so a batch says which
samples it holds. Map-style datasets record every call they get: in ``calls`` (a list on the
object, which the test reads directly with ``num_workers=0`` or thread workers), and, when
given a ``log`` path, one line per call appended to that file (process workers write there).
Iterable datasets derive from torch's ``IterableDataset`` and ask whichever library's worker
runs them for its worker info, so torch can run them as the oracle.
"""

from __future__ import annotations

import ast
import os
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch.utils.data as tud

import ferry


class Corrupt(Exception):
    """What a bad sample raises (a type of our own, so the test knows where it came from)."""


class Unpicklable(Exception):
    """What a bad sample of :class:`Flaky` raises with ``unpicklable=True``: it holds a lock,
    so it cannot travel from a process worker to the main process."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def shard() -> tuple[int, int]:
    """(worker id, number of workers) of whichever library's worker runs the caller; (0, 1) in
    the main process."""
    info = ferry.get_worker_info() or tud.get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


def logged_calls(path: str) -> list[Any]:
    """The calls a dataset given ``log=path`` recorded, in the order each process made them
    (``int`` for ``__getitem__``, ``list`` for ``__getitems__``)."""
    if not os.path.exists(path):
        return []
    with open(path) as file:
        return [ast.literal_eval(line) for line in file]


# -- map-style -------------------------------------------------------------------------------


class Flaky(ferry.Dataset[int]):
    """Map-style: sample ``i`` is ``i``; ``__getitem__`` of an index in ``bad`` raises
    :class:`Corrupt` (:class:`Unpicklable` with ``unpicklable=True``), of ``stop`` raises
    StopIteration (torch's end of a map-style epoch)."""

    def __init__(
        self,
        n: int,
        bad: Iterable[int] = (),
        stop: int | None = None,
        log: str | None = None,
        unpicklable: bool = False,
    ) -> None:
        self.n = n
        self.bad = frozenset(bad)
        self.stop = stop
        self.log = log
        self.unpicklable = unpicklable
        self.calls: list[Any] = []  # (list.append is atomic: thread workers may share it)

    def __len__(self) -> int:
        return self.n

    def _record(self, call: Any) -> None:
        self.calls.append(call)
        if self.log is not None:
            with open(self.log, "a") as file:  # one short append: atomic between processes
                file.write(f"{call!r}\n")

    def _sample(self, index: int) -> int:
        if index == self.stop:
            raise StopIteration
        if index in self.bad:
            error = Unpicklable if self.unpicklable else Corrupt
            raise error(f"corrupt sample {index}")
        return index

    def __getitem__(self, index: int) -> int:
        self._record(index)
        return self._sample(index)


class FlakyItems(Flaky):
    """:class:`Flaky` with ``__getitems__``: a batch in one call, which raises
    :class:`Corrupt` if any of its indices is bad (``__getitem__`` is never used then)."""

    def __getitems__(self, indices: list[int]) -> list[int]:
        self._record(list(indices))
        return [self._sample(i) for i in indices]


class RefusingCollate:
    """A collate_fn that raises ValueError when a batch holds the sample ``refused``, and
    otherwise returns the samples as a list."""

    def __init__(self, refused: int) -> None:
        self.refused = refused

    def __call__(self, samples: list[int]) -> list[int]:
        if self.refused in samples:
            raise ValueError(f"collate_fn refuses sample {self.refused}")
        return list(samples)


# -- iterable-style ----------------------------------------------------------------------------


class IteratorStream(tud.IterableDataset[int]):
    """Worker ``w`` of ``k`` streams ``w, w + k, ...`` below ``n`` through an iterator object
    whose ``__next__`` raises :class:`Corrupt` for a value in ``bad`` and can be asked again
    after that (it has moved past the value). With ``omit=True`` the bad values are left out
    instead: the stream a skipping loader should deliver, for torch to load as the oracle."""

    def __init__(self, n: int, bad: Iterable[int] = (), omit: bool = False) -> None:
        self.n = n
        self.bad = frozenset(bad)
        self.omit = omit

    def __iter__(self) -> Iterator[int]:
        worker, workers = shard()
        return _ValueIterator(self, worker, workers)


class _ValueIterator:
    def __init__(self, stream: IteratorStream, start: int, step: int) -> None:
        self.stream = stream
        self.value = start
        self.step = step

    def __iter__(self) -> _ValueIterator:
        return self

    def __next__(self) -> int:
        while True:
            value = self.value
            if value >= self.stream.n:
                raise StopIteration
            self.value += self.step
            if value not in self.stream.bad:
                return value
            if not self.stream.omit:
                raise Corrupt(f"corrupt stream value {value}")


class GeneratorStream(tud.IterableDataset[int]):
    """Worker ``w`` of ``k`` streams ``w, w + k, ...`` below ``n`` from a generator that raises
    :class:`Corrupt` at a value in ``bad`` (a generator that raised is finished). With
    ``truncate=True`` it returns there instead: the stream a skipping loader should deliver,
    for torch to load as the oracle."""

    def __init__(self, n: int, bad: Iterable[int] = (), truncate: bool = False) -> None:
        self.n = n
        self.bad = frozenset(bad)
        self.truncate = truncate

    def __iter__(self) -> Iterator[int]:
        worker, workers = shard()
        for value in range(worker, self.n, workers):
            if value in self.bad:
                if self.truncate:
                    return
                raise Corrupt(f"corrupt stream value {value}")
            yield value


class UnopenableStream(tud.IterableDataset[int]):
    """An iterable dataset whose ``__iter__`` raises OSError: no stream, so no sample to skip."""

    def __iter__(self) -> Iterator[int]:
        raise OSError("the stream cannot be opened")


class FailingForever(tud.IterableDataset[int]):
    """An endless stream whose every item raises :class:`Corrupt` (its iterator can always be
    asked again)."""

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        raise Corrupt("every item of this stream is corrupt")
