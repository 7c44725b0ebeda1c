"""The DataLoader's errors and warnings keep torch's fixed phrases (see :mod:`compat.phrases`):
option validation, ``len()``, the iterator, the CPU-count and length warnings, pinning, and
the failures of worker processes (timeout, death, pickling, an exception in user code)."""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Iterator
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

import ferry
from _support import datasets as ds
from _support.compare import stream_dataset
from _support.torch_versions import needs_torch
from compat.phrases import Case, check, params
from ferry._engine.transport.pin import accelerator_available

pytestmark = pytest.mark.usefixtures("guard_global_state")

DATA = list(range(6))


def loader(module: Any, dataset: Any = None, **kwargs: Any) -> Any:
    return module.DataLoader(DATA if dataset is None else dataset, **kwargs)


def first_batch(module: Any, dataset: Any = None, **kwargs: Any) -> Any:
    return next(iter(loader(module, dataset, **kwargs)))


class NoLen:
    """Map-style without a length."""

    def __getitem__(self, index: int) -> int:
        return index


def set_after_init(name: str, value: Any) -> Any:
    def trigger(module: Any) -> None:
        setattr(loader(module), name, value)

    return trigger


def set_after_init_of_a_subclass(module: Any) -> None:
    """The message names the loader's class."""

    class MyLoader(module.DataLoader):
        pass

    MyLoader(DATA).batch_size = 2


def set_context_after_init(value: Any, num_workers: int) -> Any:
    """``multiprocessing_context`` is checked when set after construction too."""

    def trigger(module: Any) -> None:
        loader(module, num_workers=num_workers).multiprocessing_context = value

    return trigger


def negative_workers_after_init(module: Any) -> None:
    built = loader(module, num_workers=1)
    built.num_workers = -1
    next(iter(built))


def more_batches_than_len(module: Any, **kwargs: Any) -> None:
    built = loader(module, stream_dataset(module, [0, 1, 2], length=2), **kwargs)
    len(built)
    list(built)


def pickle_iterator_with_workers(module: Any) -> None:
    iterator = iter(loader(module, num_workers=1, multiprocessing_context="fork"))
    try:
        pickle.dumps(iterator)
    finally:
        iterator._shutdown_workers()


def fails_in_worker(dataset: Any = DATA, num_workers: int = 1, **kwargs: Any) -> Any:
    def trigger(module: Any) -> None:
        list(
            loader(
                module,
                dataset,
                num_workers=num_workers,
                multiprocessing_context="fork",
                **kwargs,
            )
        )

    return trigger


@contextlib.contextmanager
def cpus(affinity: set[int] | None, count: int | None) -> Iterator[None]:
    """``os.sched_getaffinity`` answering ``affinity`` (absent when None), ``os.cpu_count``
    answering ``count``."""
    saved = os.sched_getaffinity
    if affinity is None:
        del os.sched_getaffinity
    else:
        os.sched_getaffinity = lambda pid: affinity
    try:
        with mock.patch.object(os, "cpu_count", return_value=count):
            yield
    finally:
        os.sched_getaffinity = saved


def too_many_workers(affinity: set[int] | None, count: int | None) -> Any:
    def trigger(module: Any) -> None:
        with cpus(affinity, count):
            loader(module, num_workers=2)

    return trigger


def pin_on_mps(**kwargs: Any) -> Any:
    """A first batch with ``pin_memory=True`` on a machine whose accelerator is Apple's MPS
    (faked: torch asks ``torch.accelerator`` which one is there)."""

    def trigger(module: Any) -> None:
        with (
            mock.patch.object(torch.accelerator, "is_available", return_value=True),
            mock.patch.object(
                torch.accelerator, "current_accelerator", return_value=torch.device("mps")
            ),
        ):
            batches = list(loader(module, pin_memory=True, batch_size=3, **kwargs))
        assert not any(batch.is_pinned() for batch in batches)

    return trigger


def pickle_iterator(module: Any) -> None:
    pickle.dumps(iter(loader(module)))


def unpicklable_dataset(context: str) -> Any:
    def trigger(module: Any) -> None:
        first_batch(module, ds.HoldsLambda(4), num_workers=1, multiprocessing_context=context)

    return trigger


def warns_then_raises(trigger: Any) -> Any:
    """``trigger`` warns, then raises: the warning is what is checked."""

    def warn_only(module: Any) -> None:
        with contextlib.suppress(Exception):
            trigger(module)

    return warn_only


NO_ACCELERATOR = pytest.mark.skipif(
    accelerator_available(), reason="the warning is about a machine with no accelerator"
)
WORKERS = pytest.mark.timeout(60)
# torch's loader asks torch.accelerator where to pin, and warns as it says.
ACCELERATOR_API = needs_torch("2.9", "pinning by torch.accelerator and its warnings")


OPTIONS = [
    Case(
        "num_workers_negative",
        lambda m: loader(m, num_workers=-1),
        ValueError,
        (
            "num_workers option should be non-negative; use num_workers=0 to disable "
            "multiprocessing",
        ),
    ),
    Case(
        "timeout_negative",
        lambda m: loader(m, timeout=-1),
        ValueError,
        ("timeout option should be non-negative",),
    ),
    Case(
        "prefetch_factor_without_workers",
        lambda m: loader(m, prefetch_factor=2),
        ValueError,
        ("prefetch_factor option could only be specified in multiprocessing",),
    ),
    Case(
        "prefetch_factor_negative",
        lambda m: loader(m, num_workers=1, prefetch_factor=-1),
        ValueError,
        ("prefetch_factor option should be non-negative",),
    ),
    # A count that is a real number but not an integer: torch compares it in its constructor
    # and counts with it only in iter(). So a negative one is the non-negative ValueError, and
    # while torch's constructor checks run, one above 0 is no error yet: a later option's is.
    Case(
        "num_workers_negative_float",
        lambda m: loader(m, num_workers=-0.5),
        ValueError,
        ("num_workers option should be non-negative",),
    ),
    Case(
        "prefetch_factor_negative_float",
        lambda m: loader(m, num_workers=1, prefetch_factor=-0.5),
        ValueError,
        ("prefetch_factor option should be non-negative",),
    ),
    Case(
        "timeout_negative_beside_float_workers",
        lambda m: loader(m, num_workers=1.5, timeout=-1),
        ValueError,
        ("timeout option should be non-negative",),
    ),
    Case(
        "prefetch_factor_negative_beside_float_workers",
        lambda m: loader(m, num_workers=1.5, prefetch_factor=-1),
        ValueError,
        ("prefetch_factor option should be non-negative",),
    ),
    # A string prefetch_factor (not "auto") comes after torch's checks of the options before
    # it: without workers, it is any prefetch_factor's ValueError.
    Case(
        "prefetch_factor_string_without_workers",
        lambda m: loader(m, prefetch_factor="2"),
        ValueError,
        ("prefetch_factor option could only be specified in multiprocessing",),
    ),
    Case(
        "prefetch_factor_string_beside_negative_workers",
        lambda m: loader(m, num_workers=-1, prefetch_factor="2"),
        ValueError,
        ("num_workers option should be non-negative",),
    ),
    Case(
        "prefetch_factor_string_beside_negative_timeout",
        lambda m: loader(m, num_workers=1, prefetch_factor="2", timeout=-1),
        ValueError,
        ("timeout option should be non-negative",),
    ),
    Case(
        "persistent_workers_without_workers",
        lambda m: loader(m, persistent_workers=True),
        ValueError,
        ("persistent_workers option needs num_workers > 0",),
    ),
    Case(
        "iterable_with_shuffle",
        lambda m: loader(m, stream_dataset(m, DATA), shuffle=True),
        ValueError,
        (
            "DataLoader with IterableDataset: expected unspecified shuffle option, "
            "but got shuffle=True",
        ),
    ),
    Case(
        "iterable_with_sampler",
        lambda m: loader(m, stream_dataset(m, DATA), sampler=[0, 1]),
        ValueError,
        (
            r"DataLoader with IterableDataset: expected unspecified sampler option, "
            r"but got sampler=\[0, 1\]",
        ),
    ),
    Case(
        "iterable_with_batch_sampler",
        lambda m: loader(m, stream_dataset(m, DATA), batch_sampler=[[0, 1]]),
        ValueError,
        (
            r"DataLoader with IterableDataset: expected unspecified batch_sampler option, "
            r"but got batch_sampler=\[\[0, 1\]\]",
        ),
    ),
    *(
        Case(
            f"batch_size_{label}",
            lambda m, size=size: loader(m, batch_size=size),
            ValueError,
            (f"batch_size should be a positive integer value, but got batch_size={size}",),
        )
        for label, size in [("zero", 0), ("negative", -1), ("float", 2.0), ("bool", True)]
    ),
    Case(
        "drop_last_not_bool",
        lambda m: loader(m, drop_last=1),
        ValueError,
        ("drop_last should be a boolean value, but got drop_last=1",),
    ),
    Case(
        "iterable_with_shuffle_not_bool",
        lambda m: loader(m, stream_dataset(m, DATA), shuffle="yes"),
        ValueError,
        (
            "DataLoader with IterableDataset: expected unspecified shuffle option, "
            "but got shuffle=yes",
        ),
    ),
    Case(
        "sampler_with_shuffle",
        lambda m: loader(m, sampler=[0, 1], shuffle=True),
        ValueError,
        ("sampler option is mutually exclusive with shuffle",),
    ),
    *(
        Case(
            f"batch_sampler_with_{option}",
            lambda m, kw=kwargs: loader(m, batch_sampler=[[0, 1]], **kw),
            ValueError,
            (
                "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, "
                "and drop_last",
            ),
        )
        for option, kwargs in [
            ("batch_size", {"batch_size": 2}),
            ("shuffle", {"shuffle": True}),
            ("sampler", {"sampler": [0, 1]}),
            ("drop_last", {"drop_last": True}),
            # Not batch_size's default (1): torch refuses None too.
            ("batch_size_none", {"batch_size": None}),
        ]
    ),
    Case(
        "batch_size_none_with_drop_last",
        lambda m: loader(m, batch_size=None, drop_last=True),
        ValueError,
        ("batch_size=None option disables auto-batching and is mutually exclusive with drop_last",),
    ),
    Case(
        "multiprocessing_context_without_workers",
        lambda m: loader(m, multiprocessing_context="fork"),
        ValueError,
        (
            r"multiprocessing_context can only be used with multi-process loading "
            r"\(num_workers > 0\), but got num_workers=0",
        ),
    ),
    Case(
        "multiprocessing_context_unknown_method",
        lambda m: loader(m, num_workers=1, multiprocessing_context="bogus"),
        ValueError,
        (
            r"multiprocessing_context option should specify a valid start method in "
            r"\[[^]]*'fork'[^]]*\], but got multiprocessing_context='bogus'",
        ),
    ),
    Case(
        "multiprocessing_context_wrong_type",
        lambda m: loader(m, num_workers=1, multiprocessing_context=5),
        TypeError,
        (
            "multiprocessing_context option should be a valid context object or a string "
            "specifying the start method, but got multiprocessing_context=5",
        ),
    ),
    *(
        Case(
            f"set_{name}_after_init",
            set_after_init(name, value),
            ValueError,
            (f"{name} attribute should not be set after DataLoader is initialized",),
        )
        for name, value in [
            ("batch_size", 2),
            ("batch_sampler", None),
            ("sampler", None),
            ("drop_last", True),
            ("dataset", []),
            ("persistent_workers", True),
        ]
    ),
    Case(
        "set_after_init_of_a_subclass",
        set_after_init_of_a_subclass,
        ValueError,
        ("batch_size attribute should not be set after MyLoader is initialized",),
    ),
    Case(
        "set_multiprocessing_context_unknown_method",
        set_context_after_init("bogus", 1),
        ValueError,
        (
            r"multiprocessing_context option should specify a valid start method in "
            r"\[[^]]*'fork'[^]]*\], but got multiprocessing_context='bogus'",
        ),
    ),
    Case(
        "set_multiprocessing_context_wrong_type",
        set_context_after_init(5, 1),
        TypeError,
        (
            "multiprocessing_context option should be a valid context object or a string "
            "specifying the start method, but got multiprocessing_context=5",
        ),
    ),
    Case(
        "set_multiprocessing_context_without_workers",
        set_context_after_init("fork", 0),
        ValueError,
        (
            r"multiprocessing_context can only be used with multi-process loading "
            r"\(num_workers > 0\), but got num_workers=0",
        ),
    ),
]

ITERATION = [
    Case(
        "len_of_stream_without_len",
        lambda m: len(loader(m, stream_dataset(m, DATA))),
        TypeError,
        (r"object of type 'Stream' has no len\(\)",),
    ),
    Case(
        "len_of_map_dataset_without_len",
        lambda m: len(loader(m, NoLen())),
        TypeError,
        (r"object of type 'NoLen' has no len\(\)",),
    ),
    Case(
        "timeout_without_workers",
        lambda m: first_batch(m, timeout=1),
        AssertionError,
        ("requires timeout == 0",),
        marks=[needs_torch("2.13", "this message")],
    ),
    Case(
        "prefetch_factor_zero_with_workers",
        lambda m: first_batch(m, num_workers=1, prefetch_factor=0),
        AssertionError,
        ("prefetch_factor must be greater than 0",),
        # torch's half-built iterator fails in __del__ (it has no _shutdown attribute yet).
        marks=[
            pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
            needs_torch("2.13", "this message"),
        ],
    ),
    Case(
        "num_workers_negative_after_init",
        negative_workers_after_init,
        AssertionError,
        ("num_workers must be greater than 0",),
        # torch's half-built iterator fails in __del__ (it has no _shutdown attribute yet).
        marks=[
            pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
            needs_torch("2.13", "this message"),
        ],
    ),
    Case(
        "pickle_an_iterator",
        pickle_iterator,
        NotImplementedError,
        ("cannot be pickled",),
    ),
    Case(
        "pickle_an_iterator_with_workers",
        pickle_iterator_with_workers,
        NotImplementedError,
        ("cannot be pickled",),
        marks=[WORKERS],
    ),
]

WARNINGS = [
    Case(
        "more_batches_than_len",
        more_batches_than_len,
        UserWarning,
        (
            r"Length of IterableDataset <.* object at 0x\w+> was reported to be 2\(when "
            r"accessing len\(dataloader\)\), but 3 samples have been fetched\. ",
        ),
        marks=[needs_torch("2.5", "this warning's words")],
    ),
    Case(
        "more_batches_than_len_with_workers",
        lambda m: more_batches_than_len(m, num_workers=1, multiprocessing_context="fork"),
        UserWarning,
        (
            r"was reported to be 2\(when accessing len\(dataloader\)\), but 3 samples have "
            r"been fetched\. ",
            "For multiprocessing data-loading, this could be caused by not properly configuring "
            "the IterableDataset replica at each worker",
        ),
        marks=[WORKERS, needs_torch("2.5", "this warning's words")],
    ),
    Case(
        "too_many_workers_for_the_affinity",
        too_many_workers({0}, 8),
        UserWarning,
        (
            "This DataLoader will create 2 worker processes in total",
            "Our suggested max number of worker in current system is 1, which is smaller than "
            "what this DataLoader is going to create",
            "excessive worker creation might get DataLoader running slow or even freeze",
        ),
    ),
    Case(
        "too_many_workers_for_the_cpu_count",
        too_many_workers(None, 1),
        UserWarning,
        (
            "This DataLoader will create 2 worker processes in total",
            r"Our suggested max number of worker in current system is 1 \(`cpuset` is not taken "
            r"into account\), which is smaller than what this DataLoader is going to create",
            "excessive worker creation might get DataLoader running slow or even freeze",
        ),
    ),
    Case(
        "unknown_cpu_count",
        too_many_workers(None, None),
        UserWarning,
        (
            "This DataLoader will create 2 worker processes in total",
            "DataLoader is not able to compute a suggested max number of worker in current system",
            "excessive worker creation might get DataLoader running slow or even freeze",
        ),
    ),
    Case(
        "pin_memory_without_accelerator",
        lambda m: first_batch(m, pin_memory=True),
        UserWarning,
        ("'pin_memory' argument is set as true but no accelerator is found",),
        marks=[NO_ACCELERATOR, ACCELERATOR_API],
    ),
    Case(
        "pin_memory_without_accelerator_with_workers",
        lambda m: first_batch(m, pin_memory=True, num_workers=1, multiprocessing_context="fork"),
        UserWarning,
        ("'pin_memory' argument is set as true but no accelerator is found",),
        marks=[NO_ACCELERATOR, WORKERS, ACCELERATOR_API],
    ),
    Case(
        "pin_memory_on_mps",
        pin_on_mps(),
        UserWarning,
        ("'pin_memory' argument is set as true but not supported on MPS now",),
        marks=[NO_ACCELERATOR, ACCELERATOR_API],
    ),
    Case(
        "pin_memory_on_mps_with_workers",
        pin_on_mps(num_workers=1, multiprocessing_context="fork"),
        UserWarning,
        ("'pin_memory' argument is set as true but not supported on MPS now",),
        marks=[NO_ACCELERATOR, WORKERS, ACCELERATOR_API],
    ),
    Case(
        "pin_memory_device_deprecated",
        lambda m: first_batch(m, pin_memory=True, pin_memory_device="cuda"),
        UserWarning,
        ("pin_memory_device is deprecated, the current accelerator will be used as the device",),
        marks=[ACCELERATOR_API],
    ),
]

WORKER_FAILURES = [
    Case(
        "worker_timeout",
        lambda m: first_batch(
            m, ds.Slow(2, 1.5), num_workers=1, timeout=1, multiprocessing_context="fork"
        ),
        RuntimeError,
        ("DataLoader timed out after 1 seconds",),
        marks=[WORKERS],
    ),
    Case(
        "worker_timeout_fractional",
        lambda m: first_batch(
            m, ds.Slow(2, 1.0), num_workers=1, timeout=0.5, multiprocessing_context="fork"
        ),
        RuntimeError,
        (r"DataLoader timed out after 0\.5 seconds",),
        marks=[WORKERS],
    ),
    *(
        Case(
            f"worker_{how}",
            lambda m, how=how: first_batch(
                m, ds.DieAt(4, 0, how), num_workers=1, multiprocessing_context="fork"
            ),
            RuntimeError,
            (r"DataLoader worker \(pid\(s\) \d+\) exited unexpectedly",),
            marks=[WORKERS],
        )
        for how in ("kill", "exit")
    ),
    *(
        Case(
            f"unpicklable_dataset_{context}",
            unpicklable_dataset(context),
            AttributeError,
            # (Python's own words: "get" on 3.13)
            (r"Can't (pickle|get) local object 'HoldsLambda.__init__.<locals>.<lambda>'",),
            marks=[WORKERS],
        )
        for context in ("spawn", "forkserver")
    ),
    *(
        Case(
            f"unpicklable_dataset_{context}_warning",
            warns_then_raises(unpicklable_dataset(context)),
            UserWarning,
            ("Got pickle error when attempting to start a worker Process",),
            marks=[WORKERS, needs_torch("2.13", "this warning")],
        )
        for context in ("spawn", "forkserver")
    ),
    Case(
        "exception_in_worker",
        lambda m: list(loader(m, ds.FailAt(4, 1), num_workers=1, multiprocessing_context="fork")),
        ds.Boom,
        ("boom at index 1",),
        marks=[WORKERS],
    ),
    # torch replaces the worker's exception by a new one whose message starts "Caught Boom in
    # DataLoader worker process 0"; ferry raises the original object (its arguments and
    # attributes intact) and puts that phrase in its first note, which pytest.raises(match=)
    # searches too. See ferry/errors.py.
    Case(
        "exception_in_worker_caught_phrase",
        lambda m: list(loader(m, ds.FailAt(4, 1), num_workers=1, multiprocessing_context="fork")),
        ds.Boom,
        ("Caught Boom in DataLoader worker process 0",),
        marks=[WORKERS],
        with_notes=True,
    ),
    *(
        Case(
            f"exception_in_worker_{label}",
            trigger,
            expected,
            (rf"Caught {caught} in DataLoader worker process {worker}",),
            marks=[WORKERS],
            with_notes=True,
        )
        for label, trigger, expected, caught, worker in [
            ("second_worker", fails_in_worker(ds.FailAt(4, 1), num_workers=2), ds.Boom, "Boom", 1),
            ("init_fn", fails_in_worker(worker_init_fn=ds.failing_init), ds.Boom, "Boom", 0),
            ("collate_fn", fails_in_worker(collate_fn=ds.failing_collate), ds.Boom, "Boom", 0),
            ("stream_iter", fails_in_worker(ds.FailingStream(None)), ds.Boom, "Boom", 0),
            ("key_error", fails_in_worker(ds.FailAt(4, 1, "key")), KeyError, "KeyError", 0),
            # An exception that cannot be rebuilt from a message: torch raises RuntimeError.
            (
                "not_rebuildable",
                fails_in_worker(ds.FailAt(4, 1, "two-args")),
                RuntimeError,
                "NeedsTwoArgs",
                0,
            ),
        ]
    ),
]


@pytest.mark.parametrize("case", params(OPTIONS))
def test_option_errors(case: Case) -> None:
    check(case)


@pytest.mark.parametrize(
    "workers",
    [0.0, -0.0, np.float64(0), np.float32(0), False, np.False_, torch.tensor(0.0)],
    ids=["float", "minus-zero", "numpy-float64", "numpy-float32", "False", "numpy-False", "tensor"],
)
def test_a_count_of_workers_that_equals_0_loads_in_the_main_process_as_in_torch(
    workers: Any,
) -> None:
    """torch only compares num_workers with 0 in its constructor: ``0.0`` (a float from a
    config file) loads in the main process there, and in ferry."""
    theirs = [b.tolist() for b in loader(torch.utils.data, num_workers=workers, batch_size=3)]
    ours = ferry.DataLoader(DATA, num_workers=workers, batch_size=3)
    assert [b.tolist() for b in ours] == theirs
    assert ours.num_workers == 0


# torch's iterator, whose __init__ failed at range(), fails again in __del__ (no _shutdown yet).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("workers", [1.5, 2.0, float("nan"), float("inf"), np.True_])
def test_a_count_of_workers_that_is_not_an_integer_is_refused_at_once(workers: Any) -> None:
    """torch takes it in its constructor and fails with a TypeError at iter() (range(2.0));
    ferry raises that TypeError in the constructor, naming the option."""
    with pytest.raises(TypeError):
        list(loader(torch.utils.data, num_workers=workers))
    with pytest.raises(TypeError, match=r'num_workers must be an integer or "auto", got'):
        ferry.DataLoader(DATA, num_workers=workers)


@pytest.mark.parametrize("case", params(ITERATION))
def test_iteration_errors(case: Case) -> None:
    check(case)


@pytest.mark.parametrize("case", params(WARNINGS))
def test_warnings(case: Case) -> None:
    check(case)


@pytest.mark.parametrize("case", params(WORKER_FAILURES))
@pytest.mark.slow
def test_worker_failures(case: Case) -> None:
    check(case)


def test_too_many_thread_workers_says_what_is_true_of_threads() -> None:
    """Thread workers (ferry only) keep torch's phrase, and say that threads waiting on I/O are
    not bound by the CPU count."""
    import ferry

    with cpus({0}, 8), pytest.warns(UserWarning, match="worker threads in total") as caught:
        ferry.DataLoader(range(4), num_workers=2, worker_type="thread")
    (message,) = [str(w.message) for w in caught]
    assert "This DataLoader will create 2 worker threads in total" in message
    assert "excessive worker creation might get DataLoader running slow or even freeze" in message
    assert "Threads that wait on I/O (network, object stores) are not bound by the CPU" in message


def _warned(build: Any, epochs: int) -> list[str]:
    """The start of each warning while a loader built by ``build`` runs ``epochs`` epochs."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # (Python >= 3.12 warns at a fork while the process has other threads: not the point)
        warnings.simplefilter("ignore", DeprecationWarning)
        loader = build()
        for _ in range(epochs):
            for _ in loader:
                pass
    return [str(w.message)[:40] for w in caught]


@NO_ACCELERATOR
@ACCELERATOR_API
def test_pinning_warnings_come_with_each_new_iterator_in_torchs_order() -> None:
    import ferry

    def build(module: Any) -> Any:
        return lambda: module.DataLoader(range(4), pin_memory=True, pin_memory_device="cuda")

    expected = _warned(build(torch.utils.data), epochs=2)
    assert len(expected) == 4
    assert _warned(build(ferry), epochs=2) == expected


@WORKERS
def test_too_many_workers_is_checked_again_by_each_new_iterator() -> None:
    """torch checks when the loader is built and when an iterator with workers is made, so a
    ``num_workers`` raised later warns too; a persistent iterator's next epoch does not."""
    import ferry

    def build(module: Any, **options: Any) -> Any:
        def made() -> Any:
            made_loader = module.DataLoader(range(4), num_workers=1, **options)
            made_loader.num_workers = 2
            return made_loader

        return made

    for options in ({"multiprocessing_context": "fork"}, {"persistent_workers": True}):
        with cpus({0}, 8):
            expected = _warned(build(torch.utils.data, **options), epochs=2)
            got = _warned(build(ferry, **options), epochs=2)
        assert got == expected, options
        assert len(got) == (1 if "persistent_workers" in options else 2)
