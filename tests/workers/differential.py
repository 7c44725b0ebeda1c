"""The differential harness of the worker tests: torch (fork workers) is the oracle.

:func:`compare` builds the same loader with each library, iterates both from the same global RNG
state, and asserts identical batches (or the same exception type) and the same RNG state after.
torch's result does not depend on ferry's worker kind, so it is computed once per case.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.data as tud

import ferry
from _support.compare import Raised, assert_same_outcome, outcome, seed_cpu
from _support.processes import Kind

Build = Callable[[Any], tuple[Any, dict[str, Any]]]
"""``build(module) -> (dataset, loader kwargs)``, called once per library with ``tud`` or
``ferry`` so that samplers and generators are fresh objects of that library."""


def collect(loader: Any, epochs: int = 1, take: int | None = None) -> tuple[list[Any], Any]:
    """Every batch of ``epochs`` passes (at most ``take`` in the first), then a global draw."""
    passes = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for epoch in range(epochs):
            batches = []
            for position, batch in enumerate(loader):
                if epoch == 0 and take is not None and position >= take:
                    break
                batches.append(batch)
            passes.append(batches)
    return passes, torch.rand(1)


_TORCH_RESULTS: dict[Any, Any] = {}


def _cache_key(build: Build, *settings: Any) -> Any:
    """What determines torch's result: the build function, the values it closes over, and
    the loader settings (torch's result does not depend on ferry's worker kind)."""
    cells = tuple(repr(cell.cell_contents) for cell in build.__closure__ or ())
    return (build.__code__, cells, repr(settings))


def _torch_result(build: Build, seed: int, epochs: int, take: int | None, shared: Any) -> Any:
    key = _cache_key(build, seed, epochs, take, sorted(shared.items()))
    if key not in _TORCH_RESULTS:
        dataset, kwargs = build(tud)
        seed_cpu(seed)

        def run() -> bytes:
            loader = tud.DataLoader(dataset, **kwargs, **shared, multiprocessing_context="fork")
            # A copy through plain pickle: no tensor of the cache holds torch's shared memory.
            return pickle.dumps(collect(loader, epochs, take))

        _TORCH_RESULTS[key] = outcome(run)
    result = _TORCH_RESULTS[key]
    return result if isinstance(result, Raised) else pickle.loads(result)


def compare(
    build: Build,
    kind: Kind,
    *,
    seed: int = 0,
    epochs: int = 1,
    take: int | None = None,
    ferry_only: dict[str, Any] | None = None,
    **shared: Any,
) -> list[Any]:
    """Run torch (fork workers) and ferry (``kind``, and its own options ``ferry_only``) from
    the same RNG state; assert the same batches (or the same exception type) and the same RNG
    state after. Returns ferry's batches."""
    expected = _torch_result(build, seed, epochs, take, shared)
    dataset, kwargs = build(ferry)
    seed_cpu(seed)
    own = {**kind.kwargs, **(ferry_only or {})}
    got = outcome(
        lambda: collect(ferry.DataLoader(dataset, **kwargs, **shared, **own), epochs, take)
    )
    assert_same_outcome(expected, got, "torch vs ferry")
    return [] if isinstance(got, Raised) else got[0]
