"""DataLoader options, validation, length, warnings and life cycle against torch's DataLoader
(num_workers=0; worker loading is tested under tests/workers/)."""

from __future__ import annotations

import copy
import inspect
import multiprocessing
import os
import pickle
import warnings
from collections.abc import Callable
from typing import Any

try:
    import numpy as np
except ImportError:  # the run without numpy (make test-nonumpy): no numpy scalars as options
    np = None  # type: ignore[assignment]
import pytest
import torch
import torch.utils.data as tud

import ferry
from _support.compare import (
    MODULES,
    Raised,
    assert_same,
    assert_same_outcome,
    differential,
    map_dataset,
    outcome,
    stable_id,
    stream_dataset,
)
from _support.torch_versions import needs_torch
from ferry._engine.transport.pin import accelerator_available

pytestmark = pytest.mark.usefixtures("guard_global_state")

X = torch.arange(20, dtype=torch.float32).view(10, 2)
Y = torch.arange(10)


def _params(fn: Any) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# -- signature -----------------------------------------------------------------------------------


@needs_torch("2.6", "DataLoader(in_order=)")
def test_signature_is_torchs_plus_keyword_only_extensions() -> None:
    expected = _params(tud.DataLoader)
    got = _params(ferry.DataLoader)
    assert got[:-8] == expected
    # ferry's thread workers, torchdata StatefulDataLoader's option (same default), the
    # failure options and balanced workers, whose defaults keep torch's behaviour, and moved
    # workers (the same batches from the same workers: only where they run changes).
    keyword = inspect.Parameter.KEYWORD_ONLY
    assert got[-8:] == [
        ("worker_type", keyword, "process"),
        ("snapshot_every_n_steps", keyword, 1),
        ("on_error", keyword, "raise"),
        ("max_errors", keyword, None),
        ("max_worker_restarts", keyword, 0),
        ("stall_warning", keyword, 300.0),
        ("balance_workers", keyword, False),
        ("move_workers", keyword, None),
    ]


@needs_torch("2.6", "DataLoader(in_order=)")
def test_defaults_are_torchs() -> None:
    expected, got = tud.DataLoader(range(3)), ferry.DataLoader(range(3))
    for attr in (
        "batch_size",
        "num_workers",
        "pin_memory",
        "drop_last",
        "timeout",
        "worker_init_fn",
        "multiprocessing_context",
        "generator",
        "prefetch_factor",
        "persistent_workers",
        "pin_memory_device",
        "in_order",
    ):
        assert_same(getattr(expected, attr), getattr(got, attr), attr)
    assert got.worker_type == "process"
    assert got.collate_fn is ferry.default_collate
    assert ferry.DataLoader(range(3), batch_size=None).collate_fn is ferry.default_convert
    assert type(got.sampler) is ferry.SequentialSampler
    # torch's exact class, as a record (Lightning tests the type; see ferry.BatchSampler)
    assert type(got.batch_sampler) is type(expected.batch_sampler)
    assert isinstance(got.batch_sampler, ferry.BatchSampler)
    assert type(ferry.DataLoader(range(3), shuffle=True).sampler) is ferry.RandomSampler
    assert ferry.DataLoader(range(3), num_workers=1).prefetch_factor == 2


def test_public_attributes_and_methods_of_torchs_loader_exist() -> None:
    expected = {n for n in dir(tud.DataLoader(range(3))) if not n.startswith("_")}
    got = set(dir(ferry.DataLoader(range(3))))
    assert expected - got == set()


def test_positional_arguments_land_where_torchs_do() -> None:
    generator = torch.Generator()
    args = (range(6), 2, None, None, None, 0, None, False, True, 0, None, None, generator)
    for module in MODULES:
        loader = module.DataLoader(*args)
        assert loader.batch_size == 2
        assert loader.drop_last is True
        assert loader.generator is generator


@needs_torch("2.6", "DataLoader(in_order=)")
def test_loader_attributes_match_torch() -> None:
    def build(m: Any) -> Any:
        return m.DataLoader(
            range(9), batch_size=4, shuffle=True, drop_last=True, timeout=2.5, in_order=False
        )

    expected, got = build(tud), build(ferry)
    for attr in ("batch_size", "drop_last", "timeout", "in_order", "pin_memory_device"):
        assert getattr(expected, attr) == getattr(got, attr)
    assert got.batch_sampler.batch_size == 4
    assert got.batch_sampler.drop_last is True
    assert got.batch_sampler.sampler is got.sampler


# -- invalid combinations ------------------------------------------------------------------------


def _stream(module: Any) -> Any:
    return stream_dataset(module, [1, 2, 3], 3)


def _range4(module: Any) -> Any:
    return range(4)


INVALID: dict[str, tuple[Callable[[Any], Any], dict[str, Any], str]] = {
    "num_workers=-1": (_range4, {"num_workers": -1}, "num_workers"),
    "num_workers='2'": (_range4, {"num_workers": "2"}, "num_workers"),
    "timeout=-1": (_range4, {"timeout": -1}, "timeout"),
    "timeout='1'": (_range4, {"timeout": "1"}, "timeout"),
    "prefetch_factor without workers": (
        _range4,
        {"prefetch_factor": 2},
        "prefetch_factor",
    ),
    "prefetch_factor=-1": (
        _range4,
        {"num_workers": 1, "prefetch_factor": -1},
        "prefetch_factor",
    ),
    "prefetch_factor='2'": (
        _range4,
        {"num_workers": 1, "prefetch_factor": "2"},
        "prefetch_factor",
    ),
    "persistent_workers without workers": (
        _range4,
        {"persistent_workers": True},
        "persistent_workers",
    ),
    "stream shuffle=True": (_stream, {"shuffle": True}, "shuffle"),
    "stream shuffle='yes'": (_stream, {"shuffle": "yes"}, "shuffle"),
    "stream sampler": (_stream, {"sampler": [0, 1]}, "sampler"),
    "stream batch_sampler": (_stream, {"batch_sampler": [[0]]}, "batch_sampler"),
    "torch stream shuffle": (lambda m: stream_dataset(tud, [1]), {"shuffle": True}, "shuffle"),
    "sampler and shuffle": (_range4, {"sampler": [0, 1], "shuffle": True}, "shuffle"),
    "batch_sampler and batch_size": (
        _range4,
        {"batch_sampler": [[0]], "batch_size": 2},
        "batch_sampler",
    ),
    "batch_sampler and batch_size=None": (
        _range4,
        {"batch_sampler": [[0]], "batch_size": None},
        "batch_sampler",
    ),
    "batch_sampler and shuffle": (
        _range4,
        {"batch_sampler": [[0]], "shuffle": True},
        "batch_sampler",
    ),
    "batch_sampler and sampler": (
        _range4,
        {"batch_sampler": [[0]], "sampler": [0]},
        "batch_sampler",
    ),
    "batch_sampler and drop_last": (
        _range4,
        {"batch_sampler": [[0]], "drop_last": True},
        "batch_sampler",
    ),
    "batch_size=None and drop_last": (
        _range4,
        {"batch_size": None, "drop_last": True},
        "drop_last",
    ),
    "batch_size=0": (_range4, {"batch_size": 0}, "batch_size"),
    "batch_size=-1": (_range4, {"batch_size": -1}, "batch_size"),
    "batch_size=2.0": (_range4, {"batch_size": 2.0}, "batch_size"),
    "batch_size=True": (_range4, {"batch_size": True}, "batch_size"),
    "drop_last=1": (_range4, {"drop_last": 1}, "drop_last"),
    "shuffle on an empty dataset": (lambda m: range(0), {"shuffle": True}, "num_samples"),
    "shuffle on an unsized dataset": (lambda m: map_dataset(m, []), {"shuffle": True}, ""),
    "multiprocessing_context without workers": (
        _range4,
        {"multiprocessing_context": "spawn"},
        "multiprocessing_context",
    ),
    "multiprocessing_context bad name": (
        _range4,
        {"num_workers": 1, "multiprocessing_context": "bogus"},
        "multiprocessing_context",
    ),
    "multiprocessing_context wrong type": (
        _range4,
        {"num_workers": 1, "multiprocessing_context": 5},
        "multiprocessing_context",
    ),
    "multiprocessing_context module": (
        _range4,
        {"num_workers": 1, "multiprocessing_context": multiprocessing},
        "multiprocessing_context",
    ),
}


@pytest.mark.parametrize(("make", "kwargs", "option"), INVALID.values(), ids=INVALID.keys())
def test_invalid_options_raise_like_torch(
    make: Callable[[Any], Any], kwargs: dict[str, Any], option: str
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # more workers than CPUs, in both
        expected = outcome(lambda: tud.DataLoader(make(tud), **kwargs))
        got = outcome(lambda: ferry.DataLoader(make(ferry), **kwargs))
    assert isinstance(expected, Raised), "torch accepts this; the table is wrong"
    assert_same_outcome(expected, got)
    assert option in got.message, f"the message does not name {option!r}: {got.message}"


def test_worker_type_is_validated() -> None:
    with pytest.raises(ValueError, match="worker_type"):
        ferry.DataLoader(range(3), worker_type="fiber")  # type: ignore[arg-type]
    assert ferry.DataLoader(range(3), worker_type="thread").worker_type == "thread"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_workers": torch.tensor(0).item()},
        {"timeout": 0.0},
        {"timeout": False},
        {"shuffle": 1},
        {"shuffle": None, "sampler": [2, 0]},
        {"pin_memory_device": "cpu"},
        pytest.param({"in_order": False}, marks=[needs_torch("2.6", "DataLoader(in_order=)")]),
        *(
            []
            if np is None
            else [
                {"num_workers": np.int64(0)},
                {"timeout": np.float64(0.0)},
                {"timeout": np.int64(0)},
                {"timeout": np.float32(0.0)},
                {"batch_size": np.int64(2).item()},
            ]
        ),
    ],
    ids=stable_id,
)
def test_valid_options_accepted_like_torch(kwargs: dict[str, Any]) -> None:
    differential(lambda m: m.DataLoader(range(5), **kwargs))


@pytest.mark.parametrize(
    "context",
    [
        "spawn",
        "fork",
        "forkserver",
        multiprocessing.get_context("spawn"),
        torch.multiprocessing.get_context("fork"),
    ],
    ids=stable_id,
)
def test_multiprocessing_context_is_resolved_like_torch(context: Any) -> None:
    if isinstance(context, str) and context not in multiprocessing.get_all_start_methods():
        pytest.skip(f"start method {context} is not available on this platform")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        expected = tud.DataLoader(range(3), num_workers=1, multiprocessing_context=context)
        got = ferry.DataLoader(range(3), num_workers=1, multiprocessing_context=context)
    assert type(got.multiprocessing_context) is type(expected.multiprocessing_context)
    assert isinstance(got.multiprocessing_context, multiprocessing.context.BaseContext)
    got.multiprocessing_context = None
    assert got.multiprocessing_context is None


def test_multiprocessing_context_checked_when_set_after_init() -> None:
    for module in MODULES:
        loader = module.DataLoader(range(3))
        with pytest.raises(ValueError, match="multiprocessing_context"):
            loader.multiprocessing_context = "spawn"
        loader.num_workers = 1
        with pytest.raises(TypeError):
            loader.multiprocessing_context = 3.5
        loader.multiprocessing_context = "spawn"
        assert loader.multiprocessing_context.get_start_method() == "spawn"


# -- frozen attributes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "attr", ["batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"]
)
def test_frozen_attributes_cannot_be_set_after_init(attr: str) -> None:
    for module in MODULES:
        loader = module.DataLoader(range(4), batch_size=2)
        old = getattr(loader, attr)
        with pytest.raises(ValueError, match=attr):
            setattr(loader, attr, old)
        assert getattr(loader, attr) is old


def test_other_attributes_can_be_set_after_init() -> None:
    def build(m: Any) -> Any:
        loader = m.DataLoader(range(5), batch_size=2)
        loader.collate_fn = sum
        loader.num_workers = 0
        loader.generator = torch.Generator()
        loader.pin_memory = False
        return loader

    differential(build)


# -- length --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"batch_size": 3},
        {"batch_size": 3, "drop_last": True},
        {"batch_size": 5},
        {"batch_size": 20},
        {"batch_size": 20, "drop_last": True},
        {"batch_size": None},
        {"batch_size": 3, "sampler": [1, 2, 3, 4]},
        {"batch_size": None, "sampler": [1, 2, 3, 4]},
        {"batch_sampler": [[0, 1], [2], [3, 4, 5]]},
        {"batch_size": 3, "shuffle": True},
        {"sampler": iter([1, 2])},
    ],
    ids=stable_id,
)
@pytest.mark.parametrize("n", [0, 1, 10])
def test_len_of_map_style_loaders_matches_torch(kwargs: dict[str, Any], n: int) -> None:
    expected = outcome(lambda: len(tud.DataLoader(range(n), **kwargs)))
    got = outcome(lambda: len(ferry.DataLoader(range(n), **kwargs)))
    assert_same_outcome(expected, got)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"batch_size": 3},
        {"batch_size": 3, "drop_last": True},
        {"batch_size": 4},
        {"batch_size": 4, "drop_last": True},
        {"batch_size": None},
    ],
    ids=stable_id,
)
@pytest.mark.parametrize("length", [0, 1, 8, 10, None])
def test_len_of_iterable_style_loaders_estimates_like_torch(
    kwargs: dict[str, Any], length: int | None
) -> None:
    def build(m: Any) -> int:
        return len(m.DataLoader(stream_dataset(m, list(range(5)), length), **kwargs))

    assert_same_outcome(outcome(lambda: build(tud)), outcome(lambda: build(ferry)))


def test_len_estimate_values() -> None:
    def length(**kwargs: Any) -> int:
        return len(ferry.DataLoader(stream_dataset(ferry, [], 10), **kwargs))

    assert length(batch_size=3) == 4
    assert length(batch_size=3, drop_last=True) == 3
    assert length(batch_size=None) == 10
    assert length(batch_size=5) == 2


@pytest.mark.parametrize(
    ("length", "items", "batch_size", "warns"),
    [
        (2, 5, 1, True),
        (2, 5, 2, True),
        (3, 3, 1, False),
        (10, 5, 2, False),
        (5, 5, None, False),
        (2, 5, None, True),
    ],
)
def test_warning_when_more_batches_come_than_len_said(
    length: int, items: int, batch_size: int | None, warns: bool
) -> None:
    """torch compares the number of batches yielded with ``len(dataset)`` recorded by
    ``len(loader)`` and warns when it is exceeded."""
    for module in MODULES:
        loader = module.DataLoader(
            stream_dataset(module, list(range(items)), length), batch_size=batch_size
        )
        len(loader)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            list(loader)
        user = [w for w in caught if issubclass(w.category, UserWarning)]
        assert bool(user) is warns, (module.__name__, [str(w.message) for w in caught])


def test_no_length_warning_without_len_call() -> None:
    loader = ferry.DataLoader(stream_dataset(ferry, list(range(5)), 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len([batch for batch in loader]) == 5  # noqa: C416 - list() would call len()


def test_length_warning_only_for_a_len_call_made_before_the_iterator() -> None:
    """torch's iterator remembers the length reported before it was created. ``list(loader)``
    creates the iterator and then asks ``len(loader)`` for a size hint: no warning then."""
    for module in MODULES:

        def fresh(module: Any = module) -> Any:
            return module.DataLoader(stream_dataset(module, list(range(5)), 1))

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len(list(fresh())) == 5, module.__name__
            loader = fresh()
            iterator = iter(loader)
            len(loader)
            assert len([batch for batch in iterator]) == 5, module.__name__  # noqa: C416


@pytest.mark.parametrize("timeout", [1.5, float("nan"), True], ids=stable_id)
def test_timeout_without_workers_fails_on_iteration_like_torch(timeout: float) -> None:
    """torch accepts any number but a negative one with ``num_workers=0``, and its
    single-process iterator refuses all but 0 (AssertionError) when created; so does a
    negative one set after the loader was built."""
    differential(lambda m: list(m.DataLoader(range(3), timeout=timeout)))

    def set_later(m: Any) -> Any:
        loader = m.DataLoader(range(3))
        loader.timeout = -1
        return list(loader)

    differential(set_later)


def test_prefetch_factor_without_workers_is_refused_before_its_type_like_torch() -> None:
    differential(lambda m: m.DataLoader(range(3), prefetch_factor=2.0))
    with pytest.raises(ValueError, match="could only be specified in multiprocessing"):
        ferry.DataLoader(range(3), prefetch_factor=2.5)  # type: ignore[arg-type]


def test_len_of_an_iterator() -> None:
    for kwargs in ({"batch_size": 3}, {"batch_size": None}, {"batch_sampler": [[0], [1, 2]]}):
        expected = outcome(lambda kwargs=kwargs: len(iter(tud.DataLoader(range(7), **kwargs))))
        got = outcome(lambda kwargs=kwargs: len(iter(ferry.DataLoader(range(7), **kwargs))))
        assert_same_outcome(expected, got, repr(kwargs))


def test_len_of_an_iterator_over_a_stream_matches_torch() -> None:
    def build(m: Any) -> int:
        return len(iter(m.DataLoader(stream_dataset(m, [1, 2, 3], 3), batch_size=2)))

    assert_same_outcome(outcome(lambda: build(tud)), outcome(lambda: build(ferry)))


# -- iterators -----------------------------------------------------------------------------------


def test_an_exhausted_iterator_stays_exhausted() -> None:
    def build(m: Any) -> Any:
        results = []
        for dataset in (m.TensorDataset(X, Y), range(5), stream_dataset(m, [1, 2, 3])):
            for kwargs in ({"batch_size": 2}, {"batch_size": None}):
                iterator = iter(m.DataLoader(dataset, **kwargs))
                results.append((iter(iterator) is iterator, list(iterator), list(iterator)))
        return results

    assert_same_outcome(outcome(lambda: build(tud)), outcome(lambda: build(ferry)))


def test_each_iter_call_starts_a_new_epoch() -> None:
    loader = ferry.DataLoader(range(5), batch_size=2)
    first, second = iter(loader), iter(loader)
    assert next(first).tolist() == [0, 1]
    assert next(second).tolist() == [0, 1]
    assert next(first).tolist() == [2, 3]


def test_errors_from_the_dataset_reach_the_caller_unchanged() -> None:
    class Failing(ferry.Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> int:
            if index == 2:
                raise KeyError("sample 2 is missing")
            return index

    iterator = iter(ferry.DataLoader(Failing(), batch_size=2))
    assert next(iterator).tolist() == [0, 1]
    with pytest.raises(KeyError, match="sample 2"):
        next(iterator)


def test_out_of_range_keys_raise_like_torch() -> None:
    differential(lambda m: m.DataLoader(m.TensorDataset(X, Y), batch_size=4, sampler=range(12)))
    differential(
        lambda m: m.DataLoader(
            m.TensorDataset(X, Y),
            batch_size=4,
            sampler=m.SequentialSampler(range(12)),
        )
    )


def test_batches_do_not_alias_the_dataset() -> None:
    """A batch is a copy: changing it in place leaves the dataset as it was (as in torch)."""
    for module in MODULES:
        x = torch.zeros(12, 3)
        for kwargs in (
            {"batch_size": 4},
            {"batch_size": 5, "shuffle": True},
            {"batch_sampler": [[0, 1, 2], [3]]},
        ):
            for (batch,) in module.DataLoader(module.TensorDataset(x), **kwargs):
                batch.add_(1)
            for batch in module.DataLoader(
                module.Subset(module.TensorDataset(x), [2, 3, 5, 7, 11]), **kwargs
            ):
                batch[0].add_(1)
        assert torch.equal(x, torch.zeros(12, 3)), module.__name__


# -- pickling ------------------------------------------------------------------------------------


def _double(batch: Any) -> Any:
    return [2 * b for b in batch]


def test_a_loader_pickles_and_iterates_the_same() -> None:
    def build(m: Any) -> Any:
        loader = m.DataLoader(
            m.TensorDataset(X, Y), batch_size=3, shuffle=True, collate_fn=_double, drop_last=True
        )
        list(loader)
        clone = pickle.loads(pickle.dumps(loader))
        return [len(clone), clone.batch_size, clone.drop_last, list(clone)]

    differential(build, seed=2)


@pytest.mark.timeout(60)
def test_a_loader_with_workers_pickles_mid_epoch() -> None:
    """What the loader keeps of its live epoch (the track, its statistics, which see the
    workers' channel) does not travel: the copy starts afresh, as torch's does."""
    loader = ferry.DataLoader(
        ferry.TensorDataset(X, Y), batch_size=3, num_workers=2, multiprocessing_context="fork"
    )
    iterator = iter(loader)
    next(iterator)
    clone = pickle.loads(pickle.dumps(loader))
    assert_same(list(clone), list(tud.DataLoader(tud.TensorDataset(X, Y), batch_size=3)))
    del iterator


def test_a_loader_deep_copies() -> None:
    loader = ferry.DataLoader(ferry.TensorDataset(X, Y), batch_size=4)
    list(loader)
    clone = copy.deepcopy(loader)
    assert_same(list(clone), list(loader))


def test_pickling_an_iterator_fails_like_torch() -> None:
    expected = outcome(lambda: pickle.dumps(iter(tud.DataLoader(range(3)))))
    got = outcome(lambda: pickle.dumps(iter(ferry.DataLoader(range(3)))))
    assert isinstance(expected, Raised)
    assert_same_outcome(expected, got)


# -- workers option checks that start nothing ----------------------------------------------------


def test_more_workers_than_cpus_warns_like_torch() -> None:
    too_many = _cpus() + 1
    for module in MODULES:
        with pytest.warns(UserWarning, match="worker"):
            module.DataLoader(range(3), num_workers=too_many)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ferry.DataLoader(range(3), num_workers=1)
        ferry.DataLoader(range(3), num_workers=0)


def test_get_worker_info_is_none_in_the_main_process() -> None:
    assert ferry.get_worker_info() is None
    seen = []

    class Probe(ferry.Dataset):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, index: int) -> int:
            seen.append(ferry.get_worker_info())
            return index

    list(ferry.DataLoader(Probe()))
    assert seen == [None, None]


# -- pin_memory ----------------------------------------------------------------------------------


@pytest.mark.skipif(accelerator_available(), reason="checks the no-accelerator fallback")
def test_pin_memory_without_an_accelerator_warns_each_epoch_and_yields_plain_tensors() -> None:
    """As torch's: each new iterator warns (the default filter shows it once a line)."""
    loader = ferry.DataLoader(ferry.TensorDataset(X, Y), batch_size=4, pin_memory=True)
    with pytest.warns(UserWarning, match="pin_memory") as caught:
        first = list(loader)
    assert len([w for w in caught if "pin_memory" in str(w.message)]) == 1
    with pytest.warns(UserWarning, match="pin_memory") as caught:
        second = list(loader)
    assert len([w for w in caught if "pin_memory" in str(w.message)]) == 1
    for batch in first + second:
        assert not any(t.is_pinned() for t in batch)
    torch_batches = list(tud.DataLoader(tud.TensorDataset(X, Y), batch_size=4))
    assert_same(first, torch_batches)
    assert_same(second, torch_batches)


@needs_torch("2.9", "pinning by torch.accelerator and its warnings")
@pytest.mark.skipif(accelerator_available(), reason="checks the no-accelerator fallback")
def test_pin_memory_warning_comes_from_torch_too() -> None:
    with pytest.warns(UserWarning, match="pin_memory"):
        iter(tud.DataLoader(range(2), pin_memory=True))


@pytest.mark.skipif(not accelerator_available(), reason="needs an accelerator to pin memory")
def test_pin_memory_with_an_accelerator_pins_like_torch() -> None:  # pragma: no cover
    class Batch:
        def __init__(self, data: Any) -> None:
            self.inp = torch.stack([d[0] for d in data])

        def pin_memory(self) -> Any:
            self.inp = self.inp.pin_memory()
            return self

    for module in MODULES:
        loader = module.DataLoader(module.TensorDataset(X, Y), batch_size=4, pin_memory=True)
        assert all(t.is_pinned() for batch in loader for t in batch)
        custom = module.DataLoader(
            module.TensorDataset(X, Y), batch_size=4, pin_memory=True, collate_fn=Batch
        )
        assert all(batch.inp.is_pinned() for batch in custom)


# -- the engine pieces behind iteration ----------------------------------------------------------


def test_an_inline_iterator_reset_goes_on_as_a_new_one() -> None:
    """torch's ``_reset(loader)`` on an iterator without workers: the next epoch, as the next
    ``iter(loader)`` would begin it (same shuffle, same draws)."""
    from ferry._engine.iterator import LoaderIterator

    def loader() -> ferry.DataLoader[Any]:
        return ferry.DataLoader(
            range(7), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5)
        )

    fresh = loader()
    want = [[b.tolist() for b in fresh] for _ in range(3)]
    kept = loader()
    iterator = iter(kept)
    assert isinstance(iterator, LoaderIterator)
    got = [[b.tolist() for b in iterator]]
    for _ in range(2):
        iterator._reset(kept)
        got.append([b.tolist() for b in iterator])
    assert got == want
    kept.num_workers = 2
    with pytest.raises(ValueError, match="num_workers=0 cannot go on with workers"):
        iterator._reset(kept)
    with pytest.raises(NotImplementedError):
        next(LoaderIterator(kept._plan()))
    with pytest.raises(NotImplementedError, match="_next_index"):
        iterator._next_index()


def test_iterable_fetcher_stops_for_good_and_drops_the_short_batch() -> None:
    from ferry._engine.work.fetch import IterableFetcher, MapFetcher, make_fetcher

    opened = []

    class Stream:
        def __iter__(self) -> Any:
            opened.append(1)
            return iter(range(5))

    fetcher = make_fetcher(Stream(), True, True, list, True)
    assert isinstance(fetcher, IterableFetcher)
    assert fetcher.fetch(2) == [0, 1]
    assert fetcher.fetch(2) == [2, 3]
    for _ in range(2):
        with pytest.raises(StopIteration):
            fetcher.fetch(2)
    assert opened == [1]
    keep_short = make_fetcher(Stream(), True, True, list, False)
    assert [keep_short.fetch(3), keep_short.fetch(3)] == [[0, 1, 2], [3, 4]]
    with pytest.raises(AssertionError):
        make_fetcher(Stream(), True, True, list, False).fetch(None)
    unbatched = make_fetcher(Stream(), True, False, str, False)
    assert [unbatched.fetch(None) for _ in range(5)] == ["0", "1", "2", "3", "4"]
    with pytest.raises(StopIteration):
        unbatched.fetch(None)
    with pytest.raises(StopIteration):
        unbatched.fetch(None)
    assert isinstance(make_fetcher(range(3), False, True, list, False), MapFetcher)
