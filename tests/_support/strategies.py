"""Hypothesis strategies for samples as datasets return them: nested containers of tensors,
numpy arrays and scalars, Python numbers, strings and bytes.

A *schema* fixes the structure, the container types, every tensor's dtype and shape; a batch is
then a list of samples drawn from one schema (as a dataset's samples share their structure).
Every container type here is defined at module level so torch and ferry see the same classes.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

# -- container types that samples use ----------------------------------------------------------

Pair = collections.namedtuple("Pair", ["first", "second"])
Triple = collections.namedtuple("Triple", ["a", "b", "c"])
Single = collections.namedtuple("Single", ["only"])
NAMEDTUPLES = {1: Single, 2: Pair, 3: Triple}


class FrozenMapping(Mapping[str, Any]):
    """A read-only mapping whose constructor needs more than the items: it cannot be rebuilt
    from a dict, so collate falls back to a plain dict."""

    def __init__(self, items: dict[str, Any], tag: str) -> None:
        self._items = dict(items)
        self.tag = tag

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class RebuildableMapping(Mapping[str, Any]):
    """A read-only mapping built from a dict: collate rebuilds the same type."""

    def __init__(self, items: dict[str, Any]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and dict(self) == dict(other)  # type: ignore[call-overload]

    __hash__ = None  # type: ignore[assignment]


class Record(MutableMapping[str, Any]):
    """A mutable mapping with an extra attribute: collate copies it and updates the copy."""

    def __init__(self, tag: str = "record") -> None:
        self._items: dict[str, Any] = {}
        self.tag = tag

    def __copy__(self) -> Record:
        clone = Record(self.tag)
        clone._items = dict(self._items)
        return clone

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._items[key] = value

    def __delitem__(self, key: str) -> None:
        del self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class Row(Sequence[Any]):
    """An immutable sequence built from a list: collate rebuilds the same type."""

    def __init__(self, items: list[Any]) -> None:
        self._items = list(items)

    def __getitem__(self, index: Any) -> Any:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and list(self) == list(other)  # type: ignore[call-overload]

    __hash__ = None  # type: ignore[assignment]


class FixedRow(Sequence[Any]):
    """An immutable sequence that cannot be built from a list alone (its constructor needs a
    tag too): collate falls back to a list."""

    def __init__(self, items: list[Any], tag: str) -> None:
        self._items = list(items)
        self.tag = tag

    def __getitem__(self, index: Any) -> Any:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)


def _default_list() -> list[Any]:
    return []


def build_container(kind: str, children: list[Any]) -> Any:
    keys = [f"k{i}" for i in range(len(children))]
    if kind == "list":
        return list(children)
    if kind == "tuple":
        return tuple(children)
    if kind == "namedtuple":
        return NAMEDTUPLES[len(children)](*children)
    if kind == "dict":
        return dict(zip(keys, children, strict=True))
    if kind == "reversed_dict":
        return dict(zip(reversed(keys), children, strict=True))
    if kind == "ordered":
        return collections.OrderedDict(zip(keys, children, strict=True))
    if kind == "defaultdict":
        return collections.defaultdict(_default_list, zip(keys, children, strict=True))
    if kind == "frozen_mapping":
        return FrozenMapping(dict(zip(keys, children, strict=True)), tag="t")
    if kind == "rebuildable_mapping":
        return RebuildableMapping(dict(zip(keys, children, strict=True)))
    if kind == "record":
        record = Record()
        record.update(zip(keys, children, strict=True))
        return record
    if kind == "row":
        return Row(children)
    if kind == "fixed_row":
        return FixedRow(children, tag="t")
    raise AssertionError(kind)


CONTAINERS = [
    "list",
    "tuple",
    "namedtuple",
    "dict",
    "reversed_dict",
    "ordered",
    "defaultdict",
    "frozen_mapping",
    "rebuildable_mapping",
    "record",
    "row",
    "fixed_row",
]

TORCH_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
]

NUMPY_DTYPES = [
    np.bool_,
    np.uint8,
    np.int8,
    np.int16,
    np.uint16,
    np.int32,
    np.uint32,
    np.int64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
]

shapes = st.lists(st.integers(0, 3), max_size=3).map(tuple)


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int, nan: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator, dtype=torch.float64) * 50
    if dtype == torch.bool:
        return values > 0
    tensor = torch.complex(values, -values) if dtype.is_complex else values
    tensor = tensor.to(dtype)
    if nan and (dtype.is_floating_point or dtype.is_complex) and tensor.numel():
        tensor.view(-1)[0] = float("nan")
    return tensor


def make_array(dtype: Any, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 50).astype(dtype)


# A schema is ("leaf", kind, params...) or ("container", kind, [child schemas]).
leaf_schemas = st.one_of(
    st.sampled_from(["int", "float", "bool", "str", "bytes", "number"]).map(lambda k: ("leaf", k)),
    st.tuples(st.just("leaf"), st.just("tensor"), st.sampled_from(TORCH_DTYPES), shapes),
    st.tuples(st.just("leaf"), st.just("ndarray"), st.sampled_from(NUMPY_DTYPES), shapes),
    st.tuples(st.just("leaf"), st.just("npscalar"), st.sampled_from(NUMPY_DTYPES)),
)


def _extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.tuples(
        st.just("container"),
        st.sampled_from(CONTAINERS),
        st.lists(children, min_size=1, max_size=3),
    )


schemas = st.recursive(leaf_schemas, _extend, max_leaves=6)


def sample_of(schema: Any) -> st.SearchStrategy[Any]:
    """Samples that follow ``schema``."""
    if schema[0] == "container":
        _, kind, children = schema
        return st.tuples(*(sample_of(c) for c in children)).map(
            lambda values, kind=kind: build_container(kind, list(values))
        )
    kind = schema[1]
    if kind == "int":
        return st.integers(-(2**40), 2**40)
    if kind == "float":
        return st.floats(allow_nan=True, allow_infinity=True, width=64)
    if kind == "bool":
        return st.booleans()
    if kind == "number":
        return st.integers(-100, 100) | st.floats(-100, 100) | st.booleans()
    if kind == "str":
        return st.text(max_size=4)
    if kind == "bytes":
        return st.binary(max_size=4)
    if kind == "tensor":
        _, _, dtype, shape = schema
        return st.builds(
            make_tensor, st.just(dtype), st.just(shape), st.integers(0, 999), st.booleans()
        )
    if kind == "ndarray":
        _, _, dtype, shape = schema
        return st.builds(make_array, st.just(dtype), st.just(shape), st.integers(0, 999))
    if kind == "npscalar":
        dtype = schema[2]
        return st.integers(0, 999).map(lambda seed, dtype=dtype: make_array(dtype, (), seed)[()])
    raise AssertionError(kind)


@st.composite
def batches(draw: st.DrawFn, max_size: int = 4) -> list[Any]:
    """A list of one to ``max_size`` samples that share one schema."""
    schema = draw(schemas)
    return draw(st.lists(sample_of(schema), min_size=1, max_size=max_size))
