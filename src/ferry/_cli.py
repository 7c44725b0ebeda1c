"""What ferry's command-line tools (``python -m ferry bench``, ``python -m ferry doctor``)
share: argument types and the check of an output path before a long run."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["non_negative", "positive_int", "prepare_output", "seconds"]


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
