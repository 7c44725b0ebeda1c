"""Argument checks shared by the public constructors.

Each check raises the exception type torch raises for the same mistake (passed in by the
caller) with a message that names the option, what was expected and what was got.
"""

from __future__ import annotations

import operator


def _got(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_positive_int(name: str, value: object, *, error: type[Exception]) -> None:
    """``value`` must be an ``int`` (not a ``bool``) greater than zero."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise error(f"{name} must be a positive integer, got {_got(value)}")


def check_bool(name: str, value: object, *, error: type[Exception]) -> bool:
    """``value`` must be exactly ``True`` or ``False``; returns it."""
    if not isinstance(value, bool):
        raise error(f"{name} must be a bool, got {_got(value)}")
    return value


def as_int(name: str, value: object, *, allow_bool: bool) -> int:
    """``value`` as an ``int``: any integer type (numpy's too), never a float; a ``bool`` only
    where torch takes one (``num_workers=True`` works there). TypeError otherwise."""
    if isinstance(value, bool) and not allow_bool:
        raise TypeError(f"{name} must be an integer, got {_got(value)}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {_got(value)}") from None
