"""Reading one dataset from many processes: :class:`DistributedSampler`, :func:`shard`.

In data-parallel training (``torch.nn.parallel.DistributedDataParallel``) every process, or
*rank*, trains on its own part of the data. :class:`DistributedSampler` splits a map-style
dataset's indices between the ranks of a ``torch.distributed`` process group, yielding for the
same arguments exactly the indices torch's ``DistributedSampler`` yields on each rank.
:func:`shard` does the same for a stream (an iterable dataset), across ranks and the loader's
workers together.

The number of ranks and this process's rank come from the default process group
(``torch.distributed.init_process_group``) unless given.

Example, on each rank of a group of two::

    >>> sampler = DistributedSampler(range(5), shuffle=False)
    >>> list(sampler)  # rank 0; rank 1 gets [1, 3, 0]
    [0, 2, 4]
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Any, TypeVar

import torch
import torch.distributed

from ferry._core.info import get_worker_info
from ferry._core.ranks import process_group_rank_world, rank_world
from ferry._sampler_state import SamplerRun, _IterationState, _state_int
from ferry._torch_types import TorchDistributedSampler
from ferry._validate import as_int, check_bool
from ferry.samplers import T_co, TensorChunkSampler

__all__ = [
    "DatasetLengthChangedError",
    "DistributedSampler",
    "NoProcessGroupError",
    "shard",
    "shard_info",
]

T = TypeVar("T")


class NoProcessGroupError(RuntimeError, ValueError):
    """Raised when the rank or world size was not given and no process group can supply it.

    Both a ``RuntimeError`` and a ``ValueError``: torch raises the first when
    ``torch.distributed`` is not built in and the second when no default process group was
    initialised, and code written against torch may catch either.
    """


class DatasetLengthChangedError(RuntimeError, AssertionError):
    """Raised when a :class:`DistributedSampler` is iterated after its dataset's length changed.

    Both a ``RuntimeError`` and an ``AssertionError``: torch's sampler fails some of these
    iterations with an ``AssertionError`` (``Number of indices (...) does not match
    total_size (...)``), and code written against torch may catch that.
    """


def _required_from_group(option: str) -> tuple[int, int]:
    here = process_group_rank_world()
    if here is not None:
        return here
    reason = (
        "Requires distributed package to be available, but torch.distributed is not built into "
        "this torch"
        if not torch.distributed.is_available()
        else "Default process group has not been initialized, please make sure to call "
        "init_process_group (torch.distributed.init_process_group) first"
    )
    raise NoProcessGroupError(
        f"{reason}: DistributedSampler takes {option} from the default process group when it "
        "is not given; or pass num_replicas and rank explicitly"
    )


# Generic as torch's (``DistributedSampler[int]`` in annotations and calls); it yields ints, as
# torch's does whatever its parameter says, hence TensorChunkSampler's Iterator[int].
class DistributedSampler(  # type: ignore[misc]
    _IterationState,
    TensorChunkSampler,
    TorchDistributedSampler[T_co],
    twin=TorchDistributedSampler,
):
    """Yields the part of a map-style dataset's indices that belongs to one rank.

    The indices ``0 .. len(dataset) - 1`` (shuffled with a generator seeded with
    ``seed + epoch`` when ``shuffle`` is true) are dealt round-robin: rank ``r`` of ``R`` gets
    positions ``r, r + R, r + 2R, ...``. Every rank yields the same number of indices, so that
    the ranks of a DDP job run the same number of steps:

    - ``drop_last=False`` (default): the list is first extended by repeating it from the start
      (as many times as needed when the dataset is smaller than the number of ranks), so a few
      samples are seen twice per epoch.
    - ``drop_last=True``: the tail that does not divide evenly is left out for this epoch.

    For the same arguments each rank yields exactly what torch's
    ``torch.utils.data.distributed.DistributedSampler`` yields. Call :meth:`set_epoch` at the
    start of every epoch, on every rank, or each epoch repeats the first one's order.

    Args:
        dataset: anything with a ``len()``; its length must not change.
        num_replicas: number of ranks; the default process group's world size when None.
        rank: this process's rank in ``[0, num_replicas)``; the process group's when None.
        shuffle: shuffle the indices every epoch (the same way on every rank).
        seed: the shuffle's seed; must be the same on every rank.
        drop_last: leave out the uneven tail instead of repeating indices to even it out.
        pad: ferry only, keyword-only. With ``pad=False`` (and ``drop_last=False``) nothing
            is repeated: every index is yielded exactly once across all ranks, and the first
            ``len(dataset) % num_replicas`` ranks yield one index more than the others. Ranks
            then run different numbers of steps, which a DDP training loop must allow for
            (``torch.distributed.algorithms.Join``); it suits evaluation, where a repeated
            sample would skew a metric. With ``drop_last=True`` nothing is repeated anyway,
            and ``pad`` has no effect.

    Raises:
        NoProcessGroupError: ``num_replicas`` or ``rank`` is None and there is no default
            process group (a ``RuntimeError`` and a ``ValueError``, like torch's).
        ValueError: ``num_replicas`` is not positive, or ``rank`` is outside
            ``[0, num_replicas)``.
        TypeError: ``num_replicas``, ``rank`` or ``seed`` is not an integer, ``pad`` not a
            bool, or ``dataset`` has no length (``shuffle`` and ``drop_last`` are read as true
            or false, as torch reads them).

    Iterating raises :class:`DatasetLengthChangedError` when the dataset's length changed
    since construction, and ``AssertionError`` (or ``ValueError``) when ``rank`` or
    ``num_replicas`` was reassigned to a split that does not fit ``num_samples``.

    Stateful, as torchdata's ``StatefulDistributedSampler`` is: :meth:`state_dict` is
    ``{"yielded": k, "epoch": e, "num_replicas": r, "done": d}`` (``d`` is 0 unless the epoch
    was resumed with another world size) and :meth:`load_state_dict` makes the next
    ``iter(sampler)`` continue the saved epoch after ``k`` of this rank's indices. torchdata's
    ``{"yielded": k}`` loads too: it skips ``k`` indices of the epoch ``set_epoch`` set.

    Example::

        >>> sampler = DistributedSampler(range(5), num_replicas=2, rank=1)
        >>> sampler.set_epoch(0)
        >>> list(sampler), len(sampler)
        ([0, 3, 4], 3)
        >>> list(DistributedSampler(range(5), num_replicas=2, rank=1, pad=False))
        [0, 3]
    """

    # Epochs are the user's to begin (set_epoch): a resumed epoch never rolls over by itself.
    _epochs_set_by_user = True
    # What a state_dict() holds besides "yielded": what fixes the epoch's order.
    _state_keys = ("epoch", "num_replicas", "done")
    _drawn_at_iter = True  # torch's builds its list in __iter__
    # Any sized object, as torch accepts too (its annotation says Dataset).
    dataset: Sized  # type: ignore[assignment]
    num_replicas: int
    rank: int
    epoch: int
    num_samples: int
    total_size: int
    shuffle: bool
    seed: int
    drop_last: bool
    pad: bool

    def __init__(  # noqa: PLR0917 - torch's signature: all six are positional there
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        pad: bool = True,
    ) -> None:
        if num_replicas is None:
            num_replicas = _required_from_group("num_replicas")[1]
        if rank is None:
            rank = _required_from_group("rank")[0]
        # As torch's: the rank is placed among the ranks first (a number that is not an
        # integer too: torch fails on it only later, when it slices), then both are integers.
        given: dict[str, object] = {"num_replicas": num_replicas, "rank": rank}
        for name, value in given.items():
            if not isinstance(value, numbers.Real):
                as_int(name, value, allow_bool=True)  # TypeError unless an integer type
        if num_replicas <= 0:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]: "
                f"num_replicas must be a positive number of ranks, got num_replicas={num_replicas}"
            )
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}] "
                f"(one of the num_replicas={num_replicas} ranks)"
            )
        num_replicas = as_int("num_replicas", num_replicas, allow_bool=True)
        rank = as_int("rank", rank, allow_bool=True)
        try:
            length = len(dataset)
        except TypeError as exc:
            raise TypeError(
                f"{exc}: DistributedSampler needs a dataset with a length (a map-style "
                f"dataset), got {type(dataset).__name__}; for a stream, use "
                "ferry.distributed.shard"
            ) from None

        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self._epoch_set = False  # whether set_epoch chose the epoch (see _run_chunks)
        # torch takes any value for these two, as true or false (shuffle=1 from a config).
        self.shuffle = bool(shuffle)
        self.seed = as_int("seed", seed, allow_bool=True)
        self.drop_last = bool(drop_last)
        self.pad = check_bool("pad", pad, error=TypeError)
        self._length = length

        if drop_last:
            # Only whole rounds of num_replicas: the tail is dropped.
            self.total_size = length // num_replicas * num_replicas
            self.num_samples = self.total_size // num_replicas
        elif pad:
            self.num_samples = math.ceil(length / num_replicas)
            self.total_size = self.num_samples * num_replicas
        else:
            self.total_size = length
            self.num_samples = len(range(rank, length, num_replicas))

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch, which with ``seed`` decides the shuffle; call it on every rank.

        Example::

            >>> for epoch in range(3):
            ...     sampler.set_epoch(epoch)
            ...     for batch in loader: ...
        """
        self.epoch = as_int("epoch", epoch, allow_bool=True)
        self._epoch_set = True

    def __len__(self) -> int:
        return self.num_samples

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next ``iter(sampler)`` continue the saved epoch after ``"yielded"`` indices.

        A state with ``"epoch"`` (as :meth:`state_dict` returns) sets :attr:`epoch` to it,
        so iterations after the resumed one go on as in the uninterrupted run; a later
        :meth:`set_epoch` with another epoch starts that epoch afresh instead. A state saved
        with another ``num_replicas`` deals the saved epoch's unused indices over this
        sampler's ranks (every rank must load the state of its old rank with the same
        ``"yielded"``: ranks step in lockstep). torchdata's ``{"yielded": k}`` skips ``k`` of
        this rank's indices of the current epoch, as ``StatefulDistributedSampler`` does.

        Raises:
            ValueError: ``Invalid state_dict``, naming the key that is missing, unexpected
                or has the wrong value.

        Example::

            >>> sampler = DistributedSampler(range(10), num_replicas=2, rank=0)
            >>> sampler.set_epoch(3)
            >>> it = iter(sampler)
            >>> next(it), next(it)
            (6, 3)
            >>> resumed = DistributedSampler(range(10), num_replicas=2, rank=0)
            >>> resumed.load_state_dict(sampler.state_dict())
            >>> resumed.epoch, list(resumed)
            (3, [8, 1, 2])
        """
        super().load_state_dict(state)
        start = self._resume.start if self._resume is not None else None
        if start is not None:
            self.epoch = int(start["epoch"])

    def _next_start(self) -> dict[str, Any] | None:
        return {"epoch": self.epoch, "num_replicas": self.num_replicas, "done": 0}

    def _start_to_state(self, start: dict[str, Any]) -> dict[str, Any]:
        return {key: int(start[key]) for key in ("epoch", "num_replicas", "done")}

    def _state_to_start(self, state: Mapping[str, Any]) -> dict[str, Any] | None:
        if not any(key in state for key in self._state_keys):
            return None  # torchdata's {"yielded": k}: the epoch set when iteration begins
        if "epoch" not in state:
            got = sorted(map(str, state))
            raise ValueError(
                "Invalid state_dict: the key 'epoch' is missing; 'num_replicas' and 'done' "
                f"describe a saved epoch, so give its 'epoch' too; got keys {got}"
            )
        return {
            "epoch": _state_int(state, "epoch", "the saved iteration's epoch"),
            "num_replicas": (
                _state_int(state, "num_replicas", "the world size it was saved with", 1)
                if "num_replicas" in state
                else self.num_replicas
            ),
            "done": (
                _state_int(state, "done", "positions used before the saved iteration", 0)
                if "done" in state
                else 0
            ),
        }

    def _check_yielded(self, yielded: int, start: dict[str, Any] | None) -> None:
        # Resumed with another world size, or after such a resume, a rank's share differs.
        if start is None or (start["num_replicas"] == self.num_replicas and not start["done"]):
            super()._check_yielded(yielded, start)

    def _index_chunks(self) -> Iterator[torch.Tensor]:
        """This rank's indices as one 1-D ``int64`` tensor (the sequence ``__iter__`` yields)."""
        return self._run_chunks(SamplerRun())

    def _run_chunks(self, run: SamplerRun) -> Iterator[torch.Tensor]:
        """This rank's indices, started (or resumed) as ``run`` says.

        The user sets the epoch (``set_epoch``), so a resumed iteration continues the saved
        epoch unless ``set_epoch`` chose another one since the sampler was built (then that
        epoch starts afresh). An epoch resumed past its end (or a rank's empty share of it)
        yields nothing, and the loop's next ``set_epoch`` begins the next one.

        The start records the epoch, the world size, and ``done``: how many positions of the
        epoch's (shuffled) list all ranks together had used before this start (0 unless the
        epoch was resumed with another world size). Resumed with the world size it was saved
        with, a rank skips ``run.skip`` of its own indices. Resumed with another, the list's
        unused positions (``done`` plus ``skip`` per old rank, as ranks step in lockstep) are
        dealt round-robin over the new ranks, without padding: every sample no rank had seen
        is seen exactly once (with ``drop_last``, the tail that does not divide evenly is left
        out, as in a normal epoch).
        """
        length = len(self.dataset)
        if length != self._length:
            raise self._length_changed(length)
        self._check_split()
        if run.start is not None and self._epoch_set and int(run.start["epoch"]) != self.epoch:
            # set_epoch moved on since the state was saved (Lightning does when it resumes
            # from a checkpoint taken at an epoch's end): that epoch is over, this one is new.
            run.start, run.skip = None, 0
        if run.start is None:
            run.start = {"epoch": self.epoch, "num_replicas": self.num_replicas, "done": 0}
        epoch, replicas, done = (int(run.start[k]) for k in ("epoch", "num_replicas", "done"))
        if replicas != self.num_replicas:
            done += run.skip * replicas
            run.start = {"epoch": epoch, "num_replicas": self.num_replicas, "done": done}
            run.skip = 0
        if done == 0:
            # Positions in the (virtually repeated or truncated) list of total_size indices.
            positions = torch.arange(self.num_samples, dtype=torch.int64)
            positions.mul_(self.num_replicas).add_(self.rank)
            if self.total_size > length:
                positions.remainder_(length)  # padding repeats the list from its start
        else:
            unused = torch.arange(min(done, length), length, dtype=torch.int64)
            if self.drop_last:
                unused = unused[: unused.numel() // self.num_replicas * self.num_replicas]
            positions = unused[self.rank :: self.num_replicas]
        positions = positions[run.skip :]
        if not self.shuffle:
            yield positions
            return
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        yield torch.randperm(length, generator=generator)[positions]

    def _length_changed(self, length: int) -> DatasetLengthChangedError:
        """The error for an iteration over a dataset whose length is now ``length``.

        Where torch's sampler fails the same iteration (it builds its list of indices from the
        new length and checks it against ``total_size``), the message starts with torch's words
        and its count; elsewhere torch yields a different split without a word.
        """
        detail = (
            f"the dataset's length changed from {self._length} to {length} after the "
            "DistributedSampler was built; the split between ranks is fixed at construction, "
            "so build a new sampler for the new length"
        )
        counted = None  # how many indices torch's list of the new length holds, if it fails
        if self.drop_last:
            if length < self.total_size:
                counted = length
        elif self.pad and length > self.total_size:
            # torch pads with indices[: total_size - length]: the first total_size of them.
            counted = length + self.total_size
        if counted is not None:
            detail = (
                f"Number of indices ({counted}) does not match total_size ({self.total_size}): "
                + detail
            )
        return DatasetLengthChangedError(detail)

    def _check_split(self) -> None:
        """Check that ``rank`` and ``num_replicas``, which may be reassigned after
        construction, still describe a share of ``num_samples`` positions of the epoch's list
        of ``total_size`` (one of ``num_replicas`` shares, as the sampler was built)."""
        rank, replicas, total = self.rank, self.num_replicas, self.total_size
        if replicas != 0:
            # torch takes indices[rank:total_size:num_replicas] and checks how many it got.
            got = len(range(total)[rank:total:replicas])
            if got != self.num_samples:
                raise AssertionError(
                    f"Number of subsampled indices ({got}) does not match num_samples "
                    f"({self.num_samples}): rank={rank} of num_replicas={replicas} does not "
                    f"pick {self.num_samples} of the epoch's {total} positions; rank or "
                    "num_replicas was changed after the DistributedSampler was built, so "
                    "build a new sampler for the new split"
                )
        if not 0 <= rank < replicas:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {replicas - 1}]: "
                f"rank={rank} and num_replicas={replicas} were set after the "
                "DistributedSampler was built; build a new sampler for the new split"
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(len(dataset)={self._length}, num_replicas="
            f"{self.num_replicas}, rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, "
            f"drop_last={self.drop_last}, pad={self.pad}, epoch={self.epoch})"
        )


def shard_info() -> tuple[int, int]:
    """``(slot, total)``: which share of a stream the caller reads, and how many shares there are.

    There is one share per (rank, worker) pair: ``total = world_size * num_workers`` and
    ``slot = rank * num_workers + worker_id``. The rank and world size come from the default
    process group (in a loader's process worker, from the main process's group), or are 0 and 1
    without one; the worker from :func:`ferry.get_worker_info` (0 of 1 in the main process).

    Example::

        >>> shard_info()  # one process, no workers
        (0, 1)
    """
    rank, world_size = rank_world()
    worker = get_worker_info()
    worker_id, num_workers = (0, 1) if worker is None else (worker.id, worker.num_workers)
    return rank * num_workers + worker_id, world_size * num_workers


def shard(iterable: Iterable[T]) -> Iterator[T]:
    """Yields the caller's share of ``iterable``: every ``total``-th item from ``slot`` on.

    ``(slot, total)`` is :func:`shard_info`, read when iteration starts, so call it inside an
    iterable dataset's ``__iter__``: all ranks and all their workers then read disjoint shares
    that together cover the stream once. Each share still walks the whole stream and skips the
    items of the others; when items are costly to produce, shard something cheaper (a list of
    file names, say) and open only the files of your share. Shares differ in length by at most
    one item; with DDP, make every rank run the same number of steps (see
    ``docs/distributed.md``).

    Example::

        >>> class Lines(IterableDataset):
        ...     def __init__(self, paths):
        ...         self.paths = paths
        ...     def __iter__(self):
        ...         for path in shard(self.paths):  # each rank and worker, its own files
        ...             with open(path) as f:
        ...                 yield from f
    """
    slot, total = shard_info()
    yield from itertools.islice(iterable, slot, None, total)
