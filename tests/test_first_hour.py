"""What a newcomer meets first: install hints, ``--version``, and the exit statuses in ``--help``.

The package on the index is ``ferry-data`` (``ferry`` there is an unrelated project), so a hint
that says ``pip install ferry`` or ``'ferry[bench]'`` would install someone else's code.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ferry
from ferry.__main__ import main, version_line

ROOT = Path(__file__).resolve().parents[1]

# `ferry[...]` or `pip install ferry` not followed by `-data`: the unrelated project's name.
WRONG_DISTRIBUTION = re.compile(r"(?<![\w.-])ferry\[|pip install\s+['\"]?ferry(?![\w-])")


def _texts() -> list[Path]:
    package = sorted((ROOT / "src" / "ferry").rglob("*.py"))
    docs = sorted((ROOT / "docs").rglob("*.md"))
    return [*package, *docs, ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "Makefile"]


def test_the_pattern_finds_the_wrong_name_only() -> None:
    assert WRONG_DISTRIBUTION.search("pip install 'ferry[bench]'")
    assert WRONG_DISTRIBUTION.search("pip install ferry")
    assert not WRONG_DISTRIBUTION.search("pip install 'ferry-data[bench]'")
    assert not WRONG_DISTRIBUTION.search("pip install ferry-data")
    assert not WRONG_DISTRIBUTION.search("pip install matplotlib (ferry-data's extra 'bench')")


def test_every_install_hint_names_ferry_data() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _texts()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if WRONG_DISTRIBUTION.search(line)
    ]
    assert not found, "install hints that name the unrelated `ferry`:\n" + "\n".join(found)


def test_version_is_the_distributions(capsys: pytest.CaptureFixture[str]) -> None:
    assert importlib.metadata.version("ferry-data") == ferry.__version__
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out == version_line() + "\n"
    assert out.startswith(f"ferry {ferry.__version__} (installed as ferry-data), ")
    assert f"torch {torch.__version__}" in out


@pytest.mark.timeout(60)
def test_python_m_ferry_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ferry", "--version"],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"ferry {ferry.__version__} ")


def _readme_exit_statuses(section: str) -> list[str]:
    """The statuses listed in the README's 'Exit status: ...' sentence of ``## section``."""
    readme = ROOT.joinpath("README.md").read_text()
    body = readme.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    sentence = body.split("Exit status: ", 1)[1].split(".", 1)[0]
    return re.findall(r"(?:^|, )(\d+) ", sentence.replace("\n", " "))


def test_bench_help_lists_every_exit_status_of_the_readme(
    capsys: pytest.CaptureFixture[str],
) -> None:
    statuses = _readme_exit_statuses("Benchmark")
    assert statuses == ["0", "1", "2", "130"]
    assert main(["bench", "--help"]) == 0
    epilog = capsys.readouterr().out.split("exit status:", 1)[1]
    for status in statuses:
        assert re.search(rf"(?:^|[\s,]){status} ", epilog), f"exit status {status} is missing"


def test_doctor_help_lists_every_exit_status_of_the_readme(
    capsys: pytest.CaptureFixture[str],
) -> None:
    statuses = _readme_exit_statuses("Doctor")
    assert statuses == ["0", "1", "2", "130"]
    assert main(["doctor", "--help"]) == 0
    epilog = capsys.readouterr().out.split("exit status:", 1)[1]
    for status in statuses:
        assert re.search(rf"(?:^|[\s,]){status} ", epilog), f"exit status {status} is missing"


def test_the_readmes_make_targets_and_examples_exist() -> None:
    readme = ROOT.joinpath("README.md").read_text()
    makefile = ROOT.joinpath("Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, flags=re.MULTILINE))
    named = set(re.findall(r"(?:^|`)make ([a-z][\w-]*)", readme, flags=re.MULTILINE))
    assert named >= {"test", "test-fast", "bench", "clean"}
    assert named <= targets, f"make targets the Makefile lacks: {named - targets}"
    examples = set(re.findall(r"\bexamples/\w+\.py", readme))
    assert examples
    assert all(ROOT.joinpath(path).is_file() for path in examples), examples
    # The examples need the development environment: their commands name it.
    assert not re.search(r"(?:^|`)(?:python|torchrun) .*examples/", readme, flags=re.MULTILINE)
