"""Comparing results exactly: torch is the oracle of the differential tests, ferry must match it.

* :func:`assert_same` compares two values exactly: the type of every container and leaf, mapping
  keys and their order, tensors' type, dtype, shape, strides, device, ``requires_grad`` and
  values (NaN-aware, signed zeros told apart), numpy arrays' dtype/shape/values.
* :func:`canon` describes a batch exactly as a hashable value (types, dtypes, shapes, values),
  so batches can be compared with ``==`` and counted in multisets.
* :func:`outcome` runs a callable and records what it returned or the type of what it raised,
  so the two libraries can be compared also where they fail.
* :func:`run_epochs` iterates a loader the way a training loop does and records every batch and
  a draw from the global RNG afterwards (what the loader left of the RNG state).
* :class:`DuckMap`, :class:`DuckStream`, :func:`stream_dataset`, :func:`map_dataset`: datasets
  written once and built with either library.
* :data:`HYPOTHESIS` is the settings profile of every property test: deterministic, no example
  database on disk, no per-example deadline.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

try:
    import numpy as np
except ImportError:  # the run without numpy (make test-nonumpy): no value is an array there
    np = None  # type: ignore[assignment]
import torch
import torch.utils.data as tud
from hypothesis import HealthCheck, Phase, settings

import ferry

MODULES = (tud, ferry)
"""The oracle and the library under test, in that order."""

HYPOTHESIS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    # No "explain" phase: it reruns a failing test many times and adds tens of seconds.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


Names = tuple[str, str]
"""What the compared values are, in messages: by default torch's (expected) and ferry's."""
ORACLE: Names = ("torch", "ferry")


# numpy's array and scalar types, or none where numpy is not importable.
ARRAYS: tuple[type, ...] = () if np is None else (np.ndarray,)
NUMPY_SCALARS: tuple[type, ...] = () if np is None else (np.generic,)


def _fail(names: Names, path: str, what: str, a: Any, b: Any) -> AssertionError:
    return AssertionError(
        f"{path}: {what} differ:\n  expected ({names[0]}): {a!r}\n  got ({names[1]}): {b!r}"
    )


def _same_tensor(a: torch.Tensor, b: torch.Tensor, path: str, names: Names) -> None:
    for attr in ("dtype", "shape", "device", "layout", "requires_grad", "is_sparse"):
        if getattr(a, attr) != getattr(b, attr):
            raise _fail(names, path, f"tensor {attr}s", getattr(a, attr), getattr(b, attr))
    if a.is_inference() != b.is_inference():
        raise _fail(names, path, "inference-mode flags", a.is_inference(), b.is_inference())
    if a.layout == torch.strided and a.stride() != b.stride():
        raise _fail(names, path, "tensor strides", a.stride(), b.stride())
    a, b = a.detach(), b.detach()
    if a.is_nested or a.layout != torch.strided:
        if not torch.equal(a.to_dense(), b.to_dense()):
            raise _fail(names, path, "tensor values", a, b)
        return
    if a.dtype.is_floating_point or a.dtype.is_complex:
        views = [(a.real, b.real), (a.imag, b.imag)] if a.dtype.is_complex else [(a, b)]
        for x, y in views:
            nan_x, nan_y = torch.isnan(x), torch.isnan(y)
            if not torch.equal(nan_x, nan_y):
                raise _fail(names, path, "tensor NaN positions", a, b)
            if not torch.equal(x[~nan_x], y[~nan_y]):
                raise _fail(names, path, "tensor values", a, b)
            if not torch.equal(torch.signbit(x[~nan_x]), torch.signbit(y[~nan_y])):
                raise _fail(names, path, "tensor signs of zero", a, b)
    elif not torch.equal(a, b):
        raise _fail(names, path, "tensor values", a, b)


def _same_ndarray(a: np.ndarray, b: np.ndarray, path: str, names: Names) -> None:
    if a.dtype != b.dtype or a.shape != b.shape:
        raise _fail(names, path, "array dtypes/shapes", (a.dtype, a.shape), (b.dtype, b.shape))
    if not np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"):
        raise _fail(names, path, "array values", a, b)


def assert_same(expected: Any, got: Any, path: str = "value", names: Names = ORACLE) -> None:
    """Assert that ``got`` (ferry) is exactly ``expected`` (torch), recursively. ``names`` says
    in a failure's message what the two values are.

    Containers must be of the identical type (list is not tuple, a namedtuple is not a tuple,
    a dict is not an OrderedDict); mapping keys must be equal and in the same order.
    """
    if type(expected) is not type(got):
        raise _fail(names, path, "types", type(expected), type(got))
    if isinstance(expected, torch.Tensor):
        _same_tensor(expected, got, path, names)
    elif isinstance(expected, ARRAYS):
        _same_ndarray(expected, got, path, names)
    elif isinstance(expected, (str, bytes)):
        if expected != got:
            raise _fail(names, path, "values", expected, got)
    elif isinstance(expected, Mapping):
        if list(expected.keys()) != list(got.keys()):
            raise _fail(names, path, "mapping keys", list(expected.keys()), list(got.keys()))
        for key in expected:
            assert_same(expected[key], got[key], f"{path}[{key!r}]", names)
    elif isinstance(expected, Sequence):
        if len(expected) != len(got):
            raise _fail(names, path, "lengths", len(expected), len(got))
        for position, (x, y) in enumerate(zip(expected, got, strict=True)):
            assert_same(x, y, f"{path}[{position}]", names)
    elif isinstance(expected, float):
        same = (math.isnan(expected) and math.isnan(got)) or (
            expected == got and math.copysign(1, expected) == math.copysign(1, got)
        )
        if not same:
            raise _fail(names, path, "floats", expected, got)
    elif isinstance(expected, NUMPY_SCALARS):
        if not _same_scalar(expected, got):
            raise _fail(names, path, "numpy scalars", expected, got)
    elif expected != got:
        raise _fail(names, path, "values", expected, got)


def _same_scalar(a: np.generic, b: np.generic) -> bool:
    if a.dtype.kind in "fc":
        return bool(np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True))
    return bool(a == b)


@dataclass(frozen=True)
class Raised:
    """What :func:`outcome` records when the call raised."""

    type: type[BaseException]
    message: str


def stable_id(value: Any) -> str:
    """A test id from ``repr(value)`` without memory addresses, so that every process that
    collects the suite (pytest-xdist's workers) names the test alike."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def outcome(fn: Callable[[], Any]) -> Any:
    """``fn()``, or a :class:`Raised` naming the exception it raised."""
    try:
        return fn()
    except Exception as exc:  # the point is to record any failure
        return Raised(type(exc), str(exc))


def assert_same_outcome(expected: Any, got: Any, path: str = "outcome") -> None:
    """Both raised the identical exception type, or both returned the same value."""
    if isinstance(expected, Raised) or isinstance(got, Raised):
        if not (isinstance(expected, Raised) and isinstance(got, Raised)):
            raise _fail(ORACLE, path, "outcomes", expected, got)
        if expected.type is not got.type:
            raise _fail(ORACLE, path, "exception types", expected, got)
        return
    assert_same(expected, got, path)


def canon(value: Any) -> Any:
    """A hashable, exact description of a batch (types, dtypes, shapes and values kept), so
    batches can be compared for equality and counted in multisets."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), tuple(value.flatten().tolist()))
    if isinstance(value, ARRAYS):
        return ("ndarray", str(value.dtype), value.shape, tuple(value.flatten().tolist()))
    if isinstance(value, dict):
        return ("dict", tuple((k, canon(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(canon(v) for v in value))
    if isinstance(value, float):
        return ("float", value.hex())
    return (type(value).__name__, value)


def run_epochs(
    loader: Any, *, epochs: int = 1, take: int | None = None
) -> tuple[list[list[Any]], torch.Tensor, torch.Tensor | None]:
    """Every batch of ``epochs`` passes over ``loader`` (at most ``take`` per pass), then one
    draw from the global RNG and one from the loader's generator (if it has one): equal draws
    mean the loader consumed both identically."""
    passes = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(epochs):
            batches = []
            for position, batch in enumerate(loader):
                if take is not None and position >= take:
                    break
                batches.append(batch)
            passes.append(batches)
    generator = getattr(loader, "generator", None)
    own = None if generator is None else torch.rand(1, generator=generator)
    return passes, torch.rand(1), own


def seed_cpu(seed: int) -> None:
    """``torch.manual_seed(seed)`` as a program on a machine without an accelerator sees it:
    the CPU generator is seeded, the one both loaders draw from. torch's function also queues a
    seed for each accelerator backend it might initialise later, and each queued call formats
    the whole stack, pytest's included: 3-5 ms a call (34 of the 57 s that test_sdl_parity's
    relay cases took, in cProfile). The comparisons seed before each loader they build."""
    torch.default_generator.manual_seed(seed)


def differential(build: Callable[[Any], Any], *, seed: int = 0, **kwargs: Any) -> None:
    """Build a loader with each library (``build(module)``), iterate both from the same global
    RNG state, and assert identical batches, exceptions and RNG state afterwards."""
    results = []
    for module in MODULES:
        seed_cpu(seed)
        results.append(outcome(lambda module=module: run_epochs(build(module), **kwargs)))
    assert_same_outcome(results[0], results[1], "loader")


# -- datasets written once and used with both libraries -----------------------------------------


class DuckMap:
    """Map-style by protocol only: ``__getitem__`` and ``__len__``, no base class."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __getitem__(self, index: int) -> Any:
        return self.items[index]

    def __len__(self) -> int:
        return len(self.items)


class DuckGetitems(DuckMap):
    """Map-style with a batched ``__getitems__`` that marks what it returned."""

    def __init__(self, items: list[Any]) -> None:
        super().__init__(items)
        self.calls: list[list[Any]] = []

    def __getitems__(self, indices: list[int]) -> list[Any]:
        self.calls.append(list(indices))
        return [("batched", self.items[i]) for i in indices]


class DuckStream:
    """Iterable by protocol only: ``__iter__``, no base class."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __iter__(self) -> Any:
        return iter(self.items)


def stream_dataset(module: Any, items: list[Any], length: int | None = None) -> Any:
    """An ``IterableDataset`` of ``module`` that yields ``items`` and reports ``length``."""

    class Stream(module.IterableDataset):
        def __iter__(self) -> Any:
            return iter(items)

    class SizedStream(Stream):
        def __len__(self) -> int:
            assert length is not None
            return length

    return Stream() if length is None else SizedStream()


def map_dataset(module: Any, items: list[Any]) -> Any:
    """A ``Dataset`` subclass of ``module`` over ``items``."""

    class Items(module.Dataset):
        def __getitem__(self, index: int) -> Any:
            return items[index]

        def __len__(self) -> int:
            return len(items)

    return Items()
