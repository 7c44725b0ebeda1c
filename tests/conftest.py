"""Fixtures shared by the test suite.

``guard_global_state`` checks that a test leaves behind what it found: ferry's and torch's
``default_collate_fn_map`` (same entries, same order), the warning filters and torch's global
RNG state. It restores them either way, so one leaking test cannot break the ones after it,
and fails the leaking test so the leak gets fixed. Modules opt in with
``pytestmark = pytest.mark.usefixtures("guard_global_state")``.

``make test`` runs two test files at once (pytest-xdist, one process each): a test may not
count on having the machine alone. What it makes outside its process is named after its pid
or kept under ``tmp_path`` (ferry's /dev/shm names carry the main process's pid), a port is
chosen free and retried when taken (``_support/ranks.py``), and what it counts is its own
(its children, its descriptors), never the machine's.
"""

from __future__ import annotations

import re
import signal
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data._utils.collate import default_collate_fn_map as torch_collate_fn_map

from _support.numpy_run import HAS_NUMPY, NO_NUMPY_REASON, NO_NUMPY_RUN
from _support.skip_guard import AllowedSkip, SkipGuard
from _support.torch_versions import SKIP_PATTERN as TORCH_SKIP_PATTERN
from ferry.collate import default_collate_fn_map as ferry_collate_fn_map

# A suite started in the background by a shell without job control (`make test &`, nohup)
# inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler, here or in the
# programs the Ctrl-C tests start: they would fail for the shell's reason, not ferry's. The
# handler every interactive program has is put back (a child exec'd from here starts with the
# default disposition again, and Python installs its handler there too).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def guard_global_state() -> Iterator[None]:
    ferry_map = list(ferry_collate_fn_map.items())
    torch_map = list(torch_collate_fn_map.items())
    filters = list(warnings.filters)
    rng = torch.get_rng_state()
    yield
    leaks = []
    if list(ferry_collate_fn_map.items()) != ferry_map:
        leaks.append("ferry.default_collate_fn_map")
        ferry_collate_fn_map.clear()
        ferry_collate_fn_map.update(ferry_map)
    if list(torch_collate_fn_map.items()) != torch_map:
        leaks.append("torch default_collate_fn_map")
        torch_collate_fn_map.clear()
        torch_collate_fn_map.update(torch_map)
    if list(warnings.filters) != filters:
        leaks.append("warnings.filters")
        warnings.filters[:] = filters
    torch.set_rng_state(rng)
    assert not leaks, f"the test left global state changed: {', '.join(leaks)}"


@pytest.fixture
def extend_collate_maps(guard_global_state: None) -> Iterator[None]:
    """Lets a test add entries to both ``default_collate_fn_map`` s; removes them afterwards."""
    ferry_map = list(ferry_collate_fn_map.items())
    torch_map = list(torch_collate_fn_map.items())
    yield
    ferry_collate_fn_map.clear()
    ferry_collate_fn_map.update(ferry_map)
    torch_collate_fn_map.clear()
    torch_collate_fn_map.update(torch_map)


# Whole suites marked `slow` (with the tests marked one by one elsewhere, `make test-fast`
# leaves them out): on 2 cores they take about 60% of the suite's time, because each of their
# tests starts processes, a training framework, or waits out a deadline.
SLOW_SUITES = (
    "ecosystem/",
    "distributed/",
    "faults/",
    "resume/test_sdl_parity.py",
    "workers/test_stall.py",
    "workers/test_differential.py",
)


# The test files that import a training framework (Lightning, transformers, accelerate, Hugging
# Face datasets) into the pytest process itself: the others run theirs in subprocesses. Those
# libraries double the process (about 225 MB to 470 MB), and every worker forked from it pays:
# a fork copies the page tables, and a forked worker's exit tears them down (measured: 19 ms
# more CPU per worker, +25-35% on test_sdl_parity.py's 3,800 forks). `make test` therefore runs
# them in a session of their own (``--frameworks=only``), after the others
# (``--frameworks=apart``, whose processes never import them); a plain ``pytest`` runs all.
FRAMEWORK_FILES = frozenset(
    f"ecosystem/test_{name}.py"
    for name in (
        "accelerate",
        "hf_datasets",
        "lightning",
        "lightning_injection",
        "lightning_iterators",
        "lightning_resume",
        "lightning_resume_rng",
        "lightning_tuner",
        "migrated_checks",
        "transformers",
    )
)
FRAMEWORK_MODULES = ("lightning", "pytorch_lightning", "transformers", "accelerate", "datasets")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--frameworks",
        choices=("with", "apart", "only"),
        default="with",
        help="the test files that import a training framework into the pytest process: run "
        "them with the others (with, the default), leave them out (apart), or run only them "
        "(only); `make test` runs apart, then only (tests/conftest.py says why)",
    )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    mode = config.getoption("--frameworks")
    if mode == "with" or collection_path.suffix != ".py":
        return None
    tests = Path(__file__).parent
    try:
        where = collection_path.relative_to(tests).as_posix()
    except ValueError:
        return None
    listed = where in FRAMEWORK_FILES
    leave_out = (
        listed if mode == "apart" else collection_path.name.startswith("test_") and not listed
    )
    return True if leave_out else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--frameworks") == "apart":
        imported = [name for name in FRAMEWORK_MODULES if name in sys.modules]
        if imported:
            raise pytest.UsageError(
                f"--frameworks=apart: collecting the tests imported {', '.join(imported)} into "
                "the pytest process; list the test file that imports it at module level in "
                "FRAMEWORK_FILES (tests/conftest.py), or import it inside its tests"
            )
    tests = Path(__file__).parent
    slow = set()
    for item in items:
        where = item.path.relative_to(tests).as_posix()
        if where.startswith(SLOW_SUITES):
            item.add_marker(pytest.mark.slow)
            slow.add(item.path)
    # The slow suites first, each file's tests kept together and in order: pytest-xdist hands
    # whole files to its processes in this order (`make test`'s --dist loadfile), and a long file
    # handed out last would leave one process working alone at the end.
    items.sort(key=lambda item: item.path not in slow)


# The only reasons a test may skip for (each pattern must match a whole reason): what the machine
# lacks, never what ferry lacks. Any other skip, and any xfail, fails the session (its exit
# status is 1 even when every test passed); every skip seen is listed at the end of the run
# (tests/_support/skip_guard.py). A feature that is not there, or a library that does not import,
# must fail its tests, not skip them.
DECLARED_SKIPS = (
    AllowedSkip(
        "accelerator",
        r"needs an accelerator to pin memory|checks the no-accelerator fallback"
        r"|the warning is about a machine with no accelerator",
        "pin_memory behaves one way with an accelerator and another without: each machine runs "
        "the side it has (CI's machines have none; the GPU run has one)",
    ),
    AllowedSkip(
        "platform: Linux kernel interfaces",
        r"no memfd_create on this platform|no /dev/shm|counts descriptors in /proc/self/fd"
        r"|measures private memory from /proc/<pid>/smaps_rollup \(Linux 4\.14 and later\)"
        r"|needs /proc/<pid>/smaps_rollup \(Linux\)|needs fork \(Linux\)"
        r"|no per-thread CPU clocks or schedstat",
        "ferry's shared memory, descriptor and memory checks use Linux interfaces; on a "
        "platform without them the code under test takes another path, tested elsewhere",
    ),
    AllowedSkip(
        "platform: start method",
        r"start method \w+ is not available on this platform",
        "a platform offers only some of fork, spawn and forkserver (macOS and Windows lack fork)",
    ),
    AllowedSkip(
        "older torch",
        TORCH_SKIP_PATTERN,
        "ferry behaves as torch 2.13 on every torch it accepts; where a test's oracle is the "
        "installed torch and an older release behaved otherwise, that test waits for a newer "
        "torch (tests/_support/torch_versions.py)",
    ),
    AllowedSkip(
        "platform: private /dev/shm",
        r"no unshare\(1\) here to make a private /dev/shm|unshare could not run: .*"
        r"|a private /dev/shm is not permitted here: .*",
        "hiding /dev/shm needs a private mount namespace (unshare -m, as root), which many "
        "containers and unprivileged users are not allowed",
    ),
)
if NO_NUMPY_RUN:  # make test-nonumpy: numpy is made unimportable on purpose
    DECLARED_SKIPS += (
        AllowedSkip(
            "no numpy (make test-nonumpy)",
            re.escape(NO_NUMPY_REASON),
            "the run without numpy checks that ferry needs none; tests about numpy itself "
            "(its generator's seeding and state) run in the main run",
        ),
    )


def pytest_configure(config: pytest.Config) -> None:
    if NO_NUMPY_RUN and HAS_NUMPY:
        raise pytest.UsageError(
            "FERRY_TESTS_WITHOUT_NUMPY=1, but numpy imports: put tests/_support/no_numpy first "
            "on PYTHONPATH (make test-nonumpy does)"
        )
    config.pluginmanager.register(SkipGuard(DECLARED_SKIPS), "ferry-skip-guard")
