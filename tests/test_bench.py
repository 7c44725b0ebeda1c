"""Tests of ``python -m ferry bench``: options, medians, the report, and one real tiny run.

No speed is asserted anywhere: the benchmark measures, the tests check that it measures and
reports correctly.
"""

from __future__ import annotations

import argparse
import ast
import json
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ferry.__main__ import main
from ferry._cli import batch_nbytes
from ferry.bench import cli, runner
from ferry.bench.measure import (
    CpuSnapshot,
    batch_digest,
    memcpy_batches_per_s,
    rss_bytes,
)
from ferry.bench.report import format_table, to_json, workers_label
from ferry.bench.results import Row, RunMetrics, Summary, measured, median
from ferry.bench.runner import Config
from ferry.bench.workloads import WORKLOADS, LoaderAPI, StreamSource, stream_class

pytestmark = pytest.mark.usefixtures("guard_global_state")

BENCH_DIR = Path(__file__).resolve().parents[1] / "src" / "ferry" / "bench"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    return parser.parse_args(list(argv))


def _summary(rate: float, cpu: float = 0.001, rss: int = 300 << 20, first: float = 0.01) -> Summary:
    return Summary(
        batches_per_s=rate, cpu_s_per_batch=cpu, peak_rss_bytes=rss, first_batch_s=first, runs=3
    )


def _rows() -> list[Row]:
    return [
        Row("tensor", 0, None, 256, 200, _summary(1000.0), _summary(20000.0), 400000.0),
        Row(
            "image",
            2,
            "thread",
            64,
            40,
            _summary(100.0),
            None,
            1500.0,
            errors=("ferry threads: run: TypeError: unexpected keyword argument 'worker_type'",),
            details=("Traceback (most recent call last):\n...",),
        ),
    ]


# --- options -------------------------------------------------------------------------------


def test_defaults_run_every_workload_family_with_0_and_2_workers_3_reps() -> None:
    config = cli.config_from_args(_args())
    assert tuple(WORKLOADS) == ("tensor", "image", "dict", "jpeg", "stream", "io10", "io50")
    assert config.workloads == ("tensor", "image", "dict", "jpeg", "stream", "io10")
    assert config.workers == (0, 2)
    assert (config.reps, config.warmup, config.quick, config.batch_size) == (3, 1, False, None)
    assert (config.candidate, config.io) == ("ferry", False)
    assert config.batches(WORKLOADS["io10"]) == 8  # the short I/O rows of the default run


def test_io_runs_the_io_rows_at_full_size() -> None:
    config = cli.config_from_args(_args("--io"))
    assert config.workloads == tuple(WORKLOADS)
    assert config.batches(WORKLOADS["io50"]) == WORKLOADS["io50"].batches == 32
    assert config.batches(WORKLOADS["tensor"]) == WORKLOADS["tensor"].batches


def test_options_focus_the_run() -> None:
    args = _args("--quick", "--only", "tensor, jpeg", "--workers", "2", "--batch-size", "16")
    config = cli.config_from_args(args)
    assert config.workloads == ("tensor", "jpeg")
    assert config.workers == (2,)
    assert config.reps == 1  # --quick: one measured run after the warm-up
    assert config.quick
    assert config.batch_size_of(WORKLOADS["tensor"]) == 16
    assert config.batches(WORKLOADS["tensor"]) == WORKLOADS["tensor"].quick_batches


def test_explicit_reps_win_over_quick() -> None:
    assert cli.config_from_args(_args("--quick", "--reps", "4")).reps == 4


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--only", "tensor,nope"], "unknown workload 'nope'; choose from tensor, image"),
        (["--only", ","], "unknown workload"),
        (["--workers", "-1"], "expected a worker count >= 0"),
        (["--workers", "two"], "expected a worker count >= 0"),
        (["--reps", "0"], "expected a positive integer, got '0'"),
        (["--batch-size", "x"], "expected a positive integer, got 'x'"),
        (["--timeout", "-5"], "expected seconds >= 0"),
        (["--candidate", "jax"], "invalid choice: 'jax'"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_subcommand_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


def test_help_lists_the_workloads(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for name in WORKLOADS:
        assert f"  {name} " in out


# --- medians and warm-up ---------------------------------------------------------------------


def test_median_of_odd_and_even_counts() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    with pytest.raises(ValueError, match="no values"):
        median([])


def test_warm_up_runs_are_discarded_and_each_figure_has_its_own_median() -> None:
    runs = [
        RunMetrics(10, 1.0, 9.0, 900, 9.0),  # the warm-up: slow, and must not count
        RunMetrics(10, 30.0, 0.3, 100, 0.2),
        RunMetrics(10, 10.0, 0.1, 300, 0.3),
        RunMetrics(10, 20.0, 0.2, 200, 0.1),
    ]
    kept = measured(runs, warmup=1)
    assert kept == runs[1:]
    summary = Summary.of(kept)
    assert summary == Summary(20.0, 0.2, 200, 0.2, runs=3)
    assert Summary.of(measured(runs[:1], warmup=1)) is None


def test_ratio_and_fraction_of_the_memcpy_bound() -> None:
    row = _rows()[0]
    assert row.ratio == pytest.approx(20.0)
    assert row.ferry_fraction_of_memcpy == pytest.approx(0.05)
    assert _rows()[1].ratio is None
    assert _rows()[1].ferry_fraction_of_memcpy is None


def test_plan_alternates_torch_and_ferry_and_adds_threads_with_workers() -> None:
    groups = runner.plan(Config(workloads=("tensor",), workers=(0, 2)))
    assert [[label for label, _, _ in g.sides] for g in groups] == [
        ["torch", "ferry"],
        ["torch", "ferry", "ferry threads"],
    ]
    assert groups[1].sides[2][2] == (("worker_type", "thread"),)
    a_a = runner.plan(Config(workloads=("tensor",), workers=(2,), candidate="torch"))
    assert [(label, api) for label, api, _ in a_a[0].sides] == [
        ("torch", "torch"),
        ("ferry", "torch"),
    ]


# --- the report ------------------------------------------------------------------------------


def test_table_has_every_column_and_shows_errors() -> None:
    table = format_table(_rows())
    lines = table.splitlines()
    for title in [
        "workload",
        "workers",
        "torch b/s",
        "ferry b/s",
        "ratio",
        "torch CPU ms/b",
        "ferry CPU ms/b",
        "torch MiB",
        "ferry MiB",
        "torch 1st ms",
        "ferry 1st ms",
        "memcpy b/s",
        "ferry/memcpy",
    ]:
        assert title in lines[0]
    tensor = lines[2].split()
    assert tensor[:5] == ["tensor", "0", "1,000", "20,000", "20.00x"]
    assert tensor[-2:] == ["400,000", "5.0%"]
    assert lines[3].split()[:5] == ["image", "2", "thread", "100", "-"]
    assert lines[4].strip().startswith("error: ferry threads: run: TypeError")
    assert "b/s: batches per second" in table


def test_long_errors_are_cut_in_the_table() -> None:
    row = Row("dict", 0, None, 128, 10, None, None, None, errors=("x" * 1000,))
    error_line = format_table([row], legend=False).splitlines()[-1]
    assert error_line.strip().startswith("error: xxx")
    assert error_line.endswith("...")
    assert len(error_line) < 200


def test_each_failed_side_gets_its_own_error_line() -> None:
    errors = ("torch: run: RunTimeout: too slow", "ferry: run: RunTimeout: too slow")
    row = Row("jpeg", 2, "process", 32, 6, None, None, None, errors=errors)
    lines = format_table([row], legend=False).splitlines()
    assert [line.strip() for line in lines[3:]] == [f"error: {e}" for e in errors]
    assert row.error == "; ".join(errors)


def test_workers_label() -> None:
    row = _rows()[0]
    assert workers_label(row) == "0"
    assert workers_label(_rows()[1]) == "2 thread"


@pytest.mark.slow
def test_json_has_metadata_and_one_record_per_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "run_suite", lambda config, progress: _rows())
    out = tmp_path / "results" / "bench.json"
    assert main(["bench", "--quick", "--only", "tensor", "--json", str(out)]) == 1  # an error row
    document = json.loads(out.read_text())
    meta = document["meta"]
    for key in ["date", "torch_version", "ferry_version", "python", "cpu_count", "command_line"]:
        assert meta[key]
    assert meta["torch_version"] == torch.__version__
    assert meta["command_line"].endswith("-m ferry bench --quick --only tensor --json " + str(out))
    assert meta["config"]["workloads"] == ["tensor"]
    rows = document["rows"]
    assert len(rows) == 2
    assert rows[0]["workload"] == "tensor"
    assert rows[0]["ratio"] == pytest.approx(20.0)
    assert set(rows[0]["torch"]) == {
        "batches_per_s",
        "cpu_s_per_batch",
        "peak_rss_bytes",
        "first_batch_s",
        "runs",
        "epoch_batches_per_s",
        "concurrency",
    }
    assert rows[1]["ferry"] is None
    assert rows[1]["error"].startswith("ferry threads: run: TypeError")
    assert rows[1]["errors"] == [rows[1]["error"]]
    assert rows[0]["error"] is None
    assert rows[1]["tracebacks"]
    assert "error: ferry threads" in capsys.readouterr().out


def test_to_json_is_serialisable() -> None:
    json.dumps(to_json(_rows(), {"date": "now"}))


def test_plot_without_matplotlib_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)

    def must_not_run(config: Config, progress: Any) -> list[Row]:
        raise AssertionError("the benchmark ran although --plot cannot be written")

    monkeypatch.setattr(cli, "run_suite", must_not_run)
    assert main(["bench", "--plot", str(tmp_path / "ratios.png")]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err
    assert "pip install matplotlib (ferry-data's extra 'bench' has it)" in err


def test_plot_is_a_png(tmp_path: Path) -> None:
    from ferry.bench.report import write_plot

    write_plot(_rows(), tmp_path / "ratios.png")
    assert (tmp_path / "ratios.png").read_bytes().startswith(b"\x89PNG")


def test_an_unwritable_output_path_fails_before_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "run_suite", lambda config, progress: pytest.fail("ran"))
    assert main(["bench", "--json", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


# --- measurement helpers and workloads -------------------------------------------------------


def test_batch_bytes_and_digest() -> None:
    batch = {"x": torch.zeros(4, 8), "label": torch.arange(4), "name": ["a", "b", "c", "d"]}
    assert batch_nbytes(batch) == 4 * 8 * 4 + 4 * 8
    same = {"x": torch.zeros(4, 8), "label": torch.arange(4), "name": ["a", "b", "c", "d"]}
    assert batch_digest(batch) == batch_digest(same)
    same["name"][0] = "z"
    assert batch_digest(batch) != batch_digest(same)
    assert batch_digest([torch.zeros(2)]) != batch_digest((torch.zeros(2),))
    assert batch_digest(torch.tensor(1.0)) != batch_digest(torch.tensor(1))


def test_cpu_memory_and_memcpy_readings_are_positive() -> None:
    before = CpuSnapshot.now()
    sum(range(200_000))
    assert before.until(CpuSnapshot.now()) >= 0
    assert rss_bytes() > 10 << 20
    assert memcpy_batches_per_s(1 << 16, trials=2, trial_s=0.001) > 0


def test_stream_workers_yield_disjoint_shares_that_cover_the_stream() -> None:
    pool = list(range(100))
    seen: list[int] = []
    for worker in range(3):
        info = SimpleNamespace(id=worker, num_workers=3)
        seen.extend(StreamSource(pool, 10, lambda info=info: info))
    assert sorted(seen) == list(range(10))
    assert list(StreamSource(pool, 5, lambda: None)) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("library", ["torch", "ferry"])
def test_stream_datasets_subclass_the_library_iterable_and_pickle(library: str) -> None:
    api = runner.load_api(library)
    cls = stream_class(api)
    base = torch.utils.data.IterableDataset if library == "torch" else _ferry_iterable()
    assert issubclass(cls, base)
    dataset = cls([1, 2, 3], 3, api.get_worker_info)
    assert list(pickle.loads(pickle.dumps(dataset))) == [1, 2, 3]


@pytest.mark.parametrize("library", ["torch", "ferry"])
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_every_dataset_pickles_for_spawn_workers(library: str, name: str) -> None:
    workload = WORKLOADS[name]
    api = runner.load_api(library)
    dataset = workload.dataset(workload.prepare(8, True), 8, api)
    copy = pickle.loads(pickle.dumps(dataset))
    first = next(iter(copy)) if name == "stream" else copy[3]
    again = next(iter(dataset)) if name == "stream" else dataset[3]
    assert batch_digest(first) == batch_digest(again)


def _ferry_iterable() -> type:
    import ferry

    return ferry.IterableDataset  # type: ignore[no-any-return]


def test_no_module_of_the_benchmark_imports_torch_utils_data_at_import_time() -> None:
    for path in [*BENCH_DIR.glob("*.py"), BENCH_DIR.parent / "__main__.py"]:
        tree = ast.parse(path.read_text())
        for node in tree.body:
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.startswith("torch.utils.data") for n in names), path.name


# --- running -------------------------------------------------------------------------------


class _BrokenLoader:
    """A stand-in for ferry's loader: wrong data without workers, no thread workers at all."""

    def __init__(self, dataset: Any, **options: Any) -> None:
        if "worker_type" in options:
            raise TypeError("DataLoader() got an unexpected keyword argument 'worker_type'")

    def __iter__(self) -> Any:
        return iter([[torch.ones(2)] for _ in range(3)])


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_failing_side_fails_its_row_only(monkeypatch: pytest.MonkeyPatch) -> None:
    real = runner.load_api

    def load_api(name: str) -> LoaderAPI:
        api = real("torch")
        if name == "ferry":
            return LoaderAPI("ferry", _BrokenLoader, api.TensorDataset, api.get_worker_info)
        return api

    monkeypatch.setattr(runner, "load_api", load_api)
    lines: list[str] = []
    config = Config(workloads=("tensor",), workers=(0,), reps=1, quick=True, batch_size=64)
    [row] = runner.run_suite(config, lines.append)
    assert row.torch is not None
    assert row.ferry is not None  # it ran, but returned the wrong first batch
    assert row.error == "ferry: the first batch differs from torch's for the same seed"
    assert len(lines) == 4
    assert "warm-up" in lines[0]
    assert "rep 1/1" in lines[3]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quick_end_to_end_in_a_subprocess(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "ferry", "bench", "--quick", "--only", "tensor"]
    command += ["--workers", "0", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=110, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ferry bench: done in" in done.stderr
    assert "warm-up" in done.stderr
    assert done.stdout.splitlines()[0].startswith("workload  workers  torch b/s  ferry b/s")
    [row] = json.loads(out.read_text())["rows"]
    assert (row["workload"], row["workers"], row["error"]) == ("tensor", 0, None)
    assert row["ratio"] > 0
    assert row["memcpy_batches_per_s"] > 0
    assert row["torch"]["cpu_s_per_batch"] > 0
    assert row["ferry"]["first_batch_s"] > 0
