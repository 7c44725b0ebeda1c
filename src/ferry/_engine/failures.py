"""What the loader does when loading goes wrong: the failure options and the skip budget.

Four keyword-only options of :class:`ferry.DataLoader`, whose defaults keep torch's behaviour:

* ``on_error``: ``"raise"`` (default) raises a sample's exception in the training loop, as
  torch does; ``"skip"`` drops the samples whose fetch raised and goes on.
* ``max_errors``: with ``"skip"``, how many samples may be dropped: a count (``int``), or a
  fraction of the samples seen (``float`` in ``(0, 1)``), judged once at least
  :data:`FRACTION_MIN_SAMPLES` samples were seen; None: no limit. Past it the loader raises
  :class:`ferry.errors.TooManyErrors`, listing every sample it dropped.
* ``max_worker_restarts``: how many dead worker processes an iterator replaces (default 0).
* ``stall_warning``: seconds without a batch before the loader reports what its workers are
  doing (None: never).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

from ferry.errors import SkippedSample, TooManyErrors

__all__ = [
    "DEFAULT_STALL_WARNING",
    "FRACTION_MIN_SAMPLES",
    "FailurePolicy",
    "OnError",
    "SkipBudget",
]

OnError = Literal["raise", "skip"]

# Five minutes without a batch: far beyond the slowest healthy batch we know of (large video
# clips, remote reads), so the report fires only when something is stuck.
DEFAULT_STALL_WARNING = 300.0
# A fraction of errors is judged only once this many samples were seen: the first few samples
# say little (one failure among the first three is not "33% of the dataset is bad").
FRACTION_MIN_SAMPLES = 100
# The summary raised past the budget lists at most this many skipped samples (and counts all).
_SUMMARY_LIMIT = 100

logger = logging.getLogger("ferry")


@dataclass(frozen=True)
class FailurePolicy:
    """The failure options of a loader, checked (see the module docstring)."""

    on_error: OnError = "raise"
    max_errors: int | float | None = None
    max_worker_restarts: int = 0
    stall_warning: float | None = DEFAULT_STALL_WARNING

    @property
    def skip(self) -> bool:
        return self.on_error == "skip"

    @classmethod
    def from_options(
        cls,
        on_error: object,
        max_errors: object,
        max_worker_restarts: object,
        stall_warning: object,
    ) -> FailurePolicy:
        if on_error not in ("raise", "skip"):
            raise ValueError(
                f"on_error must be 'raise' (as torch: the sample's exception stops the loop) or "
                f"'skip' (drop the samples that fail), got on_error={on_error!r}"
            )
        if max_errors is not None:
            if on_error != "skip":
                raise ValueError(
                    "max_errors bounds the samples on_error='skip' may drop; with "
                    f"on_error={on_error!r} nothing is dropped, so leave max_errors unset "
                    f"(got max_errors={max_errors!r})"
                )
            if isinstance(max_errors, bool) or not isinstance(max_errors, (int, float)):
                raise TypeError(
                    "max_errors must be a count (int >= 0) or a fraction of the samples seen "
                    f"(float between 0 and 1), got {max_errors!r} ({type(max_errors).__name__})"
                )
            if isinstance(max_errors, int) and max_errors < 0:
                raise ValueError(f"max_errors as a count must be >= 0, got max_errors={max_errors}")
            if isinstance(max_errors, float) and not 0.0 < max_errors < 1.0:
                raise ValueError(
                    "max_errors as a fraction of the samples seen must be between 0 and 1 "
                    f"(exclusive), got max_errors={max_errors}; pass an int for a count"
                )
        if isinstance(max_worker_restarts, bool) or not isinstance(max_worker_restarts, int):
            raise TypeError(
                "max_worker_restarts must be an int (how many dead workers an iterator "
                f"replaces), got {max_worker_restarts!r} ({type(max_worker_restarts).__name__})"
            )
        if max_worker_restarts < 0:
            raise ValueError(
                f"max_worker_restarts must be >= 0, got max_worker_restarts={max_worker_restarts}"
            )
        if stall_warning is not None:
            if isinstance(stall_warning, bool) or not isinstance(stall_warning, (int, float)):
                raise TypeError(
                    "stall_warning must be a number of seconds (or None: never warn), got "
                    f"{stall_warning!r} ({type(stall_warning).__name__})"
                )
            if not stall_warning > 0 or math.isnan(stall_warning):
                raise ValueError(
                    "stall_warning must be a positive number of seconds (or None: never warn), "
                    f"got stall_warning={stall_warning}"
                )
            stall_warning = float(stall_warning)
        return cls(on_error, max_errors, max_worker_restarts, stall_warning)


class SkipBudget:
    """The samples an iterator dropped (``on_error="skip"``), and the limit on them.

    Counts carry over a resume (they are part of the loader's state); the detailed list covers
    this process's iterators only.
    """

    def __init__(self, max_errors: int | float | None, skipped: int = 0, seen: int = 0) -> None:
        self.max_errors = max_errors
        self.skipped = skipped  # samples dropped, over the whole run (resumes included)
        self.seen = seen  # samples fetched or dropped, likewise
        self.details: list[SkippedSample] = []

    def add(self, seen: int, dropped: tuple[SkippedSample, ...]) -> None:
        """One batch's outcome: ``seen`` samples tried, ``dropped`` of them failed. Logs each
        drop; raises :class:`TooManyErrors` once past the budget."""
        self.seen += seen
        for sample in dropped:
            self.skipped += 1
            if len(self.details) < _SUMMARY_LIMIT:
                self.details.append(sample)
            logger.warning("ferry.DataLoader skipped %s", sample.describe())
        # (a fraction is judged on every batch: the samples seen may just have reached the
        # minimum, after failures that came before it)
        if (dropped or isinstance(self.max_errors, float)) and self.exceeded():
            raise TooManyErrors(self.summary())

    def exceeded(self) -> bool:
        limit = self.max_errors
        if limit is None:
            return False
        if isinstance(limit, int):
            return self.skipped > limit
        return self.seen >= FRACTION_MIN_SAMPLES and self.skipped > limit * self.seen

    def summary(self) -> str:
        limit = self.max_errors
        if isinstance(limit, float):
            allowed = (
                f"max_errors={limit} ({limit:.1%} of the samples seen, judged after "
                f"{FRACTION_MIN_SAMPLES})"
            )
        else:
            allowed = f"max_errors={limit}"
        lines = [
            f"DataLoader skipped {self.skipped} samples out of {self.seen} seen, more than "
            f"{allowed} allows (on_error='skip'). Fix the data or raise max_errors. Skipped:"
        ]
        lines += [f"  {sample.describe()}" for sample in self.details]
        if self.skipped > len(self.details):
            lines.append(f"  ... and {self.skipped - len(self.details)} more (logged)")
        return "\n".join(lines)


def plain_budget(budget: SkipBudget) -> dict[str, Any]:
    return {"skipped": budget.skipped, "seen": budget.seen}
