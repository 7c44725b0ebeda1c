"""Fixtures of the worker tests: see :mod:`workers.fixtures`."""

from workers.fixtures import kind, no_leftovers

__all__ = ["kind", "no_leftovers"]
