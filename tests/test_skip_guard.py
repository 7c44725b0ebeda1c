"""The skip guard (``tests/_support/skip_guard.py``): a skip nobody declared fails the session.

Each case runs a small pytest session of its own (in a subprocess, with a declared list of one
entry) and reads its exit status and summary.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _support.skip_guard import AllowedSkip, SkipGuard

pytest_plugins = ("pytester",)

TESTS = Path(__file__).resolve().parent

GUARD = f"""
import sys

sys.path.insert(0, {str(TESTS)!r})
from _support.skip_guard import AllowedSkip, SkipGuard


def pytest_configure(config):
    allowed = (AllowedSkip("the machine", r"no widget on this machine", "widgets are hardware"),)
    config.pluginmanager.register(SkipGuard(allowed), "ferry-skip-guard")
"""


def _session(pytester: pytest.Pytester, tests: str) -> pytest.RunResult:
    pytester.makeconftest(GUARD)
    pytester.makepyfile(test_cases=tests)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider")


@pytest.mark.timeout(90)
def test_a_declared_skip_passes_and_is_listed(pytester: pytest.Pytester) -> None:
    result = _session(
        pytester,
        """
import pytest

def test_runs():
    pass

@pytest.mark.skipif(True, reason="no widget on this machine")
def test_needs_a_widget():
    pass
""",
    )
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.stdout.fnmatch_lines(["*skips*", "[[]the machine[]] *test_needs_a_widget: no widget*"])
    assert "UNDECLARED" not in result.stdout.str()


@pytest.mark.timeout(90)
def test_undeclared_skips_and_xfails_fail_the_session_though_every_test_passed(
    pytester: pytest.Pytester,
) -> None:
    result = _session(
        pytester,
        """
import pytest

def test_runs():
    pass

def test_skips():
    pytest.skip("the feature is not written yet")

def test_imports_or_skips():
    pytest.importorskip("a_module_that_is_not_installed_here")

def test_xfails():
    pytest.xfail("known to be broken")

@pytest.mark.xfail(reason="thought broken")
def test_xpasses():
    pass
""",
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*UNDECLARED*test_skips: the feature is not written yet",
            "*UNDECLARED*test_imports_or_skips: could not import*",
            "*UNDECLARED*test_xfails: xfailed*known to be broken",
            "*UNDECLARED*test_xpasses: xpassed*thought broken",
            "FAILED: 4 skip(s) or xfail(s)*",
        ]
    )


@pytest.mark.timeout(90)
def test_a_module_skipped_whole_fails_the_session(pytester: pytest.Pytester) -> None:
    result = _session(
        pytester,
        """
import pytest

pytest.skip("a library is missing", allow_module_level=True)
""",
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines(["*UNDECLARED*a library is missing*"])


def test_a_declared_skip_must_say_why() -> None:
    with pytest.raises(ValueError, match="must say why"):
        AllowedSkip("the machine", "no widget", " ")


def test_the_suite_runs_under_the_guard_with_reasons_that_say_why(
    pytestconfig: pytest.Config,
) -> None:
    guard = pytestconfig.pluginmanager.get_plugin("ferry-skip-guard")
    assert isinstance(guard, SkipGuard)
    assert guard.allowed, "tests/conftest.py declares no skip"
    for allowed in guard.allowed:
        assert len(allowed.why) > 40, allowed.name
        assert not allowed.matches(""), allowed.name
        assert not allowed.matches("could not import 'datasets': No module named 'datasets'")
