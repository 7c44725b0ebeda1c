"""A pytest plugin that fails the session on a skip nobody declared.

A skip is how a broken feature can hide: an ``importorskip`` of a module that stopped importing,
or a guard left from before a feature existed, turns a failure into one more "s" in the dots.
So a test may skip only for a reason on a short declared list (``DECLARED_SKIPS`` in
``tests/conftest.py``, each entry about the machine the suite runs on, with a line saying why it
is allowed), and an ``xfail`` is never allowed. Every skip seen is listed at the end of the run;
an undeclared one (or an xfail/xpass) makes the exit status 1, even when every test passed.

Torch-free on purpose: ``tests/test_skip_guard.py`` runs it in small pytest sessions of its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import pytest

__all__ = ["AllowedSkip", "SkipGuard"]


@dataclass(frozen=True)
class AllowedSkip:
    """A declared kind of skip: ``pattern`` must match a skip's whole reason."""

    name: str
    pattern: str
    why: str
    regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.why.strip():
            raise ValueError(f"the declared skip {self.name!r} must say why it is allowed")
        object.__setattr__(self, "regex", re.compile(self.pattern))

    def matches(self, reason: str) -> bool:
        return self.regex.fullmatch(reason) is not None


@dataclass(frozen=True)
class SeenSkip:
    where: str
    reason: str
    declared: AllowedSkip | None


def _reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    """The reason a skipped report gives (pytest stores ``(path, line, "Skipped: reason")``)."""
    longrepr: Any = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return str(text).removeprefix("Skipped: ")


class SkipGuard:
    """Collects every skip and xfail of the session; fails it on those not declared."""

    def __init__(self, allowed: tuple[AllowedSkip, ...]) -> None:
        self.allowed = allowed
        self.seen: list[SeenSkip] = []

    def _record(self, where: str, reason: str) -> None:
        declared = next((a for a in self.allowed if a.matches(reason)), None)
        self.seen.append(SeenSkip(where, reason, declared))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.skipped:
            self._record(report.nodeid or str(report.fspath), _reason(report))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        xfail = getattr(report, "wasxfail", None)
        if xfail is not None and (report.skipped or report.passed):
            state = "xfailed" if report.skipped else "xpassed"
            self._record(report.nodeid, f"{state} (never allowed): {xfail or 'no reason'}")
        elif report.skipped:
            self._record(report.nodeid, _reason(report))

    def undeclared(self) -> list[SeenSkip]:
        return [s for s in self.seen if s.declared is None]

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        passing = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
        if self.undeclared() and session.exitstatus in passing:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.seen:
            return
        write = terminalreporter.write_line
        terminalreporter.section("skips (tests/conftest.py declares which are allowed)")
        for skip in self.seen:
            label = skip.declared.name if skip.declared is not None else "UNDECLARED"
            write(f"[{label}] {skip.where}: {skip.reason}")
        undeclared = self.undeclared()
        if undeclared:
            write(
                f"FAILED: {len(undeclared)} skip(s) or xfail(s) for a reason not declared in "
                "tests/conftest.py (DECLARED_SKIPS): a test that cannot run here must fail, "
                "unless what it lacks is the machine's",
                red=True,
                bold=True,
            )
