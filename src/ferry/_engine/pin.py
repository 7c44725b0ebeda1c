"""Copying batches into page-locked (pinned) host memory for fast transfer to an accelerator."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ferry._structure import rebuild_mapping, rebuild_sequence

__all__ = ["accelerator_available", "pin_batch"]


def accelerator_available() -> bool:
    """Whether pinning means anything here: an accelerator (CUDA, XPU, MPS, ...) is present."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None:
        return bool(accelerator.is_available())
    return bool(torch.cuda.is_available())


def _pin_tensor(tensor: torch.Tensor, device: str) -> torch.Tensor:
    if not device:
        return tensor.pin_memory()
    with warnings.catch_warnings():
        # Naming the device is deprecated in recent torch but still what the user asked for.
        warnings.simplefilter("ignore", DeprecationWarning)
        return tensor.pin_memory(device)


def pin_batch(batch: Any, device: str = "") -> Any:
    """``batch`` with its tensors in pinned memory, rebuilt as torch rebuilds it.

    In torch's order: a tensor is pinned; any object with a ``pin_memory()`` method pins
    itself (containers too); str and bytes stay; mappings, tuples (namedtuples and plain, type
    kept) and sequences are rebuilt around pinned items; anything else is returned as is.
    """
    if isinstance(batch, torch.Tensor):
        return _pin_tensor(batch, device)
    if hasattr(batch, "pin_memory"):
        return batch.pin_memory()
    if isinstance(batch, (str, bytes)):
        return batch
    if isinstance(batch, Mapping):
        return rebuild_mapping(batch, {k: pin_batch(v, device) for k, v in batch.items()})
    if isinstance(batch, tuple):
        items = (pin_batch(v, device) for v in batch)
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    if isinstance(batch, Sequence):
        return rebuild_sequence(batch, [pin_batch(v, device) for v in batch])
    return batch
