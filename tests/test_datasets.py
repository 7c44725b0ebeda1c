"""Datasets and random_split: same samples, lengths, errors and warnings as torch's, and the
batched paths (``__getitems__``, the tensor gather) give what per-item access gives."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from hypothesis import given
from hypothesis import strategies as st

import ferry
from _support.compare import (
    HYPOTHESIS,
    MODULES,
    DuckGetitems,
    DuckMap,
    DuckStream,
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
from ferry.datasets import is_iterable_style, tensor_gather

pytestmark = pytest.mark.usefixtures("guard_global_state")


def _both(build: Callable[[Any], Any]) -> tuple[Any, Any]:
    return outcome(lambda: build(tud)), outcome(lambda: build(ferry))


def _assert_both(build: Callable[[Any], Any], label: str = "value") -> None:
    expected, got = _both(build)
    assert_same_outcome(expected, got, label)


# -- Dataset / IterableDataset -------------------------------------------------------------------


def test_dataset_base_getitem_is_abstract() -> None:
    _assert_both(lambda m: m.Dataset()[0])
    with pytest.raises(NotImplementedError):
        ferry.Dataset()[0]


@needs_torch("2.5", "an abstract IterableDataset.__iter__")
def test_iterable_dataset_without_iter_fails_like_torch() -> None:
    """torch's IterableDataset is an abstract ``Iterable``: a subclass that forgets
    ``__iter__`` cannot be instantiated (TypeError)."""

    def build(module: Any) -> Any:
        class NoIter(module.IterableDataset):
            pass

        return list(NoIter())

    expected, got = _both(build)
    assert isinstance(expected, Raised)
    assert_same_outcome(expected, got)


def test_generic_subscription() -> None:
    class Ints(ferry.Dataset[int]):
        def __getitem__(self, index: int) -> int:
            return index

    class Stream(ferry.IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter([1])

    assert Ints()[3] == 3
    assert list(Stream()) == [1]
    assert isinstance(Stream(), ferry.Dataset)


def test_add_concatenates_and_chains() -> None:
    a, b = map_dataset(ferry, [1, 2]), map_dataset(ferry, [3])
    joined = a + b
    assert type(joined) is ferry.ConcatDataset
    assert [joined[i] for i in range(len(joined))] == [1, 2, 3]
    mixed = a + map_dataset(tud, [9])
    assert type(mixed) is ferry.ConcatDataset
    assert mixed[2] == 9
    chained = stream_dataset(ferry, [1]) + stream_dataset(ferry, [2, 3])
    assert type(chained) is ferry.ChainDataset
    assert list(chained) == [1, 2, 3]
    assert list(stream_dataset(ferry, [0]) + stream_dataset(tud, [5])) == [0, 5]


@pytest.mark.parametrize(
    ("dataset", "expected"),
    [
        (stream_dataset(ferry, []), True),
        (stream_dataset(tud, []), True),
        (DuckStream([]), True),
        (map_dataset(ferry, []), False),
        (map_dataset(tud, []), False),
        (DuckMap([]), False),
        ([1, 2], False),
        (range(3), False),
        (ferry.TensorDataset(torch.zeros(1)), False),
    ],
)
def test_is_iterable_style(dataset: Any, expected: bool) -> None:
    assert is_iterable_style(dataset) is expected


# -- TensorDataset -------------------------------------------------------------------------------

X = torch.arange(24, dtype=torch.float32).view(6, 4)
Y = torch.tensor([0, 1, 0, 1, 1, 0])


@pytest.mark.parametrize(
    "index", [0, 5, -1, -6, slice(1, 4), [0, 2], torch.tensor([3, 1]), torch.tensor(2), 6, -7]
)
def test_tensor_dataset_indexing_matches_torch(index: Any) -> None:
    _assert_both(lambda m: m.TensorDataset(X, Y)[index], f"ds[{index!r}]")


def test_tensor_dataset_len_and_attributes() -> None:
    for module in MODULES:
        ds = module.TensorDataset(X, Y)
        assert len(ds) == 6
        assert ds.tensors[0] is X
        assert ds.tensors[1] is Y


def test_tensor_dataset_size_mismatch_is_an_assertion_error() -> None:
    _assert_both(lambda m: m.TensorDataset(X, Y[:3]))
    with pytest.raises(AssertionError):
        ferry.TensorDataset(X, Y[:3])


def test_tensor_dataset_without_tensors() -> None:
    _assert_both(lambda m: len(m.TensorDataset().tensors))
    _assert_both(lambda m: len(m.TensorDataset()))


def test_tensor_datasets_read_by_torchs_loader_give_torchs_rows() -> None:
    """Like torch's, ferry's TensorDataset has no ``__getitems__``, and a Subset of it hands
    back a list of row tuples: a torch loader (the kind Lightning or accelerate build) gives a
    user's ``collate_fn`` the plain list torch gives, whatever dataset it reads."""
    assert not hasattr(ferry.TensorDataset(X, Y), "__getitems__")
    for build in (
        lambda m: m.TensorDataset(X, Y),
        lambda m: m.Subset(m.TensorDataset(X, Y), [5, 1, 2]),
    ):
        got = []
        for module in (tud, ferry):
            batches = list(tud.DataLoader(build(module), batch_size=2, collate_fn=lambda b: b))
            assert all(type(batch) is list for batch in batches)
            got.append(batches)
        assert_same(got[1], got[0])
    assert type(ferry.Subset(ferry.TensorDataset(X), [3, 0]).__getitems__([1, 0])) is list


@pytest.mark.parametrize(
    "source",
    [
        torch.arange(12.0).view(6, 2, 1, 1).contiguous(memory_format=torch.channels_last),
        torch.arange(240.0).view(10, 2, 3, 4).contiguous(memory_format=torch.channels_last),
        torch.arange(24.0).view(2, 3, 4).transpose(0, 2),
        X.t().contiguous().t(),
    ],
    ids=["channels_last_1x1", "channels_last", "transposed", "column_major"],
)
def test_tensor_dataset_batches_keep_torchs_strides(source: torch.Tensor) -> None:
    """Stacked rows are contiguous whatever the source's layout; a gather keeps a
    channels_last source's, unless made dense."""
    for build in (
        lambda m: m.TensorDataset(source),
        lambda m: m.Subset(m.TensorDataset(source), [1, 0, 1]),
    ):
        batches = [list(m.DataLoader(build(m), batch_size=2)) for m in (tud, ferry)]
        for theirs, ours in zip(*batches, strict=True):
            assert ours[0].stride() == theirs[0].stride()
            assert torch.equal(ours[0], theirs[0])


@needs_torch("2.5", "refusing to collate sparse tensors")
def test_sparse_tensor_dataset_fails_as_torchs() -> None:
    sparse = torch.eye(4).to_sparse()
    differential(lambda m: m.DataLoader(m.TensorDataset(sparse), batch_size=2))


@pytest.mark.parametrize(
    "indices",
    [
        [slice(0, 2), slice(1, 3)],
        [[1, 2], [3, 4]],
        [True, False, True],
        torch.tensor([1, 0, 1], dtype=torch.uint8),
        torch.tensor([True, False, True]),
        [1.0, 2.0],
        [np.int64(3), np.int32(1)],
        torch.tensor([4, 2], dtype=torch.int32),
    ],
    ids=stable_id,
)
def test_subset_of_a_tensor_dataset_reads_any_indices_as_torch(indices: Any) -> None:
    differential(lambda m: m.DataLoader(m.Subset(m.TensorDataset(X, Y), indices), batch_size=2))


def test_tensor_dataset_subclass_getitem_override_is_used_by_the_loader() -> None:
    def build(module: Any) -> Any:
        class Scaled(module.TensorDataset):
            def __getitem__(self, index: Any) -> Any:
                x, y = super().__getitem__(index)
                return x * 10, y

        return module.DataLoader(Scaled(X, Y), batch_size=4, shuffle=True)

    differential(build, seed=3, epochs=2)


def test_tensor_dataset_subclass_getitems_override_is_used_by_the_loader() -> None:
    """torch's fetcher calls ``__getitems__`` whenever the dataset has one; a subclass that
    batches its own way must not be bypassed by the tensor fast path."""

    def build(module: Any) -> Any:
        class Batched(module.TensorDataset):
            def __getitems__(self, indices: list[int]) -> list[Any]:
                return [(self.tensors[0][i] + 100, self.tensors[1][i]) for i in indices]

        return module.DataLoader(Batched(X, Y), batch_size=4)

    differential(build)


@pytest.mark.parametrize(
    "batch",
    [
        [4, 0, 4],
        (1, 2),
        range(1, 4),
        torch.tensor([3, 1]),
        torch.tensor([3, 1], dtype=torch.int32),
        np.array([5, 0]),
        [np.int64(2), np.int32(1)],
        [torch.tensor(2), torch.tensor(0)],
        [-1, -6],
        [],
        [1.0, 2.0],
        [True, False],
        [slice(0, 2)],
        [[0, 1], [2, 3]],
        [6],
    ],
    ids=stable_id,
)
def test_tensor_dataset_batches_of_any_keys_match_torch(batch: Any) -> None:
    """torch reads a batch of keys one ``dataset[key]`` at a time, whatever the keys are; the
    batched path must give the same samples, or the same exception type."""

    def build(module: Any) -> Any:
        return module.DataLoader(module.TensorDataset(X, Y), batch_sampler=[batch])

    differential(build)


def test_tensor_dataset_batch_of_a_one_shot_iterable_matches_torch() -> None:
    differential(
        lambda m: m.DataLoader(m.TensorDataset(X, Y), batch_sampler=[(i for i in range(3))])
    )


def test_tensor_gather_only_for_plain_tensor_datasets() -> None:
    class Sub(ferry.TensorDataset):
        def __getitem__(self, index: Any) -> Any:
            return super().__getitem__(index)

    assert tensor_gather(ferry.TensorDataset(X, Y)) is not None
    assert tensor_gather(ferry.TensorDataset()) is None
    assert tensor_gather(Sub(X)) is None
    assert tensor_gather(tud.TensorDataset(X)) is None
    assert tensor_gather(ferry.Subset(ferry.TensorDataset(X), [0])) is not None
    assert tensor_gather(ferry.Subset(Sub(X), [0])) is None
    assert tensor_gather(ferry.Subset(DuckMap([1]), [0])) is None
    gather = tensor_gather(ferry.Subset(ferry.TensorDataset(X, Y), [5, 3, 1]))
    assert gather is not None
    assert_same(list(gather(torch.tensor([2, 0]))), [X[[1, 5]], Y[[1, 5]]])
    with pytest.raises(TypeError, match="tensor gather"):
        ferry.Subset(DuckMap([1]), [0])._ferry_gather(torch.tensor([0]))


# -- StackDataset --------------------------------------------------------------------------------


@pytest.mark.parametrize("index", [0, 2, -1, 3])
def test_stack_dataset_positional_and_keyword(index: int) -> None:
    _assert_both(lambda m: m.StackDataset(range(3), "abc", X[:3])[index], "positional")
    _assert_both(lambda m: m.StackDataset(n=range(3), c="abc")[index], "keyword")
    _assert_both(lambda m: len(m.StackDataset(n=range(3), c="abc")))


@pytest.mark.parametrize(
    "build",
    [
        lambda m: m.StackDataset(range(3), c="abc"),
        lambda m: m.StackDataset(),
        lambda m: m.StackDataset(range(3), range(4)),
        lambda m: m.StackDataset(a=range(3), b=range(2)),
    ],
)
def test_stack_dataset_errors_match_torch(build: Callable[[Any], Any]) -> None:
    expected, got = _both(build)
    assert isinstance(expected, Raised)
    assert_same_outcome(expected, got)


@needs_torch("2.5", "StackDataset.__getitems__")
@pytest.mark.parametrize("keyword", [False, True])
def test_stack_dataset_getitems_matches_torch(keyword: bool) -> None:
    def build(module: Any) -> Any:
        parts = [DuckGetitems(list("abcd")), DuckMap([10, 11, 12, 13]), module.TensorDataset(X[:4])]
        ds = (
            module.StackDataset(**{f"p{i}": p for i, p in enumerate(parts)})
            if keyword
            else module.StackDataset(*parts)
        )
        return ds.__getitems__([3, 0, 3])

    _assert_both(build)


@needs_torch("2.5", "StackDataset.__getitems__")
def test_stack_dataset_getitems_checks_the_inner_batch_size() -> None:
    class Short(DuckGetitems):
        def __getitems__(self, indices: list[int]) -> list[Any]:
            return super().__getitems__(indices)[:-1]

    _assert_both(lambda m: m.StackDataset(Short([1, 2]), range(2)).__getitems__([0, 1]))
    _assert_both(lambda m: m.StackDataset(a=Short([1, 2]), b=range(2)).__getitems__([0, 1]))
    with pytest.raises(ValueError, match=r"output size mismatch\. Expected 2, got 1: Short"):
        ferry.StackDataset(Short([1, 2])).__getitems__([0, 1])


# -- ConcatDataset -------------------------------------------------------------------------------


def _concat_parts() -> list[Any]:
    return [range(3), DuckMap(["a", "b"]), range(100, 104)]


@pytest.mark.parametrize("index", [*range(-9, 9), -10, 9, 10])
def test_concat_dataset_indexing_matches_torch(index: int) -> None:
    _assert_both(lambda m: m.ConcatDataset(_concat_parts())[index], f"ds[{index}]")


def test_concat_dataset_sizes() -> None:
    for module in MODULES:
        ds = module.ConcatDataset(_concat_parts())
        assert ds.cumulative_sizes == [3, 5, 9]
        assert len(ds) == 9


def test_concat_dataset_cummulative_sizes_is_deprecated_with_a_future_warning() -> None:
    ds = ferry.ConcatDataset(_concat_parts())
    with pytest.warns(FutureWarning, match="cumulative_sizes"):
        assert ds.cummulative_sizes == [3, 5, 9]


def test_concat_dataset_cumsum_static_method() -> None:
    assert tud.ConcatDataset.cumsum([range(2), range(3)]) == [2, 5]
    assert ferry.ConcatDataset.cumsum([range(2), range(3)]) == [2, 5]


@pytest.mark.parametrize(
    "build",
    [
        lambda m: m.ConcatDataset([]),
        lambda m: m.ConcatDataset(iter([])),
        lambda m: m.ConcatDataset([range(2), stream_dataset(m, [1])]),
        lambda m: m.ConcatDataset([stream_dataset(tud, [1])]),
    ],
)
def test_concat_dataset_errors_match_torch(build: Callable[[Any], Any]) -> None:
    _assert_both(lambda m: len(build(m)))


def test_concat_dataset_reads_its_parts_in_the_samplers_order() -> None:
    """torch's ConcatDataset has no ``__getitems__``: its parts are read one key at a time in
    the sampler's order, their own ``__getitems__`` never called, so the random draws of an
    augmenting part come in torch's order."""

    class Drawing(DuckMap):
        def __init__(self, name: str, log: list[str]) -> None:
            super().__init__([name + str(i) for i in range(2)])
            self.log = log

        def __getitem__(self, index: int) -> Any:
            self.log.append(self.items[index])
            return torch.rand(())

        def __getitems__(self, indices: list[int]) -> Any:
            raise AssertionError("torch never reads a part's batch")

    got = []
    for module in (tud, ferry):
        log: list[str] = []
        dataset = module.ConcatDataset([Drawing("a", log), Drawing("b", log)])
        assert not hasattr(dataset, "__getitems__")
        torch.manual_seed(0)
        batches = list(module.DataLoader(dataset, batch_size=4, sampler=[2, 0, 3, 1]))
        got.append((log, batches))
    assert got[1][0] == got[0][0] == ["b0", "a0", "b1", "a1"]
    assert_same(got[1][1], got[0][1])


def test_concat_dataset_subclass_getitem_override_is_respected() -> None:
    def build(module: Any) -> Any:
        class Doubled(module.ConcatDataset):
            def __getitem__(self, index: int) -> Any:
                return 2 * super().__getitem__(index)

        return module.DataLoader(Doubled([range(3), range(3)]), batch_size=2)

    differential(build)


def test_concat_dataset_in_a_loader_matches_torch() -> None:
    differential(
        lambda m: m.DataLoader(
            m.ConcatDataset([m.TensorDataset(X, Y), m.TensorDataset(X[:2] * -1, Y[:2])]),
            batch_size=3,
            shuffle=True,
        ),
        seed=5,
        epochs=2,
    )


# -- ChainDataset --------------------------------------------------------------------------------


def test_chain_dataset_matches_torch() -> None:
    def build(module: Any) -> Any:
        ds = module.ChainDataset([stream_dataset(module, [1, 2], 2), stream_dataset(tud, ["x"], 1)])
        return list(ds), len(ds), list(ds)

    _assert_both(build)


@pytest.mark.parametrize("operation", [list, len])
def test_chain_dataset_rejects_map_style_parts_like_torch(operation: Callable[[Any], Any]) -> None:
    _assert_both(lambda m: operation(m.ChainDataset([stream_dataset(m, [1], 1), range(3)])))
    _assert_both(lambda m: operation(m.ChainDataset([map_dataset(m, [1])])))


def test_chain_dataset_len_needs_sized_parts() -> None:
    _assert_both(lambda m: len(m.ChainDataset([stream_dataset(m, [1])])))


def test_chain_dataset_is_lazy() -> None:
    for module in MODULES:
        ds = module.ChainDataset([stream_dataset(module, [1]), range(3)])
        iterator = iter(ds)
        assert next(iterator) == 1


# -- Subset --------------------------------------------------------------------------------------


@pytest.mark.parametrize("index", [0, -1, 2, 3, [0, 2]])
def test_subset_indexing_matches_torch(index: Any) -> None:
    _assert_both(lambda m: m.Subset(m.TensorDataset(X), [4, 0, 2])[index], f"subset[{index}]")
    _assert_both(lambda m: len(m.Subset(range(10), [4, 0, 2])))


def test_subset_getitems_delegates_to_the_dataset() -> None:
    for module in MODULES:
        inner = DuckGetitems(list("abcdef"))
        sub = module.Subset(inner, [5, 1, 3])
        assert list(sub.__getitems__([2, 0])) == [("batched", "d"), ("batched", "f")]
        assert inner.calls == [[3, 5]]
    _assert_both(lambda m: m.Subset(DuckMap(list("abc")), [2, 1]).__getitems__([1, 0]))


@needs_torch("2.13", "refusing a Subset that overrides only __getitem__")
def test_subset_subclass_overriding_only_getitem_is_refused_like_torch() -> None:
    """torch refuses (NotImplementedError) a Subset subclass that overrides ``__getitem__``
    but not ``__getitems__``: the loader would silently bypass the override."""

    def build(module: Any) -> Any:
        class Plus(module.Subset):
            def __getitem__(self, index: int) -> Any:
                return super().__getitem__(index) + 1

        return Plus(range(5), [1, 2])

    expected, got = _both(build)
    assert isinstance(expected, Raised)
    assert_same_outcome(expected, got)


def test_subset_subclass_overriding_both_is_used_by_the_loader() -> None:
    def build(module: Any) -> Any:
        class Plus(module.Subset):
            def __getitem__(self, index: int) -> Any:
                x, y = self.dataset[self.indices[index]]
                return x + 0.5, y

            def __getitems__(self, indices: list[int]) -> list[Any]:
                return [self[i] for i in indices]

        return module.DataLoader(Plus(module.TensorDataset(X, Y), [5, 1, 3, 0]), batch_size=3)

    differential(build)


def test_subset_indices_changed_between_epochs() -> None:
    """Subset.indices is a plain attribute; code that reshuffles or replaces it between epochs
    must see the new indices in the next epoch."""

    def build(module: Any) -> Any:
        sub = module.Subset(module.TensorDataset(X, Y), [0, 1, 2, 3])
        loader = module.DataLoader(sub, batch_size=2)
        first = list(loader)
        sub.indices[:] = [5, 4, 3, 2]
        second = list(loader)
        sub.indices = [1, 1]
        return first, second, list(loader)

    _assert_both(build)


# -- random_split --------------------------------------------------------------------------------


@st.composite
def split_lengths(draw: st.DrawFn) -> tuple[int, list[int]]:
    parts = draw(st.lists(st.integers(0, 8), min_size=1, max_size=5))
    return sum(parts), parts


@st.composite
def split_fractions(draw: st.DrawFn) -> tuple[int, list[float]]:
    n = draw(st.integers(0, 40))
    weights = draw(st.lists(st.integers(0, 10), min_size=1, max_size=5).filter(any))
    total = sum(weights)
    return n, [w / total for w in weights]


def _split(module: Any, n: int, lengths: list[Any], generator: Any) -> Any:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if generator is None:
            parts = module.random_split(range(n), lengths)
        else:
            parts = module.random_split(range(n), lengths, generator=generator)
    return (
        [type(p).__name__ for p in parts],
        [list(p.indices) for p in parts],
        [[p[i] for i in range(len(p))] for p in parts],
        [w.category for w in caught],
    )


@HYPOTHESIS
@given(
    case=split_lengths() | split_fractions(),
    seed=st.integers(0, 2**32),
    use_generator=st.booleans(),
)
def test_random_split_matches_torch(
    case: tuple[int, list[Any]], seed: int, use_generator: bool
) -> None:
    n, lengths = case
    results = []
    for module in MODULES:
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed + 1) if use_generator else None
        results.append(
            outcome(
                lambda module=module, g=generator: (_split(module, n, lengths, g), torch.rand(1))
            )
        )
    assert_same_outcome(results[0], results[1], "random_split")


def test_random_split_fractions_hand_out_the_remainder_round_robin() -> None:
    parts = ferry.random_split(range(10), [0.25, 0.25, 0.5], torch.Generator().manual_seed(0))
    assert [len(p) for p in parts] == [3, 2, 5]
    parts = ferry.random_split(range(11), [0.3, 0.3, 0.4], torch.Generator().manual_seed(0))
    assert [len(p) for p in parts] == [4, 3, 4]
    parts = ferry.random_split(range(7), [0.3, 0.3, 0.4], torch.Generator().manual_seed(0))
    assert [len(p) for p in parts] == [3, 2, 2]
    assert sorted(i for p in parts for i in p.indices) == list(range(7))
    assert all(type(p) is ferry.Subset for p in parts)


def test_random_split_warns_about_empty_splits() -> None:
    with pytest.warns(UserWarning, match="split"):
        ferry.random_split(range(1), [0.5, 0.5], torch.Generator())


@pytest.mark.parametrize(
    "lengths",
    [[3, 3], [1, 1], [-1, 6], [0.5, 0.6], [1.5, -0.5], [0.4, 0.4], [], [0.2, 0.7]],
)
def test_random_split_errors_match_torch(lengths: list[Any]) -> None:
    _assert_both(lambda m: _split(m, 5, lengths, torch.Generator().manual_seed(0)))


@pytest.mark.parametrize(
    ("lengths", "match"),
    [([1.5, -0.5], "Fraction at index 0"), ([3, 3], "Sum of input lengths"), ([2, 2], "5")],
)
def test_random_split_error_messages(lengths: list[Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ferry.random_split(range(5), lengths)


@pytest.mark.parametrize(
    "lengths",
    [[4.5, 5.5], [2.5, 2.5, 5], [0.5, 9.5], torch.tensor([2.5, 7.5]), np.array([4.5, 5.5])],
    ids=["halves", "three", "fraction-like", "tensor", "numpy"],
)
def test_random_split_refuses_lengths_with_part_of_a_sample(lengths: Any) -> None:
    """torch fails these (``randperm`` of a float); cutting at whole numbers left a sample in
    no split, without a word."""
    for module in (tud, ferry):
        with pytest.raises(TypeError):
            module.random_split(range(10), lengths, torch.Generator().manual_seed(1))
    with pytest.raises(TypeError, match="whole numbers of samples"):
        ferry.random_split(range(10), lengths)


# -- running under ``python -O`` ---------------------------------------------------------------

_OPTIMIZED_SCRIPT = """
import json, torch, ferry
class Stream(ferry.IterableDataset):
    def __iter__(self):
        return iter([1])
cases = {
    "TensorDataset size mismatch": lambda: ferry.TensorDataset(torch.zeros(2), torch.zeros(3)),
    "ConcatDataset empty": lambda: ferry.ConcatDataset([]),
    "ConcatDataset of a stream": lambda: ferry.ConcatDataset([Stream()]),
    "ChainDataset of a map": lambda: list(ferry.ChainDataset([range(2)])),
}
out = {}
for name, case in cases.items():
    try:
        case()
        out[name] = None
    except Exception as exc:
        out[name] = type(exc).__name__
print(json.dumps(out))
"""


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_dataset_checks_survive_python_optimize_mode() -> None:
    """torch raises these AssertionErrors explicitly, so they are raised under ``python -O``
    too; an ``assert`` statement would vanish there and let bad datasets through."""
    result = subprocess.run(
        [sys.executable, "-O", "-c", _OPTIMIZED_SCRIPT],
        capture_output=True,
        text=True,
        check=True,
        timeout=50,
    )
    raised = json.loads(result.stdout.strip().splitlines()[-1])
    assert raised == dict.fromkeys(raised, "AssertionError")
