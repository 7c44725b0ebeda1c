"""Fixtures of the resume tests: see :mod:`workers.fixtures` (every worker process and thread a
test starts must be gone after it; global state is guarded).

``sdl_known_gaps.txt`` lists the cases of ``test_sdl_parity.py`` where ferry does not yet do what
torchdata's StatefulDataLoader does (issue 19, still open: see docs/design/state.md, "Known
gaps"). They run as strict xfails: each still runs, and one that starts to pass fails the suite
until it is taken off the list.
"""

from pathlib import Path

import pytest

from workers.fixtures import kind, no_leftovers

__all__ = ["kind", "no_leftovers"]

_GAPS = frozenset(
    line.strip()
    for line in (Path(__file__).parent / "sdl_known_gaps.txt").read_text().splitlines()
    if line.strip()
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.split("tests/resume/", 1)[-1] in _GAPS:
            item.add_marker(
                pytest.mark.xfail(strict=True, reason="known gap against torchdata (issue 19)")
            )
