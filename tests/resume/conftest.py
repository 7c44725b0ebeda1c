"""Fixtures of the resume tests: see :mod:`_support.fixtures` (every worker process and thread a
test starts must be gone after it; global state is guarded)."""

from _support.fixtures import kind, no_leftovers

__all__ = ["kind", "no_leftovers"]
