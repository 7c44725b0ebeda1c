"""Copying batches into page-locked (pinned) host memory for fast transfer to an accelerator."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ferry._structure import map_structure

__all__ = ["accelerator_available", "pin_batch"]


def accelerator_available() -> bool:
    """Whether pinning means anything here: an accelerator (CUDA, XPU, MPS, ...) is present."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None:
        return bool(accelerator.is_available())
    return bool(torch.cuda.is_available())


def _pin_leaf(value: Any, device: str) -> Any:
    if isinstance(value, torch.Tensor):
        if not device:
            return value.pin_memory()
        with warnings.catch_warnings():
            # Naming the device is deprecated in recent torch but still what the user asked for.
            warnings.simplefilter("ignore", DeprecationWarning)
            return value.pin_memory(device)
    pin = getattr(value, "pin_memory", None)
    if callable(pin):
        return pin()
    return value


def pin_batch(batch: Any, device: str = "") -> Any:
    """``batch`` with its tensors in pinned memory; custom types pin through their own
    ``pin_memory()`` method, containers are rebuilt as collate builds them."""
    if isinstance(batch, torch.Tensor):
        return _pin_leaf(batch, device)
    return map_structure(batch, lambda leaf: _pin_leaf(leaf, device))
