"""The roof of a scaling row: the dataset's own work done by plain processes, with no loader.

For a row of N workers, N processes each take an equal share of the epoch's index batches and
run exactly what a loader's worker must run for them, ``collate([dataset[i] for i in batch])``,
nothing else: no queue, no hand-off to another process, no pinning. Each warms up on one
untimed batch, then waits; a pass (:meth:`RoofPool.measure`) starts all N together, so that they
run side by side as workers do, and each times its own share (going over it again until the
pass has lasted a quarter second). Their rates, summed, are the most this machine can make of
that workload with N processes; a loader is reported as a share of it.

The processes are kept between passes, as persistent workers are between epochs, so that the
scaling mode can measure one pass in every round beside the loaders' epochs: a machine whose
speed drifts (a VM whose host is busy) then moves the roof with the loaders, and each round's
loader/roof ratio is read against the roof of its own round.

The collate stacks samples that are tensors (or numpy arrays) of one shape and dtype into a
batch tensor kept from the previous batch (``torch.stack(..., out=...)``): the same copy a
collate makes, without a fresh allocation whose pages fault in every batch, which a loader
that reuses its batch memory does not pay either, so that the roof stays above what a loader
can do. Other samples go through ``torch.utils.data.default_collate`` (imported where it runs,
as the benchmark alone may). The processes are forked where the platform can (the dataset is
inherited, not pickled), and set ``torch.set_num_threads(1)`` as a loader's workers do.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["RoofPool", "StackInto", "roof_of", "shares"]

_EXIT_GRACE_S = 5.0
_POLL_S = 0.5  # how often the parent looks for a roof process that died without a word
_READY = "ready"
_GO, _STOP = "go", "stop"  # what the parent says to a roof process


def shares(batches: Sequence[Sequence[int]], parts: int) -> list[list[list[int]]]:
    """``batches`` cut into ``parts`` contiguous shares whose sizes differ by one at most."""
    if parts < 1:
        raise ValueError(f"need at least one share, got {parts}")
    size, extra = divmod(len(batches), parts)
    out, start = [], 0
    for part in range(parts):
        stop = start + size + (1 if part < extra else 0)
        out.append([list(batch) for batch in batches[start:stop]])
        start = stop
    return out


def roof_of(passes: Sequence[Sequence[float]]) -> tuple[float, tuple[float, ...]]:
    """The roof from its passes, each one every process's rate (samples/s): the median over
    the passes of their summed rates (a pass's processes ran side by side, so their sum is the
    machine's rate then), and each process's median rate."""
    if not passes or any(len(rates) != len(passes[0]) or not rates for rates in passes):
        raise ValueError(
            "every process needs at least one timed pass, and each pass a rate from every process"
        )
    per_process = tuple(float(statistics.median(rates)) for rates in zip(*passes, strict=True))
    return float(statistics.median(sum(rates) for rates in passes)), per_process


class StackInto:
    """The roof's collate (see the module docstring): a callable ``samples -> batch``."""

    def __init__(self) -> None:
        self._kept: torch.Tensor | None = None

    def __call__(self, samples: list[Any]) -> Any:
        first: Any = samples[0] if samples else None
        kind = type(first)
        alike = kind is torch.Tensor or _is_array(first)
        if not alike or any(
            type(s) is not kind or s.shape != first.shape or s.dtype != first.dtype for s in samples
        ):
            from torch.utils.data import default_collate

            return default_collate(samples)
        if kind is not torch.Tensor:  # numpy arrays: their memory shared, not copied
            samples = [torch.from_numpy(s) for s in samples]
        head = samples[0]
        shape = (len(samples), *head.shape)
        if self._kept is None or self._kept.shape != shape or self._kept.dtype != head.dtype:
            self._kept = torch.empty(shape, dtype=head.dtype)
        return torch.stack(samples, out=self._kept)


def _is_array(value: Any) -> bool:
    """Whether ``value`` is a numpy array (numpy imported only where it is already loaded)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray)


@dataclass(frozen=True)
class _Share:
    """What one roof process runs: its rank, the dataset, its batches, the collate."""

    rank: int
    dataset: Any
    batches: list[list[int]]
    collate: Callable[[list[Any]], Any]
    min_pass_s: float


def _share_worker(share: _Share, commands: Any, results: Any) -> None:
    """One roof process: warm up on one batch, say so, then time one pass of its share each
    time the parent says go, until it says stop (or goes away)."""
    dataset, collate = share.dataset, share.collate
    try:
        torch.set_num_threads(1)
        if share.batches:
            collate([dataset[i] for i in share.batches[0]])
        results.put((share.rank, _READY, None))
        samples = sum(len(batch) for batch in share.batches)
        while commands.recv() == _GO:
            done, elapsed, start = 0, 0.0, time.perf_counter()
            while done == 0 or elapsed < share.min_pass_s:  # the share again, if it was short
                for batch in share.batches:
                    collate([dataset[i] for i in batch])
                done += samples
                elapsed = time.perf_counter() - start
            results.put((share.rank, done / max(elapsed, 1e-9), None))
    except EOFError:  # the parent is gone: nothing to report to
        return
    except BaseException as exc:  # reported to the parent, which fails the roof
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        results.put((share.rank, None, text))


def _gather(
    results: Any, started: Sequence[Any], end: float | None, timeout_s: float
) -> dict[int, Any]:
    """One message from each process in ``started``, ``{rank: payload}``; raises
    ``RuntimeError`` when one reports an error or dies, or at ``end`` (monotonic time)."""
    got: dict[int, Any] = {}
    while len(got) < len(started):
        left = None if end is None else end - time.monotonic()
        if left is not None and left <= 0:
            raise RuntimeError(f"the roof took longer than {timeout_s:g} s")
        try:
            rank, payload, error = results.get(
                timeout=_POLL_S if left is None else min(left, _POLL_S)
            )
        except queue.Empty:
            dead = [p for p in started if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a roof process died (exit code {dead[0].exitcode})") from None
            continue
        if error is not None:
            raise RuntimeError(f"a roof process failed: {error}")
        got[rank] = payload
    return got


class RoofPool:
    """The roof's processes for one row, kept between passes (see the module docstring).

    ``RoofPool(dataset, batches, processes)`` starts them and waits until each has warmed up;
    each :meth:`measure` is one pass of every share, all started together, and returns each
    process's rate (samples/s); :meth:`close` (or leaving a ``with`` block) ends them. Raises
    ``RuntimeError`` when a process fails or dies, or when the start or a pass takes longer
    than ``timeout_s`` (0: no limit); the pool is closed then.
    """

    def __init__(
        self,
        dataset: Any,
        batches: Sequence[Sequence[int]],
        processes: int,
        *,
        min_pass_s: float = 0.25,
        timeout_s: float = 300.0,
        collate: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        methods = multiprocessing.get_all_start_methods()
        context: Any = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        self.samples = sum(len(batch) for batch in batches)
        self._timeout_s = timeout_s
        self._results = context.Queue()
        self._commands: list[Any] = []
        self._processes: list[Any] = []
        work, run_collate = shares(batches, processes), collate or StackInto()
        try:
            for rank in range(processes):
                theirs, ours = context.Pipe(duplex=False)
                share = _Share(rank, dataset, work[rank], run_collate, min_pass_s)
                process = context.Process(
                    target=_share_worker,
                    args=(share, theirs, self._results),
                    name=f"ferry-bench-roof-{rank}",
                    daemon=True,
                )
                process.start()
                theirs.close()
                self._commands.append(ours)
                self._processes.append(process)
            self._gather()  # every one warmed up and waiting
        except BaseException:
            self.close()
            raise

    def _gather(self) -> dict[int, Any]:
        end = time.monotonic() + self._timeout_s if self._timeout_s > 0 else None
        return _gather(self._results, self._processes, end, self._timeout_s)

    def measure(self) -> tuple[float, ...]:
        """One timed pass of every share, side by side: each process's rate, by rank."""
        if not self._processes:
            raise RuntimeError("the roof's processes are closed")
        try:
            for commands in self._commands:
                commands.send(_GO)
            rates = self._gather()
        except BaseException:
            self.close()
            raise
        return tuple(float(rates[rank]) for rank in range(len(self._processes)))

    def close(self) -> None:
        """End the processes: asked to stop, then terminated if they do not within a grace."""
        for commands in self._commands:
            with contextlib.suppress(OSError):  # that one is gone already
                commands.send(_STOP)
            commands.close()
        for process in self._processes:
            if process.is_alive():
                process.join(_EXIT_GRACE_S)
            if process.is_alive():
                process.terminate()
                process.join(_EXIT_GRACE_S)
        if self._processes:
            self._results.close()
        self._commands, self._processes = [], []

    def __enter__(self) -> RoofPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
