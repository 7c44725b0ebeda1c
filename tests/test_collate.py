"""collate, default_collate, default_convert and default_collate_fn_map: the same batches
(container types, keys, dtypes, shapes, strides, values) and the same exceptions as torch's, for
generated nested samples and for every documented special case; and collate inside a loader
(where batch memory comes from the loader's buffer pool) gives what it gives outside."""

from __future__ import annotations

import collections
import contextlib
import copy
import importlib
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data._utils import collate as torch_collate

import ferry
from _support.compare import (
    HYPOTHESIS,
    MODULES,
    Raised,
    assert_same,
    assert_same_outcome,
    differential,
    outcome,
    stable_id,
)
from _support.strategies import (
    NUMPY_DTYPES,
    TORCH_DTYPES,
    FixedRow,
    FrozenMapping,
    Pair,
    Record,
    Row,
    batches,
    make_tensor,
)
from _support.torch_versions import needs_torch

pytestmark = pytest.mark.usefixtures("guard_global_state")

# ``ferry.collate`` is the function (as in torch); the module is reached by its full name.
ferry_collate = importlib.import_module("ferry.collate")


def _assert_both(fn: Callable[[Any], Any], label: str = "batch") -> None:
    """``fn(collate_module)`` for torch's and ferry's collate modules gives the same outcome."""
    expected = outcome(lambda: fn(torch_collate))
    got = outcome(lambda: fn(ferry_collate))
    assert_same_outcome(expected, got, label)


def _fresh(batch: list[Any]) -> list[Any]:
    """A deep copy, so one library's collate cannot affect what the other one sees."""
    return copy.deepcopy(batch)


def _in_loader(module: Any, batch: list[Any], **kwargs: Any) -> Any:
    """The one batch a loader over ``batch`` yields with ``batch_size=len(batch)``."""
    (out,) = list(module.DataLoader(batch, batch_size=len(batch), **kwargs))
    return out


# -- generated samples ---------------------------------------------------------------------------


@HYPOTHESIS
@given(batch=batches())
def test_default_collate_matches_torch(batch: list[Any]) -> None:
    _assert_both(lambda m: m.default_collate(_fresh(batch)))


@needs_torch("2.5", "the containers collation keeps")
@HYPOTHESIS
@given(batch=batches())
def test_collate_in_a_loader_matches_collate_outside(batch: list[Any]) -> None:
    expected = outcome(lambda: tud.default_collate(_fresh(batch)))
    assert_same_outcome(expected, outcome(lambda: _in_loader(ferry, _fresh(batch))), "ferry loader")
    assert_same_outcome(expected, outcome(lambda: _in_loader(tud, _fresh(batch))), "torch loader")


@contextlib.contextmanager
def _as_in_a_torch_worker() -> Any:
    """Code here runs as in a worker of torch's loader: torch's ``get_worker_info()`` (and so
    ferry's, which answers it inside torch's workers) is not None."""
    from torch.utils.data._utils import worker

    kept = worker._worker_info
    worker._worker_info = object()  # type: ignore[assignment]
    try:
        yield
    finally:
        worker._worker_info = kept


@HYPOTHESIS
@given(batch=batches())
def test_default_collate_in_a_worker_matches_torchs_workers(batch: list[Any]) -> None:
    """In a worker torch stacks tensors into new contiguous shared memory of the first
    sample's dtype (cast, not promoted; a channels-last layout not kept): ferry's collate gives
    the same there, for generated batches."""
    with _as_in_a_torch_worker():
        _assert_both(lambda m: m.default_collate(_fresh(batch)))


_LAYOUTS = ["as made", "transposed", "permuted", "channels last", "stepped", "expanded"]


@st.composite
def _laid_out_tensors(draw: st.DrawFn) -> list[torch.Tensor]:
    """Two to four tensors of one shape, each of its own dtype (often the same) and laid out
    as drawn: transposed, permuted, channels-last (4-d), every other element, expanded."""
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)))
    count = draw(st.integers(2, 4))
    first_dtype = draw(st.sampled_from(TORCH_DTYPES))
    out = []
    for position in range(count):
        dtype = draw(st.sampled_from([first_dtype, first_dtype, *TORCH_DTYPES]))
        layout = draw(st.sampled_from(_LAYOUTS))
        dims = len(shape)
        if layout == "transposed" and dims >= 2:
            source = (*shape[:-2], shape[-1], shape[-2])
            tensor = make_tensor(dtype, source, position, False).transpose(-1, -2)
        elif layout == "permuted" and dims >= 2:
            order = draw(st.permutations(range(dims)))
            back = sorted(range(dims), key=lambda d: order[d])
            source = tuple(shape[d] for d in order)
            tensor = make_tensor(dtype, source, position, False).permute(*back)
        elif layout == "channels last" and dims == 4:
            tensor = make_tensor(dtype, shape, position, False).contiguous(
                memory_format=torch.channels_last
            )
        elif layout == "stepped":
            doubled = (*shape[:-1], 2 * shape[-1])
            tensor = make_tensor(dtype, doubled, position, False)[..., ::2]
        elif layout == "expanded":
            tensor = make_tensor(dtype, (*shape[:-1], 1), position, False).expand(*shape)
        else:
            tensor = make_tensor(dtype, shape, position, False)
        assert tensor.shape == shape
        out.append(tensor)
    return out


@HYPOTHESIS
@given(samples=_laid_out_tensors())
def test_tensors_of_any_layout_and_dtype_collate_as_torchs(samples: list[torch.Tensor]) -> None:
    """Outside a loader, in the main process's buffer and in a worker: the batch (dtype,
    strides, values) or the exception type is torch's."""
    from ferry._core.alloc import BufferPool, using_allocator

    _assert_both(lambda m: m.default_collate(list(samples)), "outside a loader")
    expected = outcome(lambda: tud.default_collate(list(samples)))
    with using_allocator(BufferPool(min_bytes=1)):
        got = outcome(lambda: ferry.default_collate(list(samples)))
    assert_same_outcome(expected, got, "in the main process's buffer")
    with _as_in_a_torch_worker():
        _assert_both(lambda m: m.default_collate(list(samples)), "in a worker")


@HYPOTHESIS
@given(batch=batches(max_size=2))
def test_default_convert_matches_torch(batch: list[Any]) -> None:
    _assert_both(lambda m: m.default_convert(_fresh(batch)[0]), "sample")
    _assert_both(lambda m: m.default_convert(_fresh(batch)), "list of samples")
    _assert_both(lambda m: m.default_convert(tuple(_fresh(batch))), "tuple of samples")


@needs_torch("2.5", "the containers conversion keeps")
@HYPOTHESIS
@given(batch=batches(max_size=3))
def test_unbatched_loader_converts_like_torch(batch: list[Any]) -> None:
    differential(lambda m: m.DataLoader(_fresh(batch), batch_size=None))


@HYPOTHESIS
@given(batch=batches(), map_kind=st.sampled_from(["none", "structure", "strings"]))
def test_collate_with_custom_maps_matches_torch(batch: list[Any], map_kind: str) -> None:
    def collate_with(module: Any) -> Any:
        if map_kind == "none":
            fn_map = None
        elif map_kind == "structure":
            fn_map = {}
        else:
            fn_map = {str: module.collate_str_fn, (int, float): lambda b, **_: ("numbers", b)}
        return module.collate(_fresh(batch), collate_fn_map=fn_map)

    _assert_both(collate_with)


# -- numbers, strings, numpy ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch",
    [
        [0, 1, 2],
        [True, False],
        [1.5, float("nan"), -0.0, float("inf")],
        [1, 2.5],
        [2.5, 1],
        [True, 2],
        [2**62, -(2**62)],
        ["a", "bc"],
        [b"a", b"bc"],
        [np.str_("a"), np.str_("b")],
        [(1, "a"), (2, "b")],
        [[0, 1], [2, 3]],
        [{"a": 0, "b": 1}, {"a": 100, "b": 100}],
        [Pair(0, 0), Pair(1, 1)],
        [Pair(torch.zeros(2), "s"), Pair(torch.ones(2), "t")],
        [collections.OrderedDict(b=1, a=2), collections.OrderedDict(b=3, a=4)],
        [{"a": 1, "b": 2}, {"b": 3, "a": 4}],
        [range(2), range(2)],
        ["ab", "cd"],
    ],
    ids=stable_id,
)
def test_documented_cases_match_torch(batch: list[Any]) -> None:
    _assert_both(lambda m: m.default_collate(batch))
    _assert_both(lambda m: m.default_convert(batch))


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=lambda d: np.dtype(d).name)
def test_numpy_arrays_and_scalars_of_every_dtype(dtype: Any) -> None:
    arrays = [np.arange(6).reshape(2, 3).astype(dtype), np.ones((2, 3), dtype=dtype)]
    _assert_both(lambda m: m.default_collate(arrays), "arrays")
    _assert_both(lambda m: m.default_collate([a[0, 1] for a in arrays]), "scalars")
    _assert_both(lambda m: m.default_convert(arrays), "convert arrays")
    _assert_both(lambda m: m.default_convert(arrays[0][0, 0]), "convert scalar")


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_tensors_of_every_dtype(dtype: torch.dtype) -> None:
    batch = [make_tensor(dtype, (2, 3), seed, nan=True) for seed in range(3)]
    _assert_both(lambda m: m.default_collate(batch))
    _assert_both(lambda m: m.default_convert(batch))


@pytest.mark.parametrize(
    "arrays",
    [
        [np.array(["a"]), np.array(["b"])],
        [np.array([b"a"]), np.array([b"b"])],
        [np.array([object()]), np.array([object()])],
        [np.array([1], dtype=">i4"), np.array([2], dtype=">i4")],
    ],
    ids=["str", "bytes", "object", "big-endian"],
)
def test_numpy_arrays_that_are_not_numbers(arrays: list[np.ndarray]) -> None:
    expected = outcome(lambda: tud.default_collate(arrays))
    assert isinstance(expected, Raised)
    assert_same_outcome(expected, outcome(lambda: ferry.default_collate(arrays)))
    _assert_both(lambda m: m.default_convert(arrays))
    _assert_both(lambda m: m.default_convert(arrays[0]))


def test_numpy_string_array_error_names_the_dtype() -> None:
    with pytest.raises(TypeError, match="<U1"):
        ferry.default_collate([np.array(["a"]), np.array(["b"])])


@pytest.mark.parametrize(
    "value",
    [np.str_("a"), np.bytes_(b"a"), np.float64(1.5), np.datetime64("2020-01-01")],
    ids=stable_id,
)
def test_default_convert_numpy_scalars(value: Any) -> None:
    _assert_both(lambda m: m.default_convert(value))
    _assert_both(lambda m: m.default_convert([value, {"v": value}]))


# -- mappings and sequences ----------------------------------------------------------------------


@needs_torch("2.5", "the mapping types collation keeps")
def test_mappings_keep_their_type_when_they_can() -> None:
    default = collections.defaultdict(list, a=1)
    batch = [default, collections.defaultdict(list, a=2)]
    for m in (tud, ferry):
        out = m.default_collate(batch)
        assert type(out) is collections.defaultdict
        assert out.default_factory is list
    _assert_both(lambda m: m.default_collate(batch))


def test_mutable_mapping_is_copied_not_mutated() -> None:
    first, second = Record(tag="first"), Record(tag="second")
    first["x"], second["x"] = 1, 2
    out = ferry.default_collate([first, second])
    assert type(out) is Record
    assert out.tag == "first"
    assert out is not first
    assert first["x"] == 1
    assert_same(out["x"], torch.tensor([1, 2]))
    converted = ferry.default_convert(first)
    assert type(converted) is Record
    assert converted is not first


def test_mapping_that_cannot_be_rebuilt_becomes_a_dict() -> None:
    batch = [FrozenMapping({"a": 1}, "x"), FrozenMapping({"a": 2}, "y")]
    out = ferry.default_collate(batch)
    assert type(out) is dict
    _assert_both(lambda m: m.default_collate(batch))
    _assert_both(lambda m: m.default_convert(batch[0]))


def test_sequences_keep_their_type_when_they_can() -> None:
    _assert_both(lambda m: m.default_collate([Row([1, "a"]), Row([2, "b"])]))
    _assert_both(lambda m: m.default_collate([FixedRow([1, 2], "a"), FixedRow([3, 4], "b")]))
    assert type(ferry.default_collate([Row([1]), Row([2])])) is Row
    assert type(ferry.default_collate([FixedRow([1], "a"), FixedRow([2], "b")])) is list
    _assert_both(lambda m: m.default_convert(Row([np.zeros(1)])))
    _assert_both(lambda m: m.default_convert(FixedRow([np.zeros(1)], "a")))


def test_mutable_sequence_is_copied_not_mutated() -> None:
    class Tagged(list):
        tag = "tagged"

    first = Tagged([1, 2])
    out = ferry.default_collate([first, Tagged([3, 4])])
    assert type(out) is Tagged
    assert first == [1, 2]
    _assert_both(lambda m: m.default_collate([Tagged([1, 2]), Tagged([3, 4])]))


@pytest.mark.parametrize("depth", [1, 3, 6])
def test_deep_nesting(depth: int) -> None:
    def nest(value: Any) -> Any:
        for level in range(depth):
            value = [value, {"level": level, "t": torch.full((2,), float(level))}]
        return value

    batch = [nest(torch.tensor(i)) for i in range(3)]
    _assert_both(lambda m: m.default_collate(batch))
    _assert_both(lambda m: m.default_convert(batch))


# -- errors --------------------------------------------------------------------------------------


_Point = collections.namedtuple("_Point", "x y")


def test_a_namedtuple_takes_the_fields_every_sample_has_as_torch() -> None:
    """torch zips a namedtuple's samples without a size check: a longer plain tuple's extra
    positions are left out."""
    _assert_both(lambda m: m.default_collate([_Point(1, 2), (3, 4, 5)]))


class _Doubling(dict):  # type: ignore[type-arg]
    def __getitem__(self, key: Any) -> Any:
        return 2 * super().__getitem__(key)


def test_default_convert_reads_a_mapping_by_key_as_torch() -> None:
    _assert_both(lambda m: m.default_convert(_Doubling(a=np.array([1, 2]), b=3)))
    _assert_both(lambda m: m.default_convert(np.array([1], dtype="timedelta64[as]")))


def _csr() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
        return torch.eye(2).to_sparse_csr()


ERRORS = {
    "length mismatch": [[1, 2], [3]],
    "length mismatch tuple": [(1, 2), (3, 4, 5)],
    "length mismatch later": [[1], [2], [3, 4]],
    "None": [None, None],
    "object": [object(), object()],
    "complex": [1j, 2j],
    "set": [{1}, {2}],
    "missing key": [{"a": 1}, {"b": 2}],
    "shape mismatch": [torch.zeros(2), torch.zeros(3)],
    "ndim mismatch": [torch.zeros(2), torch.zeros(2, 1)],
    "sparse coo": [torch.zeros(3).to_sparse(), torch.zeros(3).to_sparse()],
    "sparse csr": [_csr(), _csr()],
    "empty batch": [],
    "tensor then number": [torch.zeros(()), 1],
    "unsupported inside dict": [{"a": None}, {"a": None}],
    "namedtuple then a shorter tuple": [_Point(1, 2), (3,)],
    "datetimes in attoseconds": [
        np.array([1], dtype="datetime64[as]"),
        np.array([2], dtype="datetime64[as]"),
    ],
}


@pytest.mark.parametrize(
    "batch",
    [
        pytest.param(
            batch,
            id=name,
            marks=[needs_torch("2.5", "refusing sparse tensors")] if name == "sparse coo" else [],
        )
        for name, batch in ERRORS.items()
    ],
)
def test_errors_match_torch(batch: list[Any]) -> None:
    expected = outcome(lambda: tud.default_collate(batch))
    got = outcome(lambda: ferry.default_collate(batch))
    assert_same_outcome(expected, got)


@needs_torch("2.5", "refusing nested tensors")
def test_nested_tensors_are_refused_like_torch() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "nested tensors are a prototype"
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    batch = [nested, nested]
    expected = outcome(lambda: tud.default_collate(batch))
    assert isinstance(expected, Raised)
    assert_same_outcome(expected, outcome(lambda: ferry.default_collate(batch)))
    with pytest.raises(RuntimeError, match="nested"):
        ferry.default_collate(batch)


def test_unsupported_type_error_names_the_type() -> None:
    class Opaque:
        pass

    with pytest.raises(TypeError, match="Opaque"):
        ferry.default_collate([Opaque(), Opaque()])
    with pytest.raises(TypeError, match="Opaque"):
        ferry.collate([Opaque()], collate_fn_map=None)


def test_length_mismatch_error_says_which_sample() -> None:
    with pytest.raises(RuntimeError, match="sample 2"):
        ferry.default_collate([[1], [2], [3, 4]])


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_error_names_the_layout(layout: str) -> None:
    dense = torch.eye(2)
    sparse = dense.to_sparse() if layout == "coo" else _csr()
    with pytest.raises(RuntimeError, match="sparse"):
        ferry.default_collate([sparse, sparse])


# -- tensors: dtypes, grad, subclasses, layouts -- in and outside a loader ----------------------

BIG = 70_000  # float32 elements: a batch of two is over the buffer pool's pooling threshold


def _big_samples(kind: str) -> list[Any]:
    generator = torch.Generator().manual_seed(0)
    base = [torch.randn(BIG, generator=generator) for _ in range(3)]
    if kind == "float32":
        return base
    if kind == "mixed dtypes":
        return [base[0], base[1].double(), base[2].half()]
    if kind == "int and bool":
        return [base[0] > 0, (base[1] * 10).long(), base[2] > 1]
    if kind == "shape mismatch":
        return [base[0], base[1][:-1], base[2]]
    if kind == "requires grad":
        return [t.requires_grad_() for t in base]
    if kind == "parameter":
        return [torch.nn.Parameter(t) for t in base]
    if kind == "subclass":
        return [t.as_subclass(_Tagged) for t in base]
    if kind == "channels last":
        return [
            t[: 4 * 16 * 16 * 16].view(4, 16, 16, 16).contiguous(memory_format=torch.channels_last)
            for t in base
        ]
    if kind == "transposed":
        return [t[: 250 * 250].view(250, 250).t() for t in base]
    if kind == "permuted image":  # HWC to CHW, as torchvision's pil_to_tensor gives it
        return [
            (t[: 3 * 96 * 96] * 100).to(torch.uint8).view(96, 96, 3).permute(2, 0, 1) for t in base
        ]
    if kind == "channels last 3d":
        return [
            t[: 2 * 4 * 8 * 8 * 8]
            .view(2, 4, 8, 8, 8)
            .contiguous(memory_format=torch.channels_last_3d)
            for t in base
        ]
    if kind == "mixed layouts":  # torch keeps a layout only that every sample shares
        plain = [t[: 4 * 16 * 16 * 16].view(4, 16, 16, 16) for t in base]
        return [plain[0].contiguous(memory_format=torch.channels_last), plain[1], plain[2]]
    if kind == "expanded":
        return [t[:300].expand(300, 300) for t in base]
    if kind == "complex":
        return [torch.complex(t, -t) for t in base]
    if kind == "dict":
        return [{"x": t, "y": i, "name": f"s{i}"} for i, t in enumerate(base)]
    if kind == "nan":
        return [t.masked_fill(t > 1, float("nan")) for t in base]
    raise AssertionError(kind)


class _Tagged(torch.Tensor):
    pass


TENSOR_KINDS = [
    "float32",
    "mixed dtypes",
    "int and bool",
    "shape mismatch",
    "requires grad",
    "parameter",
    "subclass",
    "channels last",
    "channels last 3d",
    "mixed layouts",
    "permuted image",
    "transposed",
    "expanded",
    "complex",
    "dict",
    "nan",
]


_GRAD_MODES = {
    "grad": lambda: torch.set_grad_enabled(True),
    "no_grad": torch.no_grad,
    "inference": torch.inference_mode,
}


@pytest.mark.parametrize("kind", TENSOR_KINDS)
@pytest.mark.parametrize("mode", _GRAD_MODES)
def test_large_tensor_batches_match_torch_in_and_outside_a_loader(kind: str, mode: str) -> None:
    samples = _big_samples(kind)
    with _GRAD_MODES[mode]():
        expected = outcome(lambda: tud.default_collate(samples))
        assert_same_outcome(expected, outcome(lambda: ferry.default_collate(samples)), "outside")
        assert_same_outcome(expected, outcome(lambda: _in_loader(tud, samples)), "torch loader")
        assert_same_outcome(expected, outcome(lambda: _in_loader(ferry, samples)), "ferry loader")


# torch's workers fail on these (their stack into shared memory takes out=, which autograd
# refuses); ferry's stack as outside a worker and hand back a batch that records autograd.
_WORKERS_DIFFER = {"requires grad", "parameter"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", TENSOR_KINDS)
def test_large_tensor_batches_match_torchs_workers(kind: str) -> None:
    """In a worker torch stacks into new contiguous memory of the first sample's dtype: a
    channels-last batch comes out contiguous, mixed dtypes are cast to the first's, not
    promoted, and a dtype that cannot be cast fails. ferry's process and thread workers give
    what torch's process workers give."""
    samples = _big_samples(kind)
    expected = outcome(lambda: _in_loader(tud, samples, num_workers=1))
    for worker_type in ("process", "thread"):
        got = outcome(lambda: _in_loader(ferry, samples, num_workers=1, worker_type=worker_type))
        if kind in _WORKERS_DIFFER:
            assert isinstance(expected, Raised)
            assert not isinstance(got, Raised)
            assert_same(outcome(lambda: tud.default_collate(samples)), got, worker_type)
        else:
            assert_same_outcome(expected, got, worker_type)


def test_a_dtype_a_worker_cannot_cast_to_says_which_sample_and_why() -> None:
    samples = [torch.ones(BIG) > 0, torch.ones(BIG, dtype=torch.int64)]
    with pytest.raises(TypeError, match="can't be cast to the desired output type") as caught:
        _in_loader(ferry, samples, num_workers=1, worker_type="thread")
    assert "first sample's dtype (torch.bool)" in str(caught.value)
    assert "sample 1 is torch.int64" in str(caught.value)


def test_a_batch_of_permuted_images_is_stacked_into_the_loaders_memory() -> None:
    """Samples that share one layout torch stacks contiguously (HWC images seen as CHW) are
    stacked straight into the loader's buffer, not stacked anew and copied in; samples whose
    layout torch keeps (channels-last), or that mix layouts, are stacked as torch stacks them."""
    from ferry._core.alloc import BufferPool, using_allocator

    for kind, pooled in (("permuted image", 1), ("channels last", 0), ("mixed layouts", 0)):
        samples = _big_samples(kind)
        pool = BufferPool(min_bytes=1)
        with using_allocator(pool):
            batch = ferry.default_collate(samples)
        assert_same(tud.default_collate(samples), batch, kind)
        assert len(pool) == pooled, kind


def test_grad_flows_through_a_collated_batch() -> None:
    for module in MODULES:
        leaves = [torch.ones(BIG, requires_grad=True) for _ in range(2)]
        batch = _in_loader(module, leaves)
        batch.sum().backward()
        assert all(torch.equal(leaf.grad, torch.ones(BIG)) for leaf in leaves)


def test_loader_batches_stay_intact_while_later_batches_are_made() -> None:
    """Every batch kept by the user keeps its values while the loader makes the next ones (a
    pooled buffer must not be reused while a batch, or a view of it, is alive)."""
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randn(BIG, generator=generator) for _ in range(12)]
    for module in MODULES:
        kept = []
        for position, batch in enumerate(module.DataLoader(samples, batch_size=2)):
            kept.append(batch[0] if position % 2 else batch)
        for position, kept_batch in enumerate(kept):
            start = 2 * position
            expected = samples[start] if position % 2 else torch.stack(samples[start : start + 2])
            assert torch.equal(kept_batch, expected), (module.__name__, position)


def test_loader_batch_storage_can_be_resized_like_torch() -> None:
    samples = [torch.zeros(BIG) for _ in range(2)]

    def grow(module: Any) -> Any:
        batch = _in_loader(module, samples)
        batch.resize_(2, BIG + 10)
        return batch.shape

    expected, got = outcome(lambda: grow(tud)), outcome(lambda: grow(ferry))
    assert_same_outcome(expected, got)


# -- collate_fn_map ------------------------------------------------------------------------------


class Base:
    def __init__(self, value: int) -> None:
        self.value = value


class Child(Base):
    pass


class GrandChild(Child):
    pass


def _tagging(tag: str) -> Callable[..., Any]:
    def fn(batch: Any, *, collate_fn_map: Any = None) -> Any:
        return (tag, [b.value for b in batch], collate_fn_map is not None)

    return fn


@pytest.mark.parametrize(
    ("fn_map", "sample", "expected_tag"),
    [
        ({Base: _tagging("base"), Child: _tagging("child")}, Child(1), "child"),
        ({Child: _tagging("child"), Base: _tagging("base")}, GrandChild(1), "child"),
        ({Base: _tagging("base"), Child: _tagging("child")}, GrandChild(1), "base"),
        ({(int, Base): _tagging("tuple key")}, Child(1), "tuple key"),
        ({object: _tagging("object")}, Base(1), "object"),
    ],
)
def test_collate_fn_map_lookup(fn_map: dict[Any, Any], sample: Any, expected_tag: str) -> None:
    batch = [sample, type(sample)(2)]
    expected = torch_collate.collate(batch, collate_fn_map=fn_map)
    got = ferry.collate(batch, collate_fn_map=fn_map)
    assert got == expected == (expected_tag, [1, 2], True)


def test_collate_fn_map_is_passed_down_to_nested_functions() -> None:
    seen = []

    def record(batch: Any, *, collate_fn_map: Any) -> Any:
        seen.append(collate_fn_map)
        return len(batch)

    fn_map = {Base: record}
    out = ferry.collate([{"a": [Base(1)]}, {"a": [Base(2)]}], collate_fn_map=fn_map)
    assert out == {"a": [2]}
    assert seen == [fn_map]


def test_collate_without_a_map_walks_structure_only() -> None:
    batch = [{"a": (1, 2)}, {"a": (3, 4)}]
    _assert_both(lambda m: m.collate(batch, collate_fn_map=None))
    with pytest.raises(TypeError):
        ferry.collate(batch, collate_fn_map=None)


def test_default_collate_fn_map_matches_torch() -> None:
    expected = list(torch_collate.default_collate_fn_map)
    assert list(ferry.default_collate_fn_map) == expected
    for key, fn in ferry.default_collate_fn_map.items():
        assert fn.__name__ == torch_collate.default_collate_fn_map[key].__name__
        assert inspect.signature(fn).parameters.keys() == {"batch", "collate_fn_map"}


def test_extending_default_collate_fn_map(extend_collate_maps: None) -> None:
    ferry.default_collate_fn_map[Base] = _tagging("custom")
    assert ferry.default_collate([Base(1), Base(2)]) == ("custom", [1, 2], True)
    assert ferry.default_collate([{"k": Child(3)}, {"k": Child(4)}]) == {
        "k": ("custom", [3, 4], True)
    }
    loader = ferry.DataLoader([Base(5), Base(6), Base(7)], batch_size=2)
    assert list(loader) == [("custom", [5, 6], True), ("custom", [7], True)]


def _times_hundred(batch: Any, *, collate_fn_map: Any = None) -> Any:
    return torch.stack(list(batch), 0) * 100


def _tuple_marker(batch: Any, *, collate_fn_map: Any = None) -> Any:
    return ("tuples", len(batch))


@pytest.mark.parametrize(
    "batch_sampler", [False, True], ids=["batch_size", "batch_sampler of lists"]
)
@pytest.mark.parametrize(
    ("key", "fn"), [(torch.Tensor, _times_hundred), (tuple, _tuple_marker)], ids=["Tensor", "tuple"]
)
def test_extended_default_collate_fn_map_applies_to_tensor_datasets(
    extend_collate_maps: None, key: type, fn: Callable[..., Any], batch_sampler: bool
) -> None:
    """Extending ``default_collate_fn_map`` is the documented way to change how
    ``default_collate`` batches a type; the loader must honour it for every dataset."""
    torch_collate.default_collate_fn_map[key] = fn
    ferry.default_collate_fn_map[key] = fn
    x, y = torch.arange(12.0).view(6, 2), torch.arange(6)

    def build(module: Any) -> Any:
        ds = module.TensorDataset(x, y)
        if batch_sampler:
            return module.DataLoader(ds, batch_sampler=[[0, 1, 2], [5, 4]])
        return module.DataLoader(ds, batch_size=4)

    differential(build)
    assert_same(tud.default_collate([(x[0], y[0])]), ferry.default_collate([(x[0], y[0])]))


# -- the public per-type functions ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "collate_tensor_fn",
        "collate_numpy_array_fn",
        "collate_numpy_scalar_fn",
        "collate_float_fn",
        "collate_int_fn",
        "collate_str_fn",
    ],
)
def test_per_type_functions_match_torch_signatures(name: str) -> None:
    def shape(fn: Any) -> list[tuple[str, Any, Any]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert shape(getattr(ferry_collate, name)) == shape(getattr(torch_collate, name))


def test_collate_signature_matches_torch() -> None:
    def shape(fn: Any) -> list[tuple[str, Any, Any]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert shape(ferry.collate) == shape(torch_collate.collate)
    assert shape(ferry.default_collate) == shape(torch_collate.default_collate)
    assert shape(ferry.default_convert) == shape(torch_collate.default_convert)


def test_default_convert_keeps_tensors_and_other_objects() -> None:
    tensor = torch.zeros(2)
    assert ferry.default_convert(tensor) is tensor
    marker = object()
    assert ferry.default_convert(marker) is marker
    assert ferry.default_convert("text") == "text"
    _assert_both(lambda m: m.default_convert((np.zeros(2), "a", (1, np.int8(2)))))
