"""MosaicML Streaming and litdata datasets through ferry's DataLoader.

Both libraries' ``StreamingDataset`` has a ``state_dict`` that takes arguments (the samples
the loop consumed), which torchdata's protocol does not call, and both shard themselves with
torch's ``get_worker_info`` and shuffle by an epoch counter of their own. Each test runs a
program (``_streaming_programs.py``) in a fresh interpreter, on a dataset of 200 samples
written with the library's own writer:

* the order of two epochs with 0 and 2 process workers, and 2 thread workers, is torch's
  loader's (2 process workers), sample for sample: each thread is given its own copy of the
  dataset and the library's own binding of torch's ``get_worker_info`` answers in it;
* a state saved mid-epoch in one process and loaded in another resumes the epoch exactly:
  what the first process saw, then what the second saw, is the uninterrupted run, and so is
  the epoch after it, with 0, 2 and 3 process workers and 2 thread workers; each library's own
  StreamingDataLoader, side by side, does the same;
* nothing is left in /dev/shm (MosaicML keeps its shared state there).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

PROGRAM = Path(__file__).with_name("_streaming_programs.py")
SAMPLES = 200
# MosaicML's shared memory is named with a six-digit prefix
MOSAIC_SHM = re.compile(r"^\d{6}_")

pytestmark = pytest.mark.timeout(300)


def run(*args: str | Path, timeout: float = 240) -> Any:
    """What the program printed as its result (it fails the test with the program's output)."""
    done = subprocess.run(
        [sys.executable, str(PROGRAM), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    output = f"{args[:2]} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    assert done.returncode == 0, output
    assert lines, output
    return json.loads(lines[-1].removeprefix("RESULT "))


def mosaic_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if MOSAIC_SHM.match(n)}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A dataset per library, written once for the module."""
    root = tmp_path_factory.mktemp("streaming")
    before = mosaic_shm()
    run("write", root)
    yield {library: root / library for library in ("mosaic", "litdata")}
    assert mosaic_shm() <= before, "MosaicML's shared memory was left in /dev/shm"


def folder(written: dict[str, Path], library: str) -> Path:
    return written[library.split("-", maxsplit=1)[0]]


def once_each(epoch: list[int]) -> bool:
    return sorted(epoch) == list(range(SAMPLES))


@pytest.fixture(scope="module")
def orders(written: dict[str, Path]) -> dict[str, Any]:
    """Per library: two epochs through each loader (one interpreter runs both libraries)."""
    return dict(
        run("orders", *(part for lib in ("mosaic", "litdata") for part in (lib, written[lib])))
    )


@pytest.mark.parametrize("library", ["mosaic", "litdata"])
def test_order_is_torchs(orders: dict[str, Any], library: str) -> None:
    seen = orders[library]
    for workers in ("0", "2"):
        torch_run = seen[f"torch-{workers}"]
        assert all(once_each(e) for e in torch_run)
        name = "ferry-2-process" if workers == "2" else "ferry-0"
        assert seen[name] == torch_run, f"{name} differs from torch's loader"
    if library == "mosaic":  # spawned workers import the library (and the stand-in) afresh
        assert seen["ferry-2-spawn"] == seen["torch-2"]
    # each thread finds its worker (not the whole epoch each) and iterates its own copy
    assert seen["ferry-2-thread"] == seen["torch-2"]
    for name in ("ferry-0", "ferry-2-process"):  # a state mid-epoch, plain data
        state = seen[f"{name} state"]
        assert state["dataset_position"]["library"] == (
            "MosaicML Streaming" if library == "mosaic" else "litdata"
        )


RUNS = {
    # ferry with 0, 2 and 3 process workers and 2 threads; the library's own loader with 0, 2
    "mosaic": ["ferry-0", "ferry-2", "ferry-3", "ferry-2-thread", "library-0", "library-2"],
    "litdata": ["ferry-0", "ferry-2", "ferry-3", "ferry-2-thread", "library-0", "library-2"],
    # the dataset told the batch size (as litdata's loader tells it): its own count resumes
    "litdata-told": ["ferry-0", "ferry-2"],
}


@pytest.fixture(scope="module")
def resumed(
    written: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """Per library: each run saved mid-epoch in one process, loaded in another (one process
    saves every library's runs, and another loads them all)."""
    root = tmp_path_factory.mktemp("states")
    plan = []
    for library, runs in RUNS.items():
        states = root / library
        states.mkdir()
        plan.append([library, str(folder(written, library)), ",".join(runs), str(states)])
    (root / "plan.json").write_text(json.dumps(plan))
    saved = run("save", root / "plan.json")
    loaded = run("load", root / "plan.json")
    return {
        library: {name: (saved[library][name], loaded[library][name]) for name in runs}
        for library, runs in RUNS.items()
    }


@pytest.mark.parametrize(
    ("library", "name"), [(lib, name) for lib, runs in RUNS.items() for name in runs]
)
def test_resume_in_another_process(
    resumed: dict[str, dict[str, Any]], library: str, name: str
) -> None:
    saved, loaded = resumed[library][name]
    uninterrupted = saved["seen"] + saved["rest"]
    assert once_each(saved["first"])
    assert once_each(uninterrupted)
    assert saved["seen"], "the state was not taken mid-epoch"
    assert saved["rest"], "the state was not taken mid-epoch"
    # the second process goes on exactly where the first one saved, and so does the next epoch
    assert loaded["rest"] == saved["rest"]
    assert loaded["next"] == saved["next"]
