"""A stand-in clock for code that takes one (``clock=``): it moves only when the test says so."""

from __future__ import annotations


class Clock:
    """A clock that moves only when told to (``clock.now += seconds``)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now
