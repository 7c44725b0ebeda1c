"""The :class:`DataLoader`: validates options, builds the epoch plan, picks an engine."""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.context import BaseContext
from typing import Any, Literal, TypeVar, cast

import torch

from ferry._batching import batch_count
from ferry._core.alloc import BufferPool
from ferry._core.rng import ready_to_fork
from ferry._engine.crew.placement import should_move
from ferry._engine.failures import DEFAULT_STALL_WARNING, FailurePolicy, OnError
from ferry._engine.iterator import InlineIterator, LoaderIterator
from ferry._engine.plan import EpochPlan
from ferry._engine.position.resume import Resumer, fit_workers
from ferry._engine.position.track import Moved
from ferry._engine.transport.pin import accelerator_available, accelerator_type
from ferry._engine.tuning.autotune import Resumed, Tuner
from ferry._sampling import resolve_sampling
from ferry._torch_types import TorchDataLoader, TorchTwin
from ferry._validate import (
    NO_ACCELERATOR,
    PIN_ON_MPS,
    as_context,
    as_int,
    balance_problem,
    move_problem,
    pin_device_deprecated,
    too_many_workers,
    worker_options,
)
from ferry.collate import default_collate, default_convert
from ferry.datasets import is_iterable_style
from ferry.samplers import Sampler
from ferry.stats import LoaderStats, StatsRecorder

__all__ = ["DataLoader"]

T_co = TypeVar("T_co", covariant=True)

WorkerType = Literal["process", "thread"]

# Options that describe the epoch plan: changing them after construction would leave the
# loader's sampler and batch sampler describing something else, so it is refused (as in torch).
_FROZEN_AFTER_INIT = frozenset(
    {"batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"}
)


class DataLoader(TorchTwin, TorchDataLoader[T_co], twin=TorchDataLoader):
    """Iterates over a dataset in batches, in the main process or in worker processes/threads.

    Same signature, defaults, validation and sample order as ``torch.utils.data.DataLoader``,
    and a subclass of it, so libraries that check ``isinstance(loader, DataLoader)`` (Lightning,
    accelerate) treat it as one; none of torch's loader code runs on it.
    ferry's keyword-only options (defaults keep torch's behaviour):

    * ``worker_type``: ``"process"`` (default) or ``"thread"``; thread workers share the dataset
      without pickling and start in microseconds.
    * ``on_error="skip"`` with ``max_errors``: drop the samples whose fetch raises, within a
      budget; ``max_worker_restarts``: replace dead worker processes, same batches;
      ``stall_warning``: seconds without a batch before a report of what the workers are doing
      (see :mod:`ferry._engine.failures`).
    * ``balance_workers=True``: the next batch goes to the worker that would finish it first
      rather than to the next in turn (torch's round-robin), so workers on faster CPUs make
      more of the epoch; the order of batches is unchanged, but which worker makes a batch
      then depends on timing (see docs/design/scaling.md). Map-style datasets, with workers.
    * ``move_workers``: every 50 ms while an epoch runs, the process workers furthest behind
      in it move to the CPUs that made samples fastest (the workers count their samples;
      without counts they trade CPUs in turn), so that on CPUs of unequal speed (a cloud VM's
      vCPUs) none stays on the slowest and holds the epoch's end back. ``None`` (default): on
      where each of 2 or more process workers can have a CPU of its own (Linux, more CPUs than
      workers); ``True``: also where they outnumber the CPUs; ``False``: the scheduler alone
      places them, as in torch. Nothing else changes: the same worker makes the same batch.
    * ``num_workers="auto"`` / ``prefetch_factor="auto"``: chosen and tuned by the loader.

    It also resumes mid-epoch exactly, with the API of torchdata's ``StatefulDataLoader``:
    :meth:`state_dict` and :meth:`load_state_dict` (and its ``snapshot_every_n_steps`` option).

    Example::

        >>> loader = DataLoader(TensorDataset(x, y), batch_size=256, shuffle=True)
        >>> for xb, yb in loader:
        ...     loss = model(xb, yb)
    """

    dataset: Any
    batch_size: int | None
    num_workers: int
    pin_memory: bool
    drop_last: bool
    timeout: float
    sampler: Sampler[Any] | Iterable[Any]
    batch_sampler: Sampler[Any] | Iterable[Any] | None
    prefetch_factor: int | None
    generator: torch.Generator | None
    # Inside this class the name is mangled to ``_DataLoader__initialized``: the very attribute
    # torch's loader has, so code that reads it off a loader finds the truth here too.
    __initialized = False
    # torch's class declares this None (its type: the value it starts with); it holds a length.
    _IterableDataset_len_called: int | None = None  # type: ignore[assignment]

    def __init__(  # noqa: PLR0917 - torch's signature takes these positionally
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[Any] | Iterable[Any] | None = None,
        num_workers: int | Literal["auto"] = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: str | BaseContext | None = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | Literal["auto"] | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        worker_type: WorkerType = "process",
        snapshot_every_n_steps: int = 1,
        on_error: OnError = "raise",
        max_errors: int | float | None = None,
        max_worker_restarts: int = 0,
        stall_warning: float | None = DEFAULT_STALL_WARNING,
        balance_workers: bool = False,
        move_workers: bool | None = None,
    ) -> None:
        if worker_type not in ("process", "thread"):
            raise ValueError(f"worker_type must be 'process' or 'thread', got {worker_type!r}")
        iterable = is_iterable_style(dataset)
        problem = balance_problem(balance_workers, num_workers, iterable) or move_problem(
            move_workers, num_workers, worker_type
        )
        if problem is not None:
            raise problem
        self._tuner = Tuner.for_options(
            num_workers, prefetch_factor, iterable=iterable, worker_type=worker_type
        )
        if self._tuner is not None:
            num_workers, prefetch_factor = self._tuner.first()
        num_workers, prefetch_factor = worker_options(
            num_workers, prefetch_factor, timeout, persistent_workers
        )
        # Checked now; kept as attributes (as every option is), which libraries that rebuild
        # a loader from its attributes (Lightning, accelerate) carry over.
        failures = FailurePolicy.from_options(
            on_error, max_errors, max_worker_restarts, stall_warning
        )
        self.on_error, self.max_errors = failures.on_error, failures.max_errors
        self.max_worker_restarts = failures.max_worker_restarts
        self.stall_warning = failures.stall_warning
        snapshot_every_n_steps = as_int(
            "snapshot_every_n_steps", snapshot_every_n_steps, allow_bool=False
        )
        if snapshot_every_n_steps < 0:
            raise ValueError(
                "snapshot_every_n_steps must be a number of batches >= 0 (0: user states are "
                f"taken only when an epoch begins), got {snapshot_every_n_steps}"
            )

        self.dataset = dataset
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.worker_type: WorkerType = worker_type
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self.multiprocessing_context = multiprocessing_context
        self.in_order = in_order
        self.balance_workers = balance_workers
        self.move_workers = move_workers
        # num_workers="auto" made the workers threads because their reads waited (see
        # _retune): they become processes again if they turn out bound by the GIL.
        self._threads_for_waits = False
        if num_workers > 0:
            # What the first iter() would do once per process, done here instead of on the
            # way to the first batch: the worker engine's modules (about 13 ms), and numpy's
            # random module for the workers to seed (see ready_to_fork).
            import ferry._engine.pool  # noqa: F401

            if worker_type == "process":
                ready_to_fork()

        # torch's name and values: 1 for an iterable-style dataset, 0 for map-style.
        self._dataset_kind = 1 if iterable else 0
        sampler, batch_sampler, batch_size, drop_last = resolve_sampling(
            dataset, iterable, batch_size, shuffle, sampler, batch_sampler, drop_last, generator
        )

        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.generator = generator
        if collate_fn is None:
            collate_fn = default_collate if self._auto_collation else default_convert
        self.collate_fn = collate_fn
        self.persistent_workers = persistent_workers

        # As torch names it: len(loader) of an iterable-style dataset once asked (the length
        # check compares against it).
        self._IterableDataset_len_called = None
        # What iter() returned last with persistent workers (torch's ``_iterator``), ferry's
        # iterator behind what an overridden _get_iterator() returned (by the latter's id),
        # and the iterator the running _get_iterator() call made.
        self._live_iterator: Any = None
        self._wrapped: dict[int, LoaderIterator] = {}
        self._made: LoaderIterator | None = None
        # Persistent workers an error stopped: their base seed, for the workers that replace
        # them (as torch's persistent workers keep theirs), taken by the next iterator made.
        self._kept_seed: int | None = None
        # Resume: the state loaded for the next iterator, and the epoch track of the last one.
        self._resume = Resumer()
        self._pool: BufferPool | None = None
        self._pool_lock = threading.Lock()
        self.__initialized = True
        self.check_worker_number_rationality()

    # -- options -------------------------------------------------------------------------------

    @property
    def multiprocessing_context(self) -> BaseContext | None:
        """The start method workers use: a context object, or None for the platform default."""
        return self.__multiprocessing_context

    @multiprocessing_context.setter
    def multiprocessing_context(self, context: str | BaseContext | None) -> None:
        self.__multiprocessing_context: BaseContext | None = as_context(context, self.num_workers)

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__initialized and name in _FROZEN_AFTER_INIT:
            raise ValueError(
                f"{name} attribute should not be set after {type(self).__name__} is initialized: "
                "it is part of the plan the sampler and batch sampler were built from; build a "
                "new loader instead"
            )
        # object's, not super()'s: torch's DataLoader is up the MRO, and its code must not run.
        object.__setattr__(self, name, value)

    @property
    def _iterable_style(self) -> bool:
        return self._dataset_kind == 1

    @property
    def _auto_collation(self) -> bool:
        return self.batch_sampler is not None

    @property
    def _index_sampler(self) -> Sampler[Any] | Iterable[Any]:
        return self.batch_sampler if self.batch_sampler is not None else self.sampler

    # -- iteration -----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[T_co]:  # type: ignore[override]
        # As torch's: the iterator comes from _get_iterator(), which subclasses override to
        # observe or wrap it; with persistent workers the kept one is reset each epoch.
        if self._tuner is not None:
            self._retune()
        if self.persistent_workers and self.num_workers > 0:
            kept = self._live_iterator
            reset = getattr(kept, "_reset", None)
            stopped = getattr(kept, "stopped_by_error", False)
            if kept is None or reset is None or stopped or self._resume.pending is not None:
                # (an iterator without torch's _reset, which an override may return, is
                # replaced, where torch's loader would fail on it; so is one an error ended:
                # its workers were stopped, the next epoch starts new ones, with their seed)
                if stopped and self._resume.pending is None:
                    self._kept_seed = getattr(self._wrapped.get(id(kept), kept), "_base_seed", None)
                try:
                    self._replace_iterator(self._obtain_iterator())  # stops the old workers
                finally:
                    self._kept_seed = None
            else:
                reset(self)
            return self._live_iterator  # type: ignore[no-any-return]
        return self._obtain_iterator()  # type: ignore[no-any-return]

    def _obtain_iterator(self) -> Any:
        """``self._get_iterator()``, noting whether ferry made the iterator it returned (or one
        it wraps): :meth:`state_dict` describes only ferry's iterators."""
        self._made = None
        iterator = self._get_iterator()
        # (read through cast: mypy keeps the None set above across the call)
        made, self._made = cast("LoaderIterator | None", self._made), None
        self._resume.foreign = None if made is not None else type(iterator)
        if made is not None and made is not iterator:
            self._wrapped[id(iterator)] = made
        return iterator

    # -- resume (the API of torchdata's StatefulDataLoader) -------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch this loader handed out, as plain data.

        Load it with :meth:`load_state_dict` into this loader or a new one built the same way
        (in another process, after a crash) and the next iterator continues exactly there, at
        every save point torchdata's ``StatefulDataLoader`` has: before the first batch, mid-
        epoch, after an epoch's last batch (the resumed iterator then ends that epoch without a
        batch; the next ``iter()`` begins the next one), and between epochs. The rest of the
        epoch has the same batches, shuffles, worker seeds and (process workers) random
        augmentations as an uninterrupted run, and so have later epochs, when the loader has a
        ``generator``. Without one, later epochs draw their shuffle and worker seeds from
        torch's global RNG, as torch's loader does: they match the uninterrupted run only if
        the global RNG was restored with the checkpoint, and the loader warns
        (:class:`ferry.errors.EpochReplayWarning`) when one would repeat an earlier epoch.

        The state is plain data (``json`` and ``torch.save``/``torch.load(weights_only=True)``
        keep it), small (a few kilobytes per worker, whatever the dataset's size), and cheap to
        take: no worker is asked, so call it as often as you like.

        Example::

            >>> for step, batch in enumerate(loader):
            ...     train(batch)
            ...     if step % 1000 == 0:
            ...         state = {"model": model.state_dict(), "loader": loader.state_dict()}
            ...         torch.save(state, path)
        """
        state = self._resume.state_dict(self)
        state.pop("tuning", None)  # (a state loaded as it was: this loader's own is written)
        if self._tuner is not None:
            # (num_workers="auto": what tuning found goes on in the resumed loader)
            kind, for_waits = self.worker_type, self._threads_for_waits
            moved = self._moved() if self._resume.pending is None else None
            if moved is not None:
                kind, for_waits = "thread", not moved.for_memory
            setting = (self.num_workers, self.prefetch_factor)
            state["tuning"] = self._tuner.to_plain(setting, kind, for_waits)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next iterator start where ``state_dict`` (from :meth:`state_dict`) was taken.

        The loader may have another ``num_workers`` than the one the state came from (map-style
        datasets; for streams see the README), and a :class:`~ferry.DistributedSampler` another
        world size. Raises ValueError when the state does not fit this loader (another dataset
        length, batch size, sampler kind, ...), naming what differs. An empty dict is ignored,
        as torchdata's loader ignores it.
        """
        if isinstance(state_dict, dict) and not state_dict:
            return
        tuning = state_dict.get("tuning") if isinstance(state_dict, dict) else None
        if self._tuner is None or tuning is None:
            self._resume.load_state_dict(self, state_dict)
        else:
            self._load_with_tuning(state_dict, tuning)
        if self._live_iterator is not None:
            self._replace_iterator(None)  # persistent workers: the next iter() starts there

    def _load_with_tuning(self, state_dict: dict[str, Any], tuning: object) -> None:
        """``load_state_dict`` of a state with ``num_workers="auto"``'s tuning into a loader
        that tunes too: the options and the kind of worker it reached go on (see
        :meth:`Tuner.resumed`); the loader is left as it was if the state does not load."""
        assert self._tuner is not None
        setting = (self.num_workers, self.prefetch_factor)
        before = (self._tuner, Resumed(*setting, self.worker_type, self._threads_for_waits))
        self._tune_as(*self._tuner.resumed(tuning, setting))
        try:
            self._resume.load_state_dict(self, state_dict)
        except BaseException:
            self._tune_as(*before)
            raise

    def _tune_as(self, tuner: Tuner, options: Resumed) -> None:
        self._tuner = tuner
        self.num_workers, self.prefetch_factor = options.num_workers, options.prefetch_factor
        self.worker_type = cast("WorkerType", options.worker_type)
        self._threads_for_waits = options.threads_for_waits

    def _moved(self) -> Moved | None:
        """How ``num_workers="auto"`` moved the last iterator's epoch to other workers (None:
        it did not), while the loader's own options are still those it began with."""
        track = self._resume.track
        if track is None or track.plan.worker_type == self.worker_type:
            return None
        return track.switched

    def stats(self) -> LoaderStats:
        """Where the time of the epoch in progress (or the last one) went, per stage and per
        worker: a :class:`ferry.stats.LoaderStats`; ``print()`` it, or log ``.as_dict()``."""
        track, recorder = self._resume.track, self._resume.stats
        if track is not None and recorder is not None:
            workers, kind = track.plan.num_workers, track.plan.worker_type
        else:
            workers, kind = self.num_workers, self.worker_type
            recorder = StatsRecorder(max(workers, 1))
        engine = "inline" if workers == 0 else kind
        tuning = self._tuner.reason if self._tuner is not None else ""
        if track is not None and track.switched and track.switched.why not in tuning:
            tuning = f"{track.switched.why}; {tuning}"
        return recorder.result(engine, tuning)

    def _retune(self) -> None:
        """At an epoch boundary, let the tuner change ``num_workers``/``prefetch_factor``
        (``"auto"``) from the last epoch's statistics; a change replaces persistent workers."""
        assert self._tuner is not None
        track = self._resume.track
        if track is not None and track.reads_compute:
            self._tuner.reads_compute = True  # (from now on no worker is held back for it)
        if track is None or not track.finished or self._resume.pending is not None:
            return
        # The workers of the last epoch became threads when their reads waited: the next
        # epochs start with threads (see ThreadMove.move in _engine/tuning/switch.py). Thread
        # workers chosen so that were found bound by the GIL become processes again.
        moved = self._moved()
        switched = moved.why if moved is not None else ""
        if moved is not None and not moved.for_memory:
            self._threads_for_waits = True
        current = (self.num_workers, self.prefetch_factor)
        stats = self.stats()
        gil_bound = self._tuner.gil_bound(stats) if self._threads_for_waits else ""
        if gil_bound:
            chosen = self._tuner.back_to_processes(current, gil_bound)
            self.worker_type, self._threads_for_waits = "process", False
        else:
            chosen = self._tuner.after_epoch(stats, current)
            if switched:
                self.worker_type = "thread"
        if switched:
            self._tuner.reason = f"{switched}; {self._tuner.reason}"
        if self._live_iterator is not None and (gil_bound or chosen != current):
            # Persistent workers are replaced (by other ones, or of another kind); the next
            # epoch begins as theirs would have (a fresh iterator would draw another base
            # seed, and shuffle differently).
            self._resume.carry_over()
            self._replace_iterator(None)
        if chosen != current:
            self.num_workers, self.prefetch_factor = chosen

    @property
    def _iterator(self) -> Any:
        """The iterator kept between epochs (``persistent_workers=True``), as in torch.

        Libraries reset a loader by setting this to None (Lightning does at the end of every
        fit/validate/test/predict): that stops the kept workers now and the next ``iter()``
        starts afresh. Setting it to another iterator stops the old one's workers too. An
        iterator ferry did not make (one a ``_get_iterator`` override returned) is let go as
        torch lets it go, and stops when its own code says.
        """
        return self._live_iterator

    @_iterator.setter
    def _iterator(self, iterator: Any) -> None:
        self._replace_iterator(iterator)

    def _replace_iterator(self, iterator: Any) -> None:
        old = self.__dict__.get("_live_iterator")
        self._live_iterator = iterator
        if old is not None and old is not iterator:
            # ferry's own iterator (or the one an override's iterator wraps) stops its workers
            # now. Any other is only let go, as torch's loader lets its iterator go: that
            # iterator's code decides when its workers stop (torch's when it is collected;
            # Lightning stops them itself before it sets None), and asking again here would
            # stop it twice, which code that counts its shutdowns sees.
            made = self._wrapped.pop(id(old), None)
            if made is None and isinstance(old, LoaderIterator):
                made = old
            if made is not None and made is not iterator:
                made._shutdown_workers()

    def _get_iterator(self) -> LoaderIterator:
        """A new iterator over this loader (torch's hook: ``iter()`` asks it, so a subclass may
        override it to observe or wrap iterators)."""
        return self._make_iterator()

    def _make_iterator(self) -> LoaderIterator:
        if self.num_workers < 0:
            # Only reachable by setting num_workers after construction, which checks it; torch
            # refuses it here too (an iterator with workers needs at least one).
            raise AssertionError(
                "num_workers must be greater than 0 for loading with workers, got "
                f"num_workers={self.num_workers} (set after the DataLoader was built); use "
                "num_workers=0 to load in the main process"
            )
        if self.num_workers > 0 and self.prefetch_factor is not None and self.prefetch_factor < 1:
            # torch refuses it when the iterator is made: no batch could ever be asked for.
            # (None, left by a loader built without workers and given some since, loads the
            # default 2 ahead, where torch fails comparing None.)
            raise AssertionError(
                "prefetch_factor must be greater than 0 for loading with workers "
                f"(num_workers={self.num_workers}): it is the number of batches each worker "
                f"loads ahead, got prefetch_factor={self.prefetch_factor}"
            )
        # As torch's iterators warn when made (not when a kept one is reset), in its order;
        # attributed to the user's line (user -> __iter__ -> _obtain_iterator ->
        # _get_iterator -> here -> the check).
        if self.num_workers > 0:
            self._check_workers(stacklevel=6)
        if self.pin_memory:
            self._warn_pinning(stacklevel=6)
        plan = self._plan()
        self._resume.begin(self.dataset)  # (warns once, here, if it cannot be asked)
        resume, budget, run = self._resume.take_pending()
        if resume is not None:
            resume = fit_workers(resume, self.num_workers, self.dataset, self._iterable_style)
        iterator: LoaderIterator
        if self.num_workers == 0:
            iterator = InlineIterator(plan, resume, budget, run)
        else:
            from ferry._engine.pool import WorkerIterator

            iterator = WorkerIterator(plan, resume, budget, run, base_seed=self._kept_seed)
        self._resume.track, self._resume.stats = iterator._track, iterator._stats
        self._made = iterator
        return iterator

    def _plan(self) -> EpochPlan:
        """This loader's parts and options as the next epoch will use them."""
        pin, accelerator, _ = self._pinning()
        return EpochPlan(
            dataset=self.dataset,
            iterable_style=self._iterable_style,
            sampler=self.sampler,
            batch_sampler=self.batch_sampler,
            batch_size=self.batch_size,
            collate_fn=self.collate_fn,
            drop_last=self.drop_last,
            generator=self.generator,
            num_workers=self.num_workers,
            prefetch_factor=(
                2 if self.prefetch_factor is None and self.num_workers else self.prefetch_factor
            ),
            timeout=self.timeout,
            worker_init_fn=self.worker_init_fn,
            multiprocessing_context=self.multiprocessing_context,
            persistent_workers=self.persistent_workers,
            in_order=self.in_order,
            worker_type=self.worker_type,
            pin=pin,
            pin_memory_device=self.pin_memory_device,
            pin_accelerator=accelerator,
            buffer_pool=self._buffer_pool(),
            reported_length=self._IterableDataset_len_called,
            snapshot_every=self.snapshot_every_n_steps,
            reads_at_once=self._tuner is not None and self.worker_type == "process",
            threads_if_waiting=(
                self._tuner is not None
                and self.worker_type == "process"
                and not self._tuner.threads_refused
            ),
            hold_workers=self._tuner is not None and not self._tuner.reads_compute,
            balance_workers=self.balance_workers,
            move_workers=should_move(self.move_workers, self.worker_type, self.num_workers),
            failures=FailurePolicy.from_options(
                self.on_error, self.max_errors, self.max_worker_restarts, self.stall_warning
            ),
        )

    def __len__(self) -> int:
        if not self._iterable_style:
            return batch_count(self._index_sampler)
        length = len(self.dataset)
        self._IterableDataset_len_called = length
        if self.batch_size is None:
            return length
        if self.drop_last:
            return length // self.batch_size
        return math.ceil(length / self.batch_size)

    # -- helpers for the engines ---------------------------------------------------------------

    def _buffer_pool(self) -> BufferPool:
        """The loader's reusable batch buffers, shared by its iterators across epochs."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = BufferPool()
            return self._pool

    def check_worker_number_rationality(self) -> None:
        """Warn when ``num_workers`` exceeds the CPUs this process may run on (or when that
        number is unknown). Asked when the loader is built and, as torch asks it, each time an
        iterator with workers is made (``num_workers`` may have changed since)."""
        self._check_workers(stacklevel=4)

    def _pinning(self) -> tuple[bool, str | None, str | None]:
        """Whether batches are pinned, the accelerator's kind, and, where ``pin_memory=True``
        cannot pin, the warning that says why: no accelerator, or Apple's MPS, where pinning
        fails (as torch: warn, and do not pin)."""
        if not self.pin_memory:
            return False, None, None
        if not accelerator_available():
            return False, None, NO_ACCELERATOR
        accelerator = accelerator_type()
        if accelerator == "mps":
            return False, None, PIN_ON_MPS
        return True, accelerator, None

    def _warn_pinning(self, stacklevel: int) -> None:
        """``pin_memory=True`` with the deprecated device option, or where it cannot pin."""
        if self.pin_memory_device:
            warnings.warn(
                pin_device_deprecated(self.pin_memory_device), UserWarning, stacklevel=stacklevel
            )
        _, _, cannot = self._pinning()
        if cannot is not None:
            warnings.warn(cannot, UserWarning, stacklevel=stacklevel)

    def _check_workers(self, stacklevel: int) -> None:
        """The check, its warning attributed ``stacklevel`` frames up from here."""
        message = too_many_workers(self.num_workers, self.worker_type)
        if message is not None:
            warnings.warn(message, UserWarning, stacklevel=stacklevel)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # Live state (an epoch in progress, buffers, a lock) does not travel with the loader.
        state.update(_live_iterator=None, _wrapped={}, _made=None, _pool=None, _pool_lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__["_pool_lock"] = threading.Lock()
