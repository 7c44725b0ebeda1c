"""The structure walk shared by default_convert and pinning: containers are rebuilt the way
torch rebuilds them, leaves go through the function once each, inputs are never mutated."""

from __future__ import annotations

import collections
import copy
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data._utils.collate import default_convert as torch_default_convert

from _support.compare import HYPOTHESIS, assert_same, stable_id
from _support.strategies import (
    CONTAINERS,
    FixedRow,
    FrozenMapping,
    Pair,
    RebuildableMapping,
    Record,
    Row,
    build_container,
)
from _support.torch_versions import needs_torch
from ferry._structure import is_namedtuple, map_structure, rebuild_mapping, rebuild_sequence

pytestmark = pytest.mark.usefixtures("guard_global_state")


class Leaf:
    """A leaf value that the walk must pass to the function, never look inside."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return type(other) is Leaf and other.value == self.value

    __hash__ = None  # type: ignore[assignment]


def structures(leaf: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Nested containers of every kind the collate tests use, with ``leaf`` values, strings
    and bytes at the leaves."""
    leaves = leaf | st.text(max_size=2) | st.binary(max_size=2)

    def extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        kinds = st.sampled_from(CONTAINERS)
        return st.tuples(kinds, st.lists(children, min_size=1, max_size=3)).map(
            lambda kc: build_container(kc[0], kc[1])
        )

    return st.recursive(leaves, extend, max_leaves=8)


def _array_to_tensor(leaf: Any) -> Any:
    return torch.as_tensor(leaf) if isinstance(leaf, np.ndarray) else leaf


@needs_torch("2.5", "the containers conversion keeps")
@HYPOTHESIS
@given(data=structures(st.integers(0, 9).map(lambda v: np.array([v]))))
def test_map_structure_rebuilds_containers_like_torchs_default_convert(data: Any) -> None:
    """With numpy arrays at the leaves, torch's default_convert is the oracle of the walk."""
    expected = torch_default_convert(copy.deepcopy(data))
    got = map_structure(copy.deepcopy(data), _array_to_tensor)
    assert_same(expected, got)


@HYPOTHESIS
@given(data=structures(st.integers(0, 9).map(Leaf)))
def test_every_leaf_is_visited_once_and_inputs_are_not_mutated(data: Any) -> None:
    snapshot = copy.deepcopy(data)
    visited: list[Any] = []

    def visit(leaf: Any) -> Any:
        visited.append(leaf)
        return ("seen", leaf)

    map_structure(data, visit)
    assert_same(snapshot, data)
    assert all(isinstance(leaf, (Leaf, str, bytes)) for leaf in visited)

    def count(value: Any) -> int:
        if isinstance(value, (str, bytes, Leaf)):
            return 1
        items = value.values() if isinstance(value, collections.abc.Mapping) else value
        return sum(count(v) for v in items)

    assert len(visited) == count(data)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ((Leaf(1), Leaf(2)), [("x", 1), ("x", 2)]),
        ([Leaf(1)], [("x", 1)]),
        (Pair(Leaf(1), Leaf(2)), Pair(("x", 1), ("x", 2))),
        ({"a": (Leaf(1),)}, {"a": [("x", 1)]}),
        ("text", "text"),
        (b"raw", b"raw"),
        (range(2), [0, 1]),
        (Leaf(3), ("x", 3)),
    ],
    ids=stable_id,
)
def test_map_structure_examples(data: Any, expected: Any) -> None:
    def leaf(value: Any) -> Any:
        return ("x", value.value) if isinstance(value, Leaf) else value

    assert_same(expected, map_structure(data, leaf))


def test_strings_are_leaves() -> None:
    seen: list[Any] = []
    map_structure(["ab", b"cd"], seen.append)
    assert seen == ["ab", b"cd"]


def test_is_namedtuple() -> None:
    assert is_namedtuple(Pair(1, 2))
    assert not is_namedtuple((1, 2))
    assert not is_namedtuple([1, 2])

    class Fielded:
        _fields = ("a",)

    assert not is_namedtuple(Fielded())


def test_rebuild_mapping() -> None:
    record = Record(tag="kept")
    record["a"] = 1
    rebuilt = rebuild_mapping(record, {"a": 2})
    assert type(rebuilt) is Record
    assert rebuilt.tag == "kept"
    assert rebuilt["a"] == 2
    assert record["a"] == 1
    ordered = rebuild_mapping(collections.OrderedDict(b=1, a=2), {"b": 3, "a": 4})
    assert_same(collections.OrderedDict(b=3, a=4), ordered)
    defaults = rebuild_mapping(collections.defaultdict(int, a=1), {"a": 5})
    assert type(defaults) is collections.defaultdict
    assert defaults.default_factory is int
    assert_same(
        RebuildableMapping({"a": 9}), rebuild_mapping(RebuildableMapping({"a": 1}), {"a": 9})
    )
    assert_same({"a": 9}, rebuild_mapping(FrozenMapping({"a": 1}, "t"), {"a": 9}))


def test_rebuild_sequence() -> None:
    class Tagged(list):
        tag = "t"

    original = Tagged([1, 2])
    rebuilt = rebuild_sequence(original, [3, 4])
    assert type(rebuilt) is Tagged
    assert rebuilt == [3, 4]
    assert original == [1, 2]
    assert_same(Row([5]), rebuild_sequence(Row([1]), [5]))
    assert_same([5], rebuild_sequence(FixedRow([1], "t"), [5]))
    assert_same([5, 6], rebuild_sequence(range(2), [5, 6]))
