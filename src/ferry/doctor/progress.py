"""What the doctor shows on stderr while it measures: a one-line bar redrawn in place.

The bar is drawn only on a terminal; in a log (stderr not a terminal) each measurement is
announced by one plain line instead, and ``--quiet`` silences both.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from time import perf_counter
from typing import TextIO

__all__ = ["Bound", "Console"]

_WIDTH = 24  # characters of the bar itself
_REDRAW_EVERY_S = 0.1


@dataclass(frozen=True)
class Bound:
    """How long one measurement runs: until ``batches`` batches or ``seconds`` seconds
    (0: no time limit), whichever comes first, or the end of the epoch."""

    batches: int
    seconds: float

    def __str__(self) -> str:
        seconds = f" or {self.seconds:g} s" if self.seconds else ""
        return f"up to {self.batches} batches{seconds}"

    def reached(self, batches: int, elapsed: float) -> bool:
        return batches >= self.batches or (self.seconds > 0 and elapsed >= self.seconds)

    def fraction(self, batches: int, elapsed: float) -> float:
        """How far towards the bound, from 0 to 1."""
        done = batches / self.batches
        if self.seconds > 0:
            done = max(done, elapsed / self.seconds)
        return min(done, 1.0)


class Console:
    """The doctor's stderr: status lines and the progress bar of the measurement running."""

    def __init__(self, quiet: bool, stream: TextIO | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.quiet = quiet
        self.bar = not quiet and self.stream.isatty()
        self._label = ""
        self._bound = Bound(1, 0.0)
        self._drawn_at = 0.0

    def say(self, line: str) -> None:
        """A status line (not with ``--quiet``)."""
        if not self.quiet:
            print(f"ferry doctor: {line}", file=self.stream, flush=True)

    def start(self, label: str, bound: Bound) -> None:
        """A measurement begins: announce it (a log) or draw its empty bar (a terminal)."""
        self._label, self._bound, self._drawn_at = label, bound, 0.0
        if self.bar:
            self.update(0, 0.0)
        else:
            self.say(f"{label} ({bound})")

    def update(self, batches: int, elapsed: float) -> None:
        """Redraw the bar (at most every 0.1 s)."""
        now = perf_counter()
        if not self.bar or (batches and now - self._drawn_at < _REDRAW_EVERY_S):
            return
        self._drawn_at = now
        filled = round(_WIDTH * self._bound.fraction(batches, elapsed))
        bar = "#" * filled + "." * (_WIDTH - filled)
        line = f"\r{self._label}: [{bar}] {batches} batches, {elapsed:.1f} s"
        self.stream.write(f"{line}\033[K")  # \033[K: clear what a longer line left behind
        self.stream.flush()

    def finish(self) -> None:
        """The measurement is over: clear the bar's line."""
        if self.bar:
            self.stream.write("\r\033[K")
            self.stream.flush()
