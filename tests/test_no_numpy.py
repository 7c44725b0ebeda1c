"""numpy is optional: ferry runs where only torch is installed.

``tensor_bytes`` is how ferry reads a generator's state without ``Tensor.numpy()`` (which raises
``RuntimeError: Numpy is not available`` there); the README's Quickstart runs in an interpreter
where numpy cannot be imported (``tests/_support/no_numpy/sitecustomize.py``, the same blocker
``make test-nonumpy`` runs part of the suite under). These tests run in both runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ferry._core.rng import generator_state, tensor_bytes

ROOT = Path(__file__).resolve().parents[1]
BLOCKER = ROOT / "tests" / "_support" / "no_numpy"


def _reference_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes numpy's ``tobytes`` gives, computed from Python ints (slow, numpy-free)."""
    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())


@pytest.mark.parametrize(
    "tensor",
    [
        torch.get_rng_state(),
        torch.Generator().manual_seed(7).get_state(),
        torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # not contiguous
        torch.arange(10, dtype=torch.int64)[3:7],  # a view at an offset
        torch.tensor([-1.5, float("nan")], dtype=torch.float64),
        torch.empty(0, dtype=torch.uint8),
    ],
    ids=["global", "generator", "transposed", "offset", "float64", "empty"],
)
def test_tensor_bytes_are_the_tensors_bytes(tensor: torch.Tensor) -> None:
    assert tensor_bytes(tensor) == _reference_bytes(tensor)


def test_a_generators_state_string_is_unchanged() -> None:
    """The saved state's format: base64 of the raw state bytes, as before (and as torch's
    ``get_state`` gives them), so states saved by earlier versions still load."""
    import base64

    generator = torch.Generator().manual_seed(3)
    assert base64.b64decode(generator_state(generator)) == _reference_bytes(generator.get_state())


def quickstart() -> str:
    """The README's Quickstart code block."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quickstart", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "README's Quickstart has no python block"
    return match.group(1)


CHECKS = """
import sys
assert "numpy" not in sys.modules, "numpy was imported"
for name in ("loader", "threads"):
    assert sum(len(yb) for _, yb in globals()[name]) == len(train), name
assert torch.randperm(5, generator=torch.Generator().manual_seed(1)).tolist() == [0, 4, 2, 3, 1]
print("quickstart ran without numpy")
"""


@pytest.mark.timeout(120)
def test_readme_quickstart_runs_without_numpy(tmp_path: Path) -> None:
    script = tmp_path / "quickstart.py"
    script.write_text(quickstart() + CHECKS)
    path = os.pathsep.join([str(BLOCKER), os.environ.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "quickstart ran without numpy" in run.stdout
    assert "No module named 'numpy'" in run.stderr  # torch's warning: numpy really was blocked
