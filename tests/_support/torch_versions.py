"""Tests whose oracle is a behaviour older torch releases lack.

ferry behaves as torch 2.13 does (the development pin), whatever torch it runs with
(``pyproject.toml`` accepts torch 2.1 and later), and as 2.14 in the one thing 2.14 and 2.15
changed: a process worker lets go of its dataset when its loop ends (a test compares that with
torch's workers where torch is 2.14 or later). Most tests compare ferry with the installed
torch, so on an older torch a few compare ferry with a behaviour that torch did not have yet
(``DataLoader(in_order=...)``, a message reworded, a type kept by collation), or call a torch
API that did not exist yet. Each is marked :func:`needs_torch`: on an older torch it is skipped,
with a reason the skip guard accepts (``tests/conftest.py``); everything else runs there too.

``version`` is the oldest release the suite was run on that has the behaviour: the suite ran
on 2.1.2, 2.5.1, 2.6.0, 2.9.1, 2.13.0 and 2.15.0 (``scripts/test_torch.sh VERSION``; the
releases in between were not tried, so a behaviour marked 2.13 may have come in 2.10 to 2.12).
"""

from __future__ import annotations

import re

import pytest
import torch

__all__ = ["SKIP_PATTERN", "TORCH", "needs_torch"]


def _release(text: str) -> tuple[int, ...]:
    """``"2.5.1+cu124"`` -> ``(2, 5, 1)``."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        raise ValueError(f"not a torch version: {text!r}")
    return tuple(int(part or 0) for part in match.groups())


TORCH = _release(torch.__version__)
"""The installed torch's release, as a tuple."""

SKIP_PATTERN = r"needs torch >= \d+\.\d+(\.\d+)? for .+; this is torch \S+"
"""What a :func:`needs_torch` skip's reason looks like (declared in ``tests/conftest.py``)."""


def needs_torch(version: str, what: str) -> pytest.MarkDecorator:
    """Skip on a torch older than ``version``, which lacks ``what`` (what the test compares)."""
    return pytest.mark.skipif(
        _release(version) > TORCH,
        reason=f"needs torch >= {version} for {what}; this is torch {torch.__version__}",
    )
