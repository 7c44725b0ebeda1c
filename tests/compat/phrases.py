"""Differential checks of error and warning messages: ferry keeps torch's fixed phrases.

Programs match torch's messages with regular expressions
(``assertRaisesRegex(ValueError, "num_workers option should be non-negative")``,
``pytest.warns(UserWarning, match="...")``). ferry's messages say more than torch's (the
option, what was expected, what was got, what to do), and must still contain the words such a
pattern is written against, with interpolated numbers in torch's form.

A :class:`Case` triggers one of torch's errors or warnings through the public API of a module
(``torch.utils.data`` or ``ferry``). :func:`check` runs it against torch first and asserts that
torch still raises exactly that class (warns that category) with a message matching every
phrase, so the table stays honest when torch changes; then against ferry, which must raise that
class or a subclass of it (warn that category or a subclass) with a message matching the same
phrases.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch.utils.data as tud

import ferry


@dataclass(frozen=True)
class Case:
    """One error or warning of torch's, and how to trigger it.

    ``phrases`` are regular expressions (``re.search``) that torch's message matches and ferry's
    must match too; ``expected`` is torch's exception class or warning category.
    """

    name: str
    trigger: Callable[[Any], object]
    expected: type[BaseException]
    phrases: tuple[str, ...]
    marks: Sequence[Any] = field(default=())
    # ferry's phrase may be in the exception's notes (as pytest.raises(match=) searches them).
    with_notes: bool = False


def params(cases: Sequence[Case]) -> list[Any]:
    """The cases as pytest parameters, named and marked."""
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), "case names must be unique"
    return [pytest.param(c, id=c.name, marks=list(c.marks)) for c in cases]


def _raised(case: Case, module: Any) -> BaseException:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            case.trigger(module)
        except Exception as exc:
            # Dropping the traceback frees what its frames hold (a half-built iterator, say)
            # now, within the test that made it.
            return exc.with_traceback(None)
    raise AssertionError(f"{case.name}: {module.__name__} raised nothing")


def _warned(case: Case, module: Any) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        case.trigger(module)
    return list(caught)


def _matches(case: Case, message: str) -> bool:
    return all(re.search(p, message) for p in case.phrases)


def check(case: Case) -> None:
    """Torch still says it; ferry says it too, with the same class or category."""
    if issubclass(case.expected, Warning):
        _check_warning(case)
    else:
        _check_error(case)


def _check_error(case: Case) -> None:
    expected = _raised(case, tud)
    assert type(expected) is case.expected, (
        f"torch now raises {type(expected).__name__}: {expected}"
    )
    assert _matches(case, str(expected)), f"torch's message changed: {expected}"
    got = _raised(case, ferry)
    assert isinstance(got, case.expected), (
        f"ferry raised {type(got).__name__}, torch raises {case.expected.__name__}: {got}"
    )
    text = str(got)
    if case.with_notes:
        text = "\n".join([text, *getattr(got, "__notes__", ())])
    assert _matches(case, text), (
        f"ferry's message lacks torch's phrase(s) {case.phrases}:\n  ferry: {got}\n"
        f"  torch: {expected}"
    )


def _check_warning(case: Case) -> None:
    expected = [
        str(w.message)
        for w in _warned(case, tud)
        if w.category is case.expected and _matches(case, str(w.message))
    ]
    assert expected, f"torch no longer warns {case.expected.__name__} matching {case.phrases}"
    got = [
        (w.category.__name__, str(w.message))
        for w in _warned(case, ferry)
        if issubclass(w.category, case.expected)
    ]
    assert any(_matches(case, message) for _, message in got), (
        f"no {case.expected.__name__} of ferry's has torch's phrase(s) {case.phrases}:\n"
        f"  ferry: {got}\n  torch: {expected[0]}"
    )
