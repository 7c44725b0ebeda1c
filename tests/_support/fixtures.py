"""Fixtures of the worker, fault and resume tests (imported by those folders' ``conftest.py``).

* ``kind``: how workers run, given by indirect parametrization
  (``@pytest.mark.parametrize("kind", FAST, indirect=True)``); a :class:`~_support.processes.Kind`.
* ``no_leftovers`` (autouse): after every test, every worker process and thread the test
  started must be gone within a few seconds; leftovers are killed and fail the test, so a
  failing test cannot leave processes behind for the next ones.
"""

from __future__ import annotations

import gc
import multiprocessing
from collections.abc import Iterator

import pytest

from _support import datasets
from _support.processes import Kind, descendants, ferry_threads, kill_all, poll

# A forkserver that has torch and ferry imported starts workers in milliseconds instead of
# seconds (each would import torch): this keeps the forkserver matrix affordable. Test modules
# are still imported by name in every worker. Has no effect if a forkserver already runs.
multiprocessing.set_forkserver_preload(["torch", "ferry"])

_LEFTOVER_GRACE = 3.0


@pytest.fixture
def kind(request: pytest.FixtureRequest) -> Kind:
    return Kind(request.param)


@pytest.fixture(autouse=True)
def no_leftovers(guard_global_state: None) -> Iterator[None]:
    datasets.RELEASE.clear()
    datasets.INIT_CALLS.clear()
    processes = descendants()
    threads = ferry_threads()
    yield
    datasets.RELEASE.set()

    def clean() -> bool:
        return not (descendants() - processes) and not (ferry_threads() - threads)

    # An iterator kept alive by a reference cycle (a traceback) goes at a collection: first of
    # the young generations, where the test's own objects are (a full one walks the whole
    # session's heap: 0.1-0.2 s of CPU here, at hundreds of tests), then of all.
    if not poll(clean, 0.05):
        gc.collect(1)
        if not poll(clean, 0.2):
            gc.collect()
            poll(clean, _LEFTOVER_GRACE)
    left = descendants() - processes
    left_threads = ferry_threads() - threads
    kill_all(left)
    datasets.INIT_CALLS.clear()
    if left or left_threads:
        pytest.fail(
            f"the test left worker processes {sorted(left)} and threads "
            f"{sorted(t.name for t in left_threads)} running {_LEFTOVER_GRACE} s after it ended"
        )
