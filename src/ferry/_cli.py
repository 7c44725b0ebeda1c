"""What ferry's command-line tools (``python -m ferry bench``, ``python -m ferry doctor``)
share: argument types, the check of an output path before a long run, the optional plotting
dependency, and a batch's walk (its leaves, its bytes). The two tools import each other
nothing: what both need lives here (tests/test_layers.py)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "MissingExtra",
    "batch_leaves",
    "batch_nbytes",
    "non_negative",
    "positive_int",
    "prepare_output",
    "require_matplotlib",
    "seconds",
]


def positive_int(text: str) -> int:
    """An argparse type: an integer > 0."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def seconds(text: str) -> float:
    """An argparse type: seconds >= 0 (0: no limit)."""
    return _not_negative(text, "seconds >= 0 (0: no limit)")


def non_negative(text: str) -> float:
    """An argparse type: a number >= 0."""
    return _not_negative(text, "a number >= 0")


def _not_negative(text: str, expected: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def prepare_output(path: Path | None, option: str) -> str | None:
    """Create ``path``'s directory up front, so a long run does not fail at the end; the
    problem, worded for option ``option``, or None."""
    if path is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"{option}: cannot create the directory of {str(path)!r}: {exc.strerror}"
    if path.is_dir():
        return f"{option}: {str(path)!r} is a directory"
    return None


class MissingExtra(Exception):
    """An optional dependency of a tool (``--plot``'s matplotlib) is not installed."""


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or :class:`MissingExtra`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingExtra(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(ferry-data's extra 'bench' has it)"
        ) from None
    return plt


def batch_leaves(batch: Any) -> Iterator[Any]:
    """A batch's leaves in order, with the keys of its mappings and the type names of its
    sequences (two batches of another structure walk differently)."""
    if isinstance(batch, Mapping):
        for key in batch:
            yield key
            yield from batch_leaves(batch[key])
    elif isinstance(batch, (list, tuple)):
        yield type(batch).__name__
        for item in batch:
            yield from batch_leaves(item)
    else:
        yield batch


def batch_nbytes(batch: Any) -> int:
    """Bytes held by the tensors (and arrays) of a batch; strings and numbers count nothing."""
    total = 0
    for leaf in batch_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            total += leaf.numel() * leaf.element_size()
        elif hasattr(leaf, "nbytes") and hasattr(leaf, "dtype"):
            total += int(leaf.nbytes)
    return total
