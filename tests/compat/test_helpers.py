"""The comparator must catch every kind of difference, or the differential tests prove nothing."""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest
import torch

from _support.compare import Raised, assert_same, assert_same_outcome, outcome

pytestmark = pytest.mark.usefixtures("guard_global_state")

Point = collections.namedtuple("Point", ["x", "y"])


def _inference_zeros() -> torch.Tensor:
    with torch.inference_mode():
        return torch.zeros(2)


def test_equal_values_pass() -> None:
    value = {
        "t": torch.tensor([1.0, float("nan"), -0.0]),
        "c": torch.tensor([1 + 2j, complex(float("nan"), 1)]),
        "a": np.array([1.0, np.nan]),
        "p": Point(1, "s"),
        "l": [b"x", 2.5, float("nan"), np.float32(np.nan), None],
    }
    assert_same(value, dict(value))


@pytest.mark.parametrize(
    ("expected", "got"),
    [
        ([1, 2], (1, 2)),
        ((1, 2), Point(1, 2)),
        ({"a": 1}, collections.OrderedDict(a=1)),
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
        ([1, 2], [1, 2, 3]),
        (1, 1.0),
        (True, 1),
        ("a", b"a"),
        (0.0, -0.0),
        (float("nan"), 1.0),
        (np.int64(1), np.int32(1)),
        (np.float64(np.nan), np.float64(1.0)),
        (torch.tensor([1, 2]), torch.tensor([1, 2], dtype=torch.int32)),
        (torch.tensor([1, 2]), torch.tensor([[1, 2]])),
        (torch.tensor([1, 2]), torch.tensor([1, 3])),
        (torch.tensor([1.0, float("nan")]), torch.tensor([float("nan"), 1.0])),
        (torch.tensor([0.0]), torch.tensor([-0.0])),
        (torch.tensor([1 + 1j]), torch.tensor([1 - 1j])),
        (torch.zeros(2, 3), torch.zeros(3, 2).t()),
        (torch.zeros(2), torch.zeros(2, requires_grad=True)),
        (torch.zeros(2), torch.nn.Parameter(torch.zeros(2))),
        (torch.zeros(2), _inference_zeros()),
        (np.array([1, 2]), np.array([1, 2], dtype=np.int32)),
        (np.array([1.0, np.nan]), np.array([1.0, 2.0])),
        (np.array(["a"]), np.array(["b"])),
        ({"a": [torch.tensor(1)]}, {"a": [torch.tensor(2)]}),
    ],
)
def test_differences_are_caught(expected: object, got: object) -> None:
    with pytest.raises(AssertionError):
        assert_same(expected, got)


def test_outcomes_compare_exception_types() -> None:
    def raise_value() -> None:
        raise ValueError("v")

    def raise_type() -> None:
        raise TypeError("t")

    value_error, type_error = outcome(raise_value), outcome(raise_type)
    assert isinstance(value_error, Raised)
    assert value_error.type is ValueError
    assert_same_outcome(value_error, outcome(raise_value))
    with pytest.raises(AssertionError):
        assert_same_outcome(value_error, type_error)
    with pytest.raises(AssertionError):
        assert_same_outcome(value_error, 1)
    with pytest.raises(AssertionError):
        assert_same_outcome(1, type_error)
    assert_same_outcome(outcome(lambda: math.pi), outcome(lambda: math.pi))
