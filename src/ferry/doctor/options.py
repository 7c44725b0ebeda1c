"""A loader's options as a dict: read off a ferry or torch loader, changed, built again.

One helper serves both uses the doctor has for it: building the ``ferry.DataLoader`` that is
equivalent to a torch loader (for its per-stage statistics), and building the variants that
``--try`` measures (the same options with the advised ones replaced).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from ferry.datasets import is_iterable_style
from ferry.loader import DataLoader

__all__ = ["build_loader", "describe", "loader_options", "plain_options", "with_changes"]

# The options that say how samples are drawn and batched. A loader keeps what it built from
# them (its sampler and batch sampler), not the options themselves: see _batching.
_BATCHING = frozenset({"dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"})

# torch's own collate functions stand for "no collate_fn given": ferry then uses its own, which
# builds the same batches on its faster path. Known by name: ferry's library code does not
# import torch.utils.data (tests/test_public_api.py).
_TORCH_DEFAULTS = frozenset(
    ("torch.utils.data._utils.collate", name) for name in ("default_collate", "default_convert")
)

# Shown by describe(), in this order, when they differ from the default.
_DESCRIBED = (
    "batch_size",
    "num_workers",
    "worker_type",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory",
    "balance_workers",
    "move_workers",
)


def _copied_parameters() -> list[inspect.Parameter]:
    """ferry.DataLoader's parameters other than the batching ones: each is kept by the loader
    as an attribute of the same name (torch's loader does the same for the ones it has)."""
    parameters = inspect.signature(DataLoader.__init__).parameters.values()
    return [p for p in parameters if p.name != "self" and p.name not in _BATCHING]


def _batching(loader: Any) -> dict[str, Any]:
    """The batching options that rebuild ``loader``'s sampler and batch sampler.

    A loader given ``batch_size`` made its batch sampler from its sampler, so those two and
    ``drop_last`` rebuild it; a loader given a ``batch_sampler`` has ``batch_size=None`` and
    keeps that batch sampler; batching off has neither. A stream has no sampler to pass.
    """
    if is_iterable_style(loader.dataset):
        return {"batch_size": loader.batch_size, "drop_last": loader.drop_last}
    if loader.batch_size is not None:
        return {
            "batch_size": loader.batch_size,
            "sampler": loader.sampler,
            "drop_last": loader.drop_last,
        }
    if loader.batch_sampler is not None:
        return {"batch_sampler": loader.batch_sampler}
    return {"batch_size": None, "sampler": loader.sampler}


def loader_options(loader: Any) -> dict[str, Any]:
    """The keyword arguments of a ``ferry.DataLoader`` equivalent to ``loader`` (ferry's or
    torch's): the same dataset, sampling, batching, collate function and worker options.

    Options the loader does not keep as an attribute of the same name keep their default
    (a torch loader has no ``worker_type``: it gets ferry's default, process workers).
    """
    options: dict[str, Any] = {"dataset": loader.dataset, **_batching(loader)}
    for parameter in _copied_parameters():
        if hasattr(loader, parameter.name):
            options[parameter.name] = getattr(loader, parameter.name)
    collate_fn = options.get("collate_fn")
    name = (getattr(collate_fn, "__module__", None), getattr(collate_fn, "__qualname__", None))
    if name in _TORCH_DEFAULTS:
        options["collate_fn"] = None
    return options


def with_changes(options: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with ``changes`` applied, and the options that only mean something with
    workers reset when the result has none (ferry refuses them with ``num_workers=0``), or
    with process workers when they became threads."""
    changed = {**options, **changes}
    if not changed.get("num_workers"):
        changed.update(
            prefetch_factor=None,
            persistent_workers=False,
            multiprocessing_context=None,
            timeout=0,
            balance_workers=False,
            move_workers=None,
        )
    if changed.get("worker_type") == "thread" and changed.get("move_workers"):
        changed["move_workers"] = None
    return changed


def build_loader(options: Mapping[str, Any]) -> DataLoader[Any]:
    """A new ``ferry.DataLoader`` from options as :func:`loader_options` gives them."""
    return DataLoader(**options)


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def describe(options: Mapping[str, Any]) -> str:
    """``"SlowImages, batch_size=32, num_workers=2, worker_type='thread'"``: the dataset's type
    and the options that matter for speed, where they differ from the defaults."""
    workers = bool(options.get("num_workers"))
    parts = [type(options["dataset"]).__name__]
    for name in _DESCRIBED:
        if name in ("worker_type", "prefetch_factor", "persistent_workers") and not workers:
            continue
        value = options.get(name)
        if name in ("batch_size", "num_workers") or value not in (None, False, "process"):
            parts.append(f"{name}={_shown(value)}")
    if options.get("batch_sampler") is not None:
        parts.append(f"batch_sampler={type(options['batch_sampler']).__name__}")
    return ", ".join(parts)


def plain_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options as plain data for ``--json``: numbers, strings, booleans and None as they
    are, functions by their name, other objects (dataset, sampler) by their type's name."""
    plain: dict[str, Any] = {}
    for name, value in options.items():
        if value is None or isinstance(value, (bool, int, float, str)):
            plain[name] = value
        else:
            plain[name] = getattr(value, "__qualname__", None) or type(value).__name__
    return plain
