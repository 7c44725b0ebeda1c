"""Whether this run has numpy: ``make test-nonumpy`` runs part of the suite with numpy made
unimportable (``tests/_support/no_numpy``), to keep ferry's promise that numpy is optional.

A test that is about numpy itself is marked ``@needs_numpy``; tests/conftest.py declares its
skip only in that run (``FERRY_TESTS_WITHOUT_NUMPY=1``), so in any other run a numpy that does
not import fails the session.
"""

from __future__ import annotations

import os

import pytest

try:
    import numpy  # noqa: F401
except ImportError:
    HAS_NUMPY = False
else:
    HAS_NUMPY = True

NO_NUMPY_RUN = os.environ.get("FERRY_TESTS_WITHOUT_NUMPY") == "1"
NO_NUMPY_REASON = "needs numpy, which this run makes unimportable (make test-nonumpy)"
needs_numpy = pytest.mark.skipif(not HAS_NUMPY, reason=NO_NUMPY_REASON)
