"""ferry's classes are torch's types, but none of torch's code runs on them.

Each public class of ferry with a counterpart in ``torch.utils.data`` subclasses it, so every
``isinstance`` check in the ecosystem accepts ferry's objects. The subclassing is for the type
only:

* statically: every attribute (public or private) that torch's classes define must be defined
  again by ferry's class, not inherited, unless :data:`HARMLESS` lists it with its reason;
* on instances: the attributes that torch's constructors set (which libraries read, such as
  ``loader._dataset_kind``) exist on ferry's objects too;
* at run time: a workload that touches every class (every sampler, wrapper, the loader in the
  main process and in thread workers, persistent workers, ``loader._iterator = None``) runs
  under a profiler that fails on any call into a file of ``torch/utils/data``.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import psutil
import pytest
import torch
import torch.utils.data as tud
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

import ferry
from ferry._engine.iterator import InlineIterator
from ferry._engine.pool import WorkerIterator
from ferry.distributed import DistributedSampler

PAIRS: dict[str, tuple[type, type]] = {
    name: (getattr(ferry, name), getattr(tud, name))
    for name in (
        "BatchSampler",
        "ChainDataset",
        "ConcatDataset",
        "DataLoader",
        "Dataset",
        "IterableDataset",
        "RandomSampler",
        "Sampler",
        "SequentialSampler",
        "StackDataset",
        "Subset",
        "SubsetRandomSampler",
        "TensorDataset",
        "WeightedRandomSampler",
    )
}
PAIRS["DistributedSampler"] = (DistributedSampler, TorchDistributedSampler)
# What iter(loader) returns is torch's _BaseDataLoaderIter (Lightning's CombinedLoader tests it).
PAIRS["InlineIterator"] = (InlineIterator, tud.dataloader._BaseDataLoaderIter)
PAIRS["WorkerIterator"] = (WorkerIterator, tud.dataloader._BaseDataLoaderIter)

# Class-body entries that are bookkeeping of Python itself, not behaviour.
_PYTHON_OWN = {
    "__module__",
    "__qualname__",
    "__doc__",
    "__dict__",
    "__weakref__",
    "__parameters__",
    "__orig_bases__",
    "__annotations__",
    "__annotate__",
    "__annotate_func__",
    "__annotations_cache__",
    "__abstractmethods__",
    "_abc_impl",
    "__slots__",
    "__static_attributes__",
    "__firstlineno__",
    "_is_protocol",
    "__slotnames__",  # copyreg's cache, written on a class the first time one is pickled
}

# Attributes a ferry class may inherit from torch's, each with the reason it is harmless.
# torch 2.13 needs none: every attribute its classes define, ferry's define again.
HARMLESS: dict[tuple[str, str], str] = {}

# torch objects ferry makes, used as plain records of their attributes, each with its reason.
# Code that iterates one directly (the user's) runs torch's code on a torch object; ferry's own
# engine reads their attributes only (test_the_engine_runs_no_torch_code_on_records).
RECORDS: dict[type, str] = {
    tud.BatchSampler: (
        "ferry.BatchSampler(...) and the loader's automatic batch sampler are of torch's exact "
        "class: Lightning and Fabric test `type(batch_sampler) is BatchSampler` before they "
        "inject a DistributedSampler, and take the custom batch sampler path otherwise"
    ),
}

TORCH_DATA_DIR = str(Path(tud.__file__).resolve().parent) + os.sep


def _torch_classes(torch_class: type) -> list[type]:
    return [c for c in torch_class.__mro__ if c.__module__.startswith("torch.utils.data")]


def _owner(cls: type, name: str) -> type:
    return next(c for c in cls.__mro__ if name in vars(c))


def _is_objects_own(owner: type, name: str) -> bool:
    """Whether ``owner`` merely holds ``object``'s own slot under ``name``.

    Lightning patches ``__setattr__``/``__delattr__`` onto torch's DataLoader and BatchSampler
    while it builds loaders, and on the way out writes back what it found, ``object``'s, into
    the class's own dictionary. That runs no torch code.
    """
    return vars(owner)[name] is getattr(object, name, None)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_is_a_subclass_of_torchs_class(name: str) -> None:
    ferry_class, torch_class = PAIRS[name]
    assert issubclass(ferry_class, torch_class)
    # ferry's own code comes first in the method resolution order.
    order = ferry_class.__mro__
    assert order.index(torch_class) > max(
        i for i, c in enumerate(order) if c.__module__.startswith("ferry")
    )


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_defines_every_attribute_torchs_class_defines(name: str) -> None:
    ferry_class, torch_class = PAIRS[name]
    inherited = []
    for base in _torch_classes(torch_class):
        for attribute in vars(base):
            if attribute in _PYTHON_OWN or (name, attribute) in HARMLESS:
                continue
            owner = _owner(ferry_class, attribute)
            if owner.__module__.startswith("ferry") or _is_objects_own(owner, attribute):
                continue
            inherited.append(f"{attribute} (from {owner.__module__}.{owner.__qualname__})")
    assert inherited == [], f"ferry.{name} runs torch's code for: {inherited}"


def test_the_check_above_can_fail() -> None:
    class Lazy(ferry.Dataset[int], tud.TensorDataset):  # forgets __len__ and __init__
        def __getitem__(self, index: int) -> int:
            return index

    inherited = [a for a in vars(tud.TensorDataset) if _owner(Lazy, a).__module__ != __name__]
    assert {"__init__", "__len__"} <= set(inherited)


def test_harmless_entries_are_still_needed() -> None:
    for name, attribute in HARMLESS:
        ferry_class, torch_class = PAIRS[name]
        assert any(attribute in vars(c) for c in _torch_classes(torch_class)), (name, attribute)
        assert not _owner(ferry_class, attribute).__module__.startswith("ferry"), (name, attribute)


# -- instance attributes ---------------------------------------------------------------------


class _MyBatchSampler(ferry.BatchSampler):
    """A custom batch sampler: a ferry object, not a record."""


def _both(name: str, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    ferry_class, torch_class = PAIRS[name]
    return ferry_class(*args, **kwargs), torch_class(*args, **kwargs)


def _instances() -> Iterator[tuple[str, Any, Any]]:
    x = torch.arange(12.0).view(6, 2)
    data = ferry.TensorDataset(x)
    yield "TensorDataset", *_both("TensorDataset", x)
    yield "Subset", *_both("Subset", data, [0, 2])
    yield "ConcatDataset", *_both("ConcatDataset", [data, data])
    yield "StackDataset", *_both("StackDataset", data, data)
    yield "ChainDataset", *_both("ChainDataset", [])
    yield "SequentialSampler", *_both("SequentialSampler", data)
    yield "RandomSampler", *_both("RandomSampler", data, num_samples=3)
    yield "SubsetRandomSampler", *_both("SubsetRandomSampler", [1, 2])
    yield "WeightedRandomSampler", *_both("WeightedRandomSampler", [0.5, 0.5], 4)
    yield "BatchSampler", *_both("BatchSampler", range(5), 2, False)
    yield (
        "BatchSampler subclass",
        _MyBatchSampler(range(5), 2, False),
        tud.BatchSampler(range(5), 2, False),
    )
    yield "DistributedSampler", *_both("DistributedSampler", data, num_replicas=2, rank=1)
    for kwargs in (
        {"batch_size": 2, "shuffle": True},
        {"batch_size": None},
        {"num_workers": 2, "persistent_workers": True, "multiprocessing_context": "spawn"},
    ):
        yield "DataLoader", *_both("DataLoader", data, **kwargs)


@pytest.mark.parametrize(
    ("name", "ferry_object", "torch_object"),
    list(_instances()),
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_has_the_instance_attributes_torch_sets(
    name: str, ferry_object: Any, torch_object: Any
) -> None:
    missing = [a for a in vars(torch_object) if not hasattr(ferry_object, a)]
    assert missing == [], f"ferry.{name} lacks {missing}"


def test_loader_attributes_read_as_torchs() -> None:
    x = torch.arange(12.0).view(6, 2)
    for kwargs in ({"batch_size": 4, "shuffle": True}, {"batch_size": None}):
        ferry_loader, torch_loader = _both("DataLoader", ferry.TensorDataset(x), **kwargs)
        for attribute in ("_dataset_kind", "_IterableDataset_len_called", "_iterator"):
            assert getattr(ferry_loader, attribute) == getattr(torch_loader, attribute)
        assert ferry_loader._DataLoader__initialized is True  # type: ignore[attr-defined]
        assert ferry_loader._auto_collation == torch_loader._auto_collation
    stream = ferry.DataLoader(_Stream(), batch_size=2)
    assert stream._dataset_kind == 1
    assert len(stream) == 3
    assert stream._IterableDataset_len_called == 5


# -- no torch code runs ------------------------------------------------------------------------


def test_batch_sampler_gives_a_record_of_torchs_class() -> None:
    record = ferry.BatchSampler(range(7), 3, drop_last=False)
    assert type(record) is tud.BatchSampler
    assert isinstance(record, ferry.BatchSampler)
    assert (record.batch_size, record.drop_last) == (3, False)
    loader = ferry.DataLoader(ferry.TensorDataset(torch.arange(7.0)), batch_size=3)
    assert type(loader.batch_sampler) is tud.BatchSampler
    assert type(_MyBatchSampler(range(7), 3, False)) is _MyBatchSampler
    assert not isinstance(tud.SequentialSampler(range(3)), ferry.BatchSampler)
    with pytest.raises(ValueError, match="batch_size should be a positive integer value"):
        ferry.BatchSampler(range(7), 0, drop_last=False)


class _Stream(ferry.IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(5))

    def __len__(self) -> int:
        return 5


class _Squares(ferry.Dataset[int]):
    def __getitem__(self, index: int) -> int:
        return index * index

    def __len__(self) -> int:
        return 7


def _workload() -> None:
    """Touches every class and the loader's attributes as libraries do."""
    x = torch.arange(40.0).view(20, 2)
    data = ferry.TensorDataset(x, torch.arange(20))
    parts = ferry.random_split(data, [0.5, 0.5], generator=torch.Generator().manual_seed(0))
    joined = parts[0] + parts[1]
    assert isinstance(joined, ferry.ConcatDataset)
    squares = _Squares() + _Squares()
    assert len(squares) == 14
    assert squares[13] == 36
    stacked = ferry.StackDataset(a=data, b=data)
    chained = _Stream() + _Stream()
    assert isinstance(chained, ferry.ChainDataset)
    assert list(chained) == [*range(5), *range(5)]
    assert len(chained) == 10
    samplers: list[Any] = [
        ferry.SequentialSampler(data),
        ferry.RandomSampler(data, generator=torch.Generator().manual_seed(1)),
        ferry.RandomSampler(data, replacement=True, num_samples=50),
        ferry.SubsetRandomSampler([1, 3, 5]),
        ferry.WeightedRandomSampler([1.0] * 20, 10),
        DistributedSampler(data, num_replicas=2, rank=0, seed=3),
    ]
    for sampler in samplers:
        assert len(list(sampler)) == len(sampler)
    batches = ferry.BatchSampler(samplers[1], 3, drop_last=True)
    assert len(list(batches)) == len(batches) == 6
    samplers[-1].set_epoch(1)
    for dataset in (data, parts[0], joined, stacked, squares):
        for kwargs in (
            {"batch_size": 4, "shuffle": True},
            {"batch_size": None},
            {"batch_size": 3, "num_workers": 2, "worker_type": "thread"},
        ):
            loader = ferry.DataLoader(dataset, **kwargs)
            assert len(list(loader)) == len(loader)
    for kwargs in ({"batch_size": 2}, {"batch_size": 2, "num_workers": 1, "worker_type": "thread"}):
        assert len(list(ferry.DataLoader(chained, **kwargs))) == 5
    persistent = ferry.DataLoader(
        data, batch_size=5, num_workers=2, worker_type="thread", persistent_workers=True
    )
    for _ in range(2):
        assert len(list(persistent)) == 4
    assert persistent._iterator is not None
    persistent._iterator = None
    loader = ferry.DataLoader(data, batch_size=5, sampler=samplers[0])
    assert loader.multiprocessing_context is None
    with pytest.raises(ValueError, match="should not be set after"):
        loader.batch_size = 3
    loader.num_workers = 0
    assert (loader._dataset_kind, loader._auto_collation) == (0, True)
    assert loader._index_sampler is loader.batch_sampler
    loader.check_worker_number_rationality()


def _loader_workload() -> None:
    """The loader over every kind of batch sampler, records included: ferry's engine batches a
    record itself, so not even a record's torch code runs."""
    data = ferry.TensorDataset(torch.arange(20.0))
    for batch_sampler in (
        ferry.BatchSampler(ferry.SequentialSampler(data), 3, False),
        TORCH_BATCH_SAMPLER,
        _MyBatchSampler(ferry.RandomSampler(data), 4, True),
    ):
        for kwargs in ({}, {"num_workers": 2, "worker_type": "thread"}):
            loader = ferry.DataLoader(data, batch_sampler=batch_sampler, **kwargs)
            assert len(list(loader)) == len(loader)
    for kwargs in (
        {"batch_size": 4, "shuffle": True},
        {"batch_size": 3, "drop_last": True, "num_workers": 2, "worker_type": "thread"},
    ):
        loader = ferry.DataLoader(data, **kwargs)
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        again = ferry.DataLoader(data, **kwargs)
        again.load_state_dict(state)
        assert len(list(again)) == len(loader) - 1


# Made by torch's constructor (torch's code, on torch's object) before any profiling.
TORCH_BATCH_SAMPLER = tud.BatchSampler(range(20), 6, drop_last=False)


def _calls_into_torch_data(workload: Any, records: bool = False) -> list[str]:
    """The calls into torch.utils.data while ``workload`` runs; with ``records``, not those
    on a :data:`RECORDS` object."""
    seen: list[str] = []

    def on_a_record(frame: FrameType | None) -> bool:
        # A comprehension in a record's method has a frame of its own (torch < 2.9's
        # BatchSampler.__iter__ has one, on Python < 3.12): the method's frame has the self.
        while frame is not None and frame.f_code.co_filename.startswith(TORCH_DATA_DIR):
            if type(frame.f_locals.get("self")) in RECORDS:
                return True
            if not frame.f_code.co_name.startswith("<"):
                return False
            frame = frame.f_back
        return False

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(TORCH_DATA_DIR):
            if records and on_a_record(frame):
                return
            code = frame.f_code
            name = getattr(code, "co_qualname", None)
            if name is None:  # (Python 3.10: the class from the frame's self)
                owner = frame.f_locals.get("self")
                name = (
                    f"{type(owner).__name__}.{code.co_name}" if owner is not None else code.co_name
                )
            seen.append(f"{name} ({code.co_filename})")

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        workload()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return seen


@pytest.mark.timeout(60)
def test_no_torch_data_code_runs_on_ferry_objects() -> None:
    assert _calls_into_torch_data(_workload, records=True) == []


@pytest.mark.timeout(60)
def test_the_engine_runs_no_torch_code_on_records() -> None:
    assert _calls_into_torch_data(_loader_workload) == []


@pytest.mark.timeout(60)
def test_records_are_let_through_only_where_listed() -> None:
    calls = _calls_into_torch_data(lambda: list(ferry.BatchSampler(range(5), 2, False)))
    assert any("BatchSampler.__iter__" in c for c in calls)
    assert _calls_into_torch_data(lambda: list(ferry.BatchSampler(range(5), 2, False)), True) == []


@pytest.mark.timeout(60)
def test_the_profiler_sees_torch_code() -> None:
    def touch_torch() -> None:
        list(tud.DataLoader(range(3), batch_size=2))

    calls = _calls_into_torch_data(touch_torch)
    assert any("DataLoader.__init__" in c for c in calls)


def test_signature_helpers_do_not_run_torch_code() -> None:
    # Lightning and accelerate read the signature of the loader's __init__ to rebuild it.
    parameters = inspect.signature(ferry.DataLoader.__init__).parameters
    assert "worker_type" in parameters


# -- the loader's attributes, as libraries use them --------------------------------------------

_OPTIONS = {
    "dataset": ferry.TensorDataset(torch.arange(6.0)),
    "batch_size": 3,
    "sampler": [0, 1],
    "batch_sampler": [[0]],
    "drop_last": True,
    "persistent_workers": True,
    "num_workers": 1,
    "pin_memory": False,
    "timeout": 2,
    "collate_fn": list,
    "worker_init_fn": print,
    "generator": torch.Generator(),
    "prefetch_factor": 3,
    "in_order": False,
    "pin_memory_device": "",
    "multiprocessing_context": "spawn",
}


@pytest.mark.parametrize("option", sorted(_OPTIONS))
def test_options_are_settable_or_frozen_as_in_torch(option: str) -> None:
    def outcome(module: Any) -> str:
        loader = module.DataLoader(module.TensorDataset(torch.arange(6.0)), num_workers=1)
        try:
            setattr(loader, option, _OPTIONS[option])
        except Exception as exc:
            return type(exc).__name__
        return "set"

    assert outcome(ferry) == outcome(tud)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_setting_iterator_to_none_stops_persistent_workers(worker_type: str) -> None:
    loader = ferry.DataLoader(
        ferry.TensorDataset(torch.arange(8.0)),
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
        worker_type=worker_type,
    )
    assert len(list(loader)) == 4
    kept = loader._iterator
    assert kept is not None
    workers = list(kept._workers)  # type: ignore[attr-defined]
    loader._iterator = None  # what Lightning does between stages
    assert loader._iterator is None
    for worker in workers:
        if worker_type == "thread":
            worker.thread.join(5)
            assert not worker.thread.is_alive()
        else:  # stopped, reaped and closed by the shutdown
            assert not psutil.pid_exists(worker.pid)
    assert len(list(loader)) == 4  # the next epoch starts new workers
    assert loader._iterator is not kept
    loader._iterator = None


# -- the other direction: ferry's names accept torch's objects -----------------------------------

# Every public class of ferry with a counterpart in torch.utils.data (the iterators are not public).
PUBLIC_PAIRS = {name: pair for name, pair in PAIRS.items() if not name.endswith("Iterator")}


def _torch_objects() -> dict[str, Any]:
    """One object of each public torch class, made by torch (as libraries make them)."""
    x = torch.arange(12.0).view(6, 2)
    data = tud.TensorDataset(x)

    class Stream(tud.IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(3))

    return {
        "BatchSampler": tud.BatchSampler(range(5), 2, False),
        "ChainDataset": tud.ChainDataset([]),
        "ConcatDataset": tud.ConcatDataset([data, data]),
        "DataLoader": tud.DataLoader(data, batch_size=2),
        "Dataset": tud.Subset(data, [0]),
        "DistributedSampler": TorchDistributedSampler(data, num_replicas=2, rank=0),
        "IterableDataset": Stream(),
        "RandomSampler": tud.RandomSampler(data),
        "Sampler": tud.SequentialSampler(data),
        "SequentialSampler": tud.SequentialSampler(data),
        "StackDataset": tud.StackDataset(data, data),
        "Subset": tud.Subset(data, [0, 2]),
        "SubsetRandomSampler": tud.SubsetRandomSampler([1, 2]),
        "TensorDataset": data,
        "WeightedRandomSampler": tud.WeightedRandomSampler([0.5, 0.5], 4),
    }


def test_every_public_class_with_a_torch_counterpart_is_paired() -> None:
    torch_names = {n for n in dir(tud) if isinstance(getattr(tud, n), type)}
    public = {n for n in ferry.__all__ if isinstance(getattr(ferry, n), type)}
    assert {n for n in public if n in torch_names} | {"DistributedSampler"} == set(PUBLIC_PAIRS)
    assert set(_torch_objects()) == set(PUBLIC_PAIRS)


@pytest.mark.parametrize("name", sorted(PUBLIC_PAIRS))
def test_ferrys_name_accepts_torchs_objects_and_classes(name: str) -> None:
    """A program that imports the name from ferry sees the objects libraries make from torch's
    classes (Lightning's DistributedSampler, accelerate's loaders, HF's IterableDataset) as it
    did: ``isinstance``/``issubclass`` hold both ways, for instances and subclasses."""
    ferry_class, torch_class = PUBLIC_PAIRS[name]
    torch_object = _torch_objects()[name]
    assert isinstance(torch_object, ferry_class)
    assert issubclass(torch_class, ferry_class)
    assert issubclass(type("Library", (torch_class,), {}), ferry_class)
    # and what was true before still is: ferry's classes are torch's
    assert issubclass(ferry_class, torch_class)
    assert issubclass(type("Users", (ferry_class,), {}), torch_class)
    # nothing of ferry's is in a torch object's class
    assert not any(c.__module__.startswith("ferry") for c in type(torch_object).__mro__)


def test_only_what_torchs_name_accepts_is_accepted() -> None:
    data = tud.TensorDataset(torch.arange(4.0))
    assert not isinstance(tud.RandomSampler(data), ferry.SequentialSampler)
    assert not isinstance(data, ferry.IterableDataset)
    assert not issubclass(tud.Dataset, ferry.IterableDataset)
    assert not isinstance(object(), ferry.Dataset)
    assert not isinstance(range(3), ferry.Sampler)
    # (torch's IterableDataset is an ABC whose check asks its subclasses: no recursion)
    assert not issubclass(int, ferry.IterableDataset)
    assert not issubclass(int, tud.IterableDataset)

    # A user's subclass of a ferry class is exact: torch's objects are not of it.
    class Mine(ferry.SequentialSampler):
        pass

    assert not isinstance(tud.SequentialSampler(data), Mine)
    assert not issubclass(tud.SequentialSampler, Mine)
    assert isinstance(Mine(data), tud.SequentialSampler)
    assert isinstance(Mine(data), ferry.SequentialSampler)


def test_subclasses_mix_as_with_torchs_classes() -> None:
    """ferry's classes are ABCs (as torch's IterableDataset is): abc.ABC, collections.abc
    and Protocol classes mix in, Generic subscripting works, objects pickle."""
    import abc
    import pickle
    from collections.abc import Sequence
    from typing import Protocol

    class Base(ferry.Dataset[int], abc.ABC):
        @abc.abstractmethod
        def load(self) -> int: ...

    class Rows(ferry.Dataset[int], Sequence[int]):
        def __getitem__(self, index: Any) -> Any:
            return [0, 1, 2][index]

        def __len__(self) -> int:
            return 3

    class Sized(Protocol):
        def __len__(self) -> int: ...

    class Described(ferry.Sampler[int], Sized):
        def __iter__(self) -> Iterator[int]:
            return iter(range(2))

        def __len__(self) -> int:
            return 2

    with pytest.raises(TypeError, match="abstract"):
        Base()  # type: ignore[abstract]
    assert list(Rows()) == [0, 1, 2]
    assert list(Described()) == [0, 1]
    assert ferry.Dataset[int].__origin__ is ferry.Dataset  # type: ignore[attr-defined]
    again = pickle.loads(pickle.dumps(ferry.TensorDataset(torch.arange(3.0))))
    assert type(again) is ferry.TensorDataset
    assert torch.equal(again.tensors[0], torch.arange(3.0))


def test_ferrys_own_checks_stay_exact() -> None:
    """Where ferry reads its own attributes or relies on its own code, a torch object is not
    taken for a ferry one (it is run as torch's object, with torch's sequence)."""
    from ferry._sampler_keys import index_batches, index_chunks, is_builtin_sampler
    from ferry._torch_types import is_ferry_instance
    from ferry.datasets import tensor_gather

    data = tud.TensorDataset(torch.arange(10.0))
    for sampler in (
        tud.SequentialSampler(data),
        tud.RandomSampler(data),
        tud.SubsetRandomSampler([1, 2]),
        tud.WeightedRandomSampler([1.0] * 10, 4),
        TorchDistributedSampler(data, num_replicas=2, rank=0),
    ):
        assert not is_builtin_sampler(sampler)
        assert index_chunks(sampler) is None
    assert not is_ferry_instance(tud.SequentialSampler(data), ferry.SequentialSampler)
    assert is_ferry_instance(ferry.SequentialSampler(data), ferry.SequentialSampler)
    assert index_batches(_TorchBatches(tud.SequentialSampler(data), 3, False)) is None
    assert tensor_gather(data) is None
    assert tensor_gather(tud.Subset(ferry.TensorDataset(torch.arange(4.0)), [1])) is None
    assert tensor_gather(ferry.TensorDataset(torch.arange(4.0))) is not None
    # The loader runs torch's samplers as torch's loader does.
    for make in (
        lambda: tud.RandomSampler(data, generator=torch.Generator().manual_seed(5)),
        lambda: tud.WeightedRandomSampler(
            [1.0] * 10, 6, generator=torch.Generator().manual_seed(5)
        ),
    ):
        got = [b[0].tolist() for b in ferry.DataLoader(data, batch_size=4, sampler=make())]
        want = [b[0].tolist() for b in tud.DataLoader(data, batch_size=4, sampler=make())]
        assert got == want


class _TorchBatches(tud.BatchSampler):
    """A library's batch sampler: torch's, by subclass (not a record of the exact class)."""


def test_a_stream_loaders_sampler_is_of_torchs_class() -> None:
    """torch gives an iterable-style dataset's loader an ``_InfiniteConstantSampler``, which
    code tests (torchdata's StatefulDataLoader does); ferry's is one too."""
    from torch.utils.data.dataloader import _InfiniteConstantSampler

    class Stream(ferry.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter(range(3))

    loader = ferry.DataLoader(Stream(), batch_size=2)
    assert isinstance(loader.sampler, _InfiniteConstantSampler)
    assert isinstance(loader.batch_sampler.sampler, _InfiniteConstantSampler)
    assert [b.tolist() for b in loader] == [[0, 1], [2]]
