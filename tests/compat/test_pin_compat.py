"""How a batch is rebuilt when it is pinned, against torch's ``pin_memory`` function.

Pinning a tensor needs an accelerator, but the walk over the batch's containers does not: with
leaves that pin themselves through a ``pin_memory()`` method (the documented hook for custom
types) both functions can be compared on any machine. A loader with ``pin_memory=True`` yields
what this walk returns, so its container types are what users see.
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory

from _support.compare import HYPOTHESIS, assert_same, stable_id
from _support.strategies import CONTAINERS, Pair, Record, build_container
from _support.torch_versions import needs_torch
from ferry._engine.transport.pin import pin_batch

pytestmark = pytest.mark.usefixtures("guard_global_state")


class Pinnable:
    """A custom batch element with its own ``pin_memory()``."""

    def __init__(self, value: int, pinned: bool = False) -> None:
        self.value = value
        self.pinned = pinned

    def pin_memory(self) -> Pinnable:
        return Pinnable(self.value, pinned=True)

    def __eq__(self, other: object) -> bool:
        return type(other) is Pinnable and other.value == self.value and other.pinned == self.pinned

    def __repr__(self) -> str:
        return f"Pinnable({self.value}, pinned={self.pinned})"

    __hash__ = None  # type: ignore[assignment]


class PinnableRecord(dict):  # type: ignore[type-arg]
    """A mapping batch type that pins itself as a whole."""

    def pin_memory(self) -> str:
        return "pinned as a whole"


class PinnableList(list):  # type: ignore[type-arg]
    def pin_memory(self) -> str:
        return "pinned as a whole"


def _structures() -> st.SearchStrategy[Any]:
    leaves = st.integers(0, 9).map(Pinnable) | st.integers() | st.text(max_size=2)

    def extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        kinds = st.sampled_from(CONTAINERS)
        return st.tuples(kinds, st.lists(children, min_size=1, max_size=3)).map(
            lambda kc: build_container(kc[0], kc[1])
        )

    return st.recursive(leaves, extend, max_leaves=8)


@needs_torch("2.13", "the batches pinning rebuilds")
@HYPOTHESIS
@given(batch=_structures())
@pytest.mark.slow
def test_pinning_rebuilds_batches_like_torch(batch: Any) -> None:
    expected = torch_pin_memory(copy.deepcopy(batch))
    got = pin_batch(copy.deepcopy(batch))
    assert_same(expected, got)


@needs_torch("2.13", "the batches pinning rebuilds")
@pytest.mark.parametrize(
    "batch",
    [
        (Pinnable(1), Pinnable(2)),
        [Pinnable(1), (Pinnable(2), "s")],
        {"x": (Pinnable(1), 2)},
        collections.OrderedDict(x=(1,)),
        Pair(Pinnable(1), (2, 3)),
        PinnableRecord(a=Pinnable(1)),
        [PinnableList([Pinnable(1)])],
        Pinnable(3),
        "text",
        range(3),
    ],
    ids=stable_id,
)
def test_pinning_examples_match_torch(batch: Any) -> None:
    assert_same(torch_pin_memory(copy.deepcopy(batch)), pin_batch(copy.deepcopy(batch)))


def test_pinning_does_not_mutate_the_batch() -> None:
    record = Record()
    record["x"] = Pinnable(1)
    pinned = pin_batch(record)
    assert record["x"] == Pinnable(1)
    assert pinned["x"] == Pinnable(1, pinned=True)
