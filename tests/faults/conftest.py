"""Fixtures of the fault tests: see :mod:`_support.fixtures`."""

from _support.fixtures import kind, no_leftovers

__all__ = ["kind", "no_leftovers"]
