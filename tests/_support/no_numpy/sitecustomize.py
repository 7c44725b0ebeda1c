"""Makes numpy unimportable in this interpreter and every process it starts.

Put this directory first on ``PYTHONPATH`` (``make test-nonumpy`` does): Python imports
``sitecustomize`` as it starts, before torch, so torch comes up as it does where numpy is not
installed (it warns once and runs), and so do spawned workers and subprocesses, which inherit
``PYTHONPATH``. This is how ferry's claim that numpy is optional is tested without a second
environment of 1.7 GB.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType


class BlockNumpy:
    """A meta path finder that finds ``numpy`` and its submodules missing."""

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name == "numpy" or name.startswith("numpy."):
            blocked = f"No module named {name!r} (blocked by {__file__})"
            raise ModuleNotFoundError(blocked, name=name)
        return None


if "numpy" in sys.modules:  # too late to block it: say so rather than test nothing
    raise RuntimeError("numpy was imported before the no-numpy sitecustomize ran")
sys.meta_path.insert(0, BlockNumpy())
