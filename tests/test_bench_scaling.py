"""Tests of ``python -m ferry bench --scaling``: its options, the roof, the report, one tiny run.

No speed is asserted: the roof is run on a fake workload to check that it sums what its
processes measured, and the real run only checks that every side is measured and reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ferry.__main__ import main
from ferry.bench import cli, scaling_cli
from ferry.bench.roof import RoofPool, StackInto, roof_of, shares
from ferry.bench.scaling import (
    SCALING_WORKLOADS,
    ScalingConfig,
    ScalingRow,
    SideResult,
    default_worker_counts,
    epoch_batches,
    run_scaling,
)
from ferry.bench.scaling_report import (
    TITLES,
    format_scaling,
    scaling_cells,
    scaling_json,
    scaling_markdown,
)
from ferry.bench.workloads import JpegCrops, _crop_box

pytestmark = pytest.mark.usefixtures("guard_global_state")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    return parser.parse_args(list(argv))


class _Squares:
    """A fake workload: sample ``i`` is a float tensor holding ``i``; ``bad`` fails."""

    def __init__(self, length: int, bad: int | None = None) -> None:
        self.length, self.bad = length, bad

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.bad:
            raise ValueError(f"sample {index} is broken")
        return torch.full((4,), float(index))


def _row(**sides: float | None) -> ScalingRow:
    results = tuple(
        SideResult(label.replace("_", " "), () if rate is None else (rate,), None)
        for label, rate in sides.items()
    )
    return ScalingRow("jpeg", 2, 128, 8, "cpu", 1000.0, (600.0, 400.0), None, results)


# --- options -------------------------------------------------------------------------------


def test_default_worker_counts_double_up_to_the_cpu_count() -> None:
    assert default_worker_counts(1) == (1,)
    assert default_worker_counts(2) == (1, 2)
    assert default_worker_counts(6) == (1, 2, 4, 6)
    assert default_worker_counts(16) == (1, 2, 4, 8, 16)


def test_an_epoch_gives_every_worker_the_same_number_of_batches() -> None:
    jpeg, uint8 = SCALING_WORKLOADS["jpeg"], SCALING_WORKLOADS["uint8"]
    assert (jpeg.batch_size, uint8.batch_size) == (128, 256)
    assert [epoch_batches(jpeg, n) for n in (1, 2, 8, 15)] == [4, 8, 32, 60]
    assert [epoch_batches(uint8, n) for n in (1, 2, 5, 15)] == [12, 12, 30, 90]
    for n in range(1, 17):
        assert epoch_batches(uint8, n) % n == 0
    assert [epoch_batches(jpeg, n, per_worker=16) for n in (1, 15)] == [16, 240]


def test_scaling_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["--scaling", "--workers-list", "8,15,1", "--only", "jpeg", "--reps", "2"]
    argv += ["--no-threads", "--budget", "300", "--timeout", "60"]
    config = scaling_cli.scaling_config(_args(*argv))
    assert config == ScalingConfig(
        workloads=("jpeg",), workers=(8, 15, 1), reps=2, feed="cpu", threads=False,
        timeout_s=60.0, budget_s=300.0,
    )  # fmt: skip
    longer = scaling_cli.scaling_config(
        _args("--scaling", "--balanced", "--batches-per-worker", "16")
    )
    assert (longer.balanced, longer.batches_per_worker) == (True, 16)
    assert scaling_cli.scaling_config(_args("--scaling", "--unmoved")).unmoved is True
    defaults = scaling_cli.scaling_config(_args("--scaling"), cpus=16)
    assert (defaults.balanced, defaults.batches_per_worker) == (False, None)
    assert defaults.unmoved is False
    assert (defaults.workloads, defaults.workers) == (("jpeg", "uint8"), (1, 2, 4, 8, 16))
    assert (defaults.reps, defaults.feed, defaults.threads) == (3, "cpu", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert scaling_cli.scaling_config(_args("--scaling")).feed == "gpu"  # auto
    assert scaling_cli.scaling_config(_args("--scaling", "--feed", "cpu")).feed == "cpu"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scaling", "--workers-list", "0,2"], "expected worker counts >= 1"),
        (["--scaling", "--workers", "2"], "--workers cannot go with --scaling"),
        (["--scaling", "--plot", "x.png"], "--plot cannot go with --scaling"),
        (["--scaling", "--only", "tensor"], "--scaling runs jpeg, uint8, not 'tensor'"),
        (["--scaling", "--feed", "gpu"], "--feed gpu needs CUDA"),
        (["--markdown", "out.md"], "--markdown go(es) with --scaling"),
        (["--workers-list", "2"], "--workers-list go(es) with --scaling"),
        (["--balanced"], "--balanced go(es) with --scaling"),
        (["--unmoved"], "--unmoved go(es) with --scaling"),
        (["--batches-per-worker", "8"], "--batches-per-worker go(es) with --scaling"),
        (["--scaling", "--batches-per-worker", "0"], "expected a positive integer, got '0'"),
        (["--only", "uint8"], "workload 'uint8' runs with --scaling only"),
    ],
)
def test_bad_scaling_arguments_exit_2(
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(scaling_cli, "run_scaling", lambda *a, **k: pytest.fail("ran"))
    monkeypatch.setattr(cli, "run_suite", lambda *a: pytest.fail("ran"))
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


# --- the roof ------------------------------------------------------------------------------


def test_shares_are_contiguous_and_even() -> None:
    batches = [[i] for i in range(7)]
    assert shares(batches, 3) == [[[0], [1], [2]], [[3], [4]], [[5], [6]]]
    assert shares(batches, 1) == [batches]
    with pytest.raises(ValueError, match="at least one share"):
        shares(batches, 0)


def test_the_roof_is_the_median_pass_of_summed_rates() -> None:
    # Three passes of two processes: summed, 150, 350 and 250 samples/s.
    assert roof_of([[100.0, 50.0], [300.0, 50.0], [200.0, 50.0]]) == (250.0, (200.0, 50.0))
    with pytest.raises(ValueError, match="at least one timed pass"):
        roof_of([[1.0], []])
    with pytest.raises(ValueError, match="at least one timed pass"):
        roof_of([])


def _roof(dataset: Any, batches: list[list[int]], processes: int, *, passes: int,
          timeout_s: float) -> tuple[float, tuple[float, ...], int]:  # fmt: skip
    """``passes`` passes of a :class:`RoofPool`: the roof, each process's rate, the samples."""
    with RoofPool(dataset, batches, processes, timeout_s=timeout_s) as pool:
        roof, per_process = roof_of([pool.measure() for _ in range(passes)])
    return roof, per_process, pool.samples


def test_stack_into_reuses_its_batch_and_collates_the_rest_as_default_collate() -> None:
    collate = StackInto()
    first = collate([torch.ones(3), torch.zeros(3)])
    assert first.tolist() == [[1.0] * 3, [0.0] * 3]
    second = collate([torch.full((3,), 2.0), torch.full((3,), 3.0)])
    assert second.data_ptr() == first.data_ptr()  # no fresh batch memory
    assert collate([torch.ones(2)]).shape == (1, 2)
    arrays = [np.full((2, 2), k, dtype=np.uint8) for k in range(3)]
    stacked = collate(arrays)
    assert (stacked.dtype, stacked[:, 0, 0].tolist()) == (torch.uint8, [0, 1, 2])
    assert collate(arrays[::-1]).data_ptr() == stacked.data_ptr()
    mixed = collate([{"x": torch.ones(2), "y": 1}, {"x": torch.zeros(2), "y": 2}])
    assert mixed["y"].tolist() == [1, 2]


@pytest.mark.timeout(60)
def test_the_roof_runs_every_share_in_its_own_process() -> None:
    batches = [[i, i + 1] for i in range(0, 16, 2)]
    roof, per_process, samples = _roof(_Squares(16), batches, 2, passes=2, timeout_s=30)
    assert len(per_process) == 2
    assert all(rate > 0 for rate in per_process)
    assert roof == pytest.approx(sum(per_process))
    assert samples == 16


@pytest.mark.timeout(60)
def test_the_roof_keeps_its_processes_between_passes_and_ends_them_on_close() -> None:
    import multiprocessing

    batches = [[i, i + 1] for i in range(0, 8, 2)]
    with RoofPool(_Squares(8), batches, 2, min_pass_s=0.01, timeout_s=30) as pool:
        first = multiprocessing.active_children()
        assert sorted(p.name for p in first) == ["ferry-bench-roof-0", "ferry-bench-roof-1"]
        passes = [pool.measure() for _ in range(3)]
        assert multiprocessing.active_children() == first  # the same two, each pass
    assert all(len(rates) == 2 and min(rates) > 0 for rates in passes)
    assert pool.samples == 8
    assert multiprocessing.active_children() == []
    with pytest.raises(RuntimeError, match="closed"):
        pool.measure()


@pytest.mark.timeout(60)
def test_a_failing_roof_process_fails_the_roof_quickly() -> None:
    batches = [[0, 1], [2, 3]]
    with pytest.raises(RuntimeError, match="sample 2 is broken"):
        _roof(_Squares(4, bad=2), batches, 2, passes=1, timeout_s=30)


# --- the jpeg dataset ------------------------------------------------------------------------


def test_crop_boxes_fit_the_image_and_keep_an_aspect_of_3_4_to_4_3() -> None:
    for seed in range(200):
        left, top, right, bottom = _crop_box(500, 375, random.Random(seed))
        assert 0 <= left < right <= 500
        assert 0 <= top < bottom <= 375
        assert 3 / 4 - 0.02 <= (right - left) / (bottom - top) <= 4 / 3 + 0.02
    assert _crop_box(1, 1, random.Random(0)) == (0, 0, 1, 1)


def test_jpeg_crops_are_224_uint8_and_the_same_for_the_same_index() -> None:
    workload = SCALING_WORKLOADS["jpeg"]
    dataset = workload.build(workload.prepare(4, True), 4)
    assert isinstance(dataset, JpegCrops)
    sample = dataset[1]
    assert (sample.shape, sample.dtype) == ((3, 224, 224), torch.uint8)
    assert torch.equal(dataset[1], sample)
    assert not torch.equal(dataset[2], sample)


# --- the report ------------------------------------------------------------------------------


def test_each_loader_is_a_share_of_the_roof_and_ferry_a_ratio_to_torch() -> None:
    row = _row(torch=800.0, ferry=900.0, ferry_threads=None)
    assert row.share_of_roof("torch") == pytest.approx(0.8)
    assert row.over_torch("ferry") == pytest.approx(1.125)
    assert row.share_of_roof("ferry threads") is None
    cells = dict(zip(TITLES, scaling_cells(row), strict=True))
    assert cells["roof/s"] == "1,000"
    assert (cells["torch/s"], cells["torch %roof"]) == ("800", "80.0%")
    assert (cells["ferry %roof"], cells["ferry x torch"]) == ("90.0%", "1.12x")
    # The roof's processes ran at 600 and 400 samples/s: a loader giving each worker half the
    # epoch waits for the one on the slower CPU, so 2 x 400 is its most here.
    assert row.equal_share_bound == pytest.approx(800.0)
    assert (cells["bound/s"], cells["ferry %bound"]) == ("800", "112.5%")
    assert (cells["threads/s"], cells["threads %roof"], cells["threads x torch"]) == ("-",) * 3


def test_shares_and_ratios_pair_each_epoch_with_the_roof_and_torch_of_its_round() -> None:
    # The machine doubles its speed each round; ferry's second epoch is its best. Medians
    # taken apart would read 2,000 over a 2,000 roof (100%) and 2,000 over torch's 1,600
    # (1.25x); paired by round, ferry is at 75-100% of each round's roof, 90% in the middle.
    row = ScalingRow(
        "jpeg", 2, 128, 8, "cpu", 2000.0, (1200.0, 800.0), None,
        (SideResult("torch", (800.0, 1600.0, 3200.0)),
         SideResult("ferry", (900.0, 2000.0, 3000.0))),
        roof_rounds=((600.0, 400.0), (1200.0, 800.0), (2400.0, 1600.0)),
    )  # fmt: skip
    assert row.share_of_roof("torch") == pytest.approx(0.8)
    assert row.share_of_roof("ferry") == pytest.approx(0.9)  # of 0.9, 1.0, 0.75
    assert row.equal_share_bound == pytest.approx(1600.0)  # of 800, 1,600, 3,200
    assert row.share_of_bound("ferry") == pytest.approx(1.125)  # of 1.125, 1.25, 0.9375
    assert row.over_torch("ferry") == pytest.approx(1.125)  # of 1.125, 1.25, 0.9375
    # A side that failed after one round pairs its one epoch with the first round.
    cut = dataclasses.replace(row, sides=(*row.sides, SideResult("ferry unmoved", (700.0,), "x")))
    assert cut.share_of_roof("ferry unmoved") == pytest.approx(0.7)
    assert cut.over_torch("ferry unmoved") == pytest.approx(0.875)


@pytest.mark.timeout(60)
def test_a_roof_failing_in_a_later_round_keeps_the_rounds_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ferry.bench import scaling

    class FailsSecond:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.passes = 0

        def measure(self) -> tuple[float, ...]:
            self.passes += 1
            if self.passes == 2:
                raise RuntimeError("a roof process died (exit code 9)")
            return (100.0,)

        def close(self) -> None:
            pass

    monkeypatch.setattr(scaling, "RoofPool", FailsSecond)
    config = ScalingConfig(workloads=("uint8",), workers=(1,), reps=3, quick=True, threads=False)
    [row] = run_scaling(config, lambda line: None)
    assert row.roof_rounds == ((100.0,),)
    assert (row.roof, row.roof_per_process) == (100.0, (100.0,))
    assert row.roof_error == "round 2: RuntimeError: a roof process died (exit code 9)"
    assert [len(side.epochs) for side in row.sides] == [3, 3]  # the loaders go on
    torch_epochs = row.sides[0].epochs
    assert row.share_of_roof("torch") == pytest.approx(torch_epochs[0] / 100.0)


def test_table_markdown_and_json_carry_the_rows_and_their_failures() -> None:
    broken = ScalingRow(
        "uint8", 1, 256, 12, "cpu", None, (), "RuntimeError: too slow",
        (SideResult("torch", (10.0,)), SideResult("ferry", (), "epoch 0: RunTimeout: slow")),
    )  # fmt: skip
    skipped = ScalingRow("uint8", 2, 256, 12, "cpu", None, skipped="budget spent")
    rows = [broken, skipped, _row(torch=800.0, ferry=900.0)]
    table = format_scaling(rows)
    lines = table.splitlines()
    assert lines[2].split()[:3] == ["jpeg", "2", "1,000"]  # by workload, then workers
    assert "roof: RuntimeError: too slow" in table
    assert "ferry: epoch 0: RunTimeout: slow" in table
    assert "not run: budget spent" in table
    page = scaling_markdown(rows, {"date": "today"})
    assert "| jpeg | 2 | 1,000 | 800 | 800 | 80.0% | 900 | 90.0% | 112.5% | 1.12x |" in page
    assert "- uint8 at 2: not run: budget spent" in page
    assert "- **date:** today" in page
    document = json.loads(json.dumps(scaling_json(rows, {"date": "today"})))
    ferry = document["scaling"][2]["sides"][1]
    assert (ferry["label"], ferry["share_of_roof"]) == ("ferry", pytest.approx(0.9))
    assert ferry["share_of_bound"] == pytest.approx(1.125)
    assert document["scaling"][2]["equal_share_bound"] == pytest.approx(800.0)
    assert document["scaling"][0]["equal_share_bound"] is None  # (its roof failed)
    assert document["scaling"][1]["skipped"] == "budget spent"


# --- running -------------------------------------------------------------------------------


def test_a_spent_budget_leaves_every_row_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ferry.bench.scaling._run_row", lambda *a: pytest.fail("ran"))
    seen: list[int] = []
    config = ScalingConfig(workers=(2, 1), budget_s=0.0, quick=True)
    rows = run_scaling(config, lambda line: None, on_row=lambda rows: seen.append(len(rows)))
    assert [(r.workers, r.workload, r.skipped) for r in rows] == [
        (2, "jpeg", "budget spent"),
        (2, "uint8", "budget spent"),
        (1, "jpeg", "budget spent"),
        (1, "uint8", "budget spent"),
    ]
    assert seen == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_tiny_scaling_run_measures_every_side_and_writes_as_it_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out, page = tmp_path / "scaling.json", tmp_path / "scaling.md"
    argv = ["bench", "--scaling", "--quick", "--workers-list", "1", "--timeout", "60"]
    assert main([*argv, "--json", str(out), "--markdown", str(page)]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0].split()[:3] == ["workload", "workers", "roof/s"]
    records: list[dict[str, Any]] = json.loads(out.read_text())["scaling"]
    assert [(r["workload"], r["workers"]) for r in records] == [("jpeg", 1), ("uint8", 1)]
    for record in records:
        assert record["roof"] > 0
        assert [s["label"] for s in record["sides"]] == ["torch", "ferry", "ferry threads"]
        assert all(s["error"] is None and len(s["epochs"]) == 1 for s in record["sides"])
        assert [len(rates) for rates in record["roof_rounds"]] == [1]  # one pass, 1 process
    assert "| uint8 | 1 |" in page.read_text()
    header = captured.out.splitlines()[0]
    assert "balanced" not in header  # (its columns only when it ran)
    assert "unmoved" not in header
    assert json.loads(out.read_text())["meta"]["feed"] == "cpu"


@pytest.mark.timeout(120)
def test_the_balanced_side_runs_with_longer_epochs_beside_torchs() -> None:
    config = ScalingConfig(
        workloads=("uint8",), workers=(2,), reps=1, quick=True, threads=False, balanced=True,
        batches_per_worker=8,
    )  # fmt: skip
    [row] = run_scaling(config, lambda line: None)
    assert row.batches == 16
    assert [side.label for side in row.sides] == ["torch", "ferry", "ferry balanced"]
    # (no error: its first batch is torch's, as every side's must be)
    assert [side.error for side in row.sides] == [None, None, None]
    header = format_scaling([row]).splitlines()[0]
    assert header.endswith("balanced/s  balanced %roof  balanced x torch")


@pytest.mark.timeout(120)
def test_the_unmoved_side_is_ferry_without_moving_its_workers() -> None:
    config = ScalingConfig(
        workloads=("uint8",), workers=(2,), reps=1, quick=True, threads=False, balanced=True,
        unmoved=True,
    )  # fmt: skip
    [row] = run_scaling(config, lambda line: None)
    labels = ["torch", "ferry", "ferry balanced", "ferry unmoved"]
    assert [side.label for side in row.sides] == labels
    assert [side.error for side in row.sides] == [None] * 4
    lines = format_scaling([row], legend=False).splitlines()
    assert lines[0].endswith("balanced x torch  unmoved/s  unmoved %roof  unmoved x torch")
    assert len(lines[2].split()) == len(TITLES)  # (every column shown: one cell each)
    cells = dict(zip(TITLES, scaling_cells(row), strict=True))
    unmoved = row.side("ferry unmoved")
    assert unmoved is not None
    assert cells["unmoved/s"] == f"{unmoved.samples_per_s:,.0f}"
    markdown = scaling_markdown([row], {})
    assert "| unmoved/s | unmoved %roof | unmoved x torch |" in markdown


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_gpu_feed_passes_its_options_and_runs_its_step_per_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a GPU here: the step stays on the CPU and the device sync is a no-op; what is
    checked is that the GPU feed's loader options are taken and every batch goes through it."""
    from ferry.bench import scaling

    stepped: list[int] = []
    built: list[dict[str, Any]] = []
    monkeypatch.setattr(scaling, "_gpu_step", lambda: lambda batch: stepped.append(len(batch)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    real = scaling.load_api

    def spy(name: str) -> Any:
        api = real(name)

        def loader(*args: Any, **options: Any) -> Any:
            options.pop("pin_memory")  # no GPU to pin for here
            built.append(options)
            return api.DataLoader(*args, **options)

        return dataclasses.replace(api, DataLoader=loader)

    monkeypatch.setattr(scaling, "load_api", spy)
    config = ScalingConfig(workloads=("uint8",), workers=(1,), reps=1, feed="gpu", quick=True)
    [row] = run_scaling(config, lambda line: None)
    assert [side.error for side in row.sides] == [None, None, None]
    assert {(o["prefetch_factor"], o["persistent_workers"], o["shuffle"]) for o in built} == {
        (4, True, True)
    }
    samples = row.batches * row.batch_size
    assert sum(stepped) == 3 * 2 * samples  # 3 loaders, a warm-up and a measured epoch each


class _Stalls(_Squares):
    """Samples from index 2 on take 30 s: a roof that must be cut short."""

    def __getitem__(self, index: int) -> torch.Tensor:
        if index >= 2:
            time.sleep(30)
        return super().__getitem__(index)


@pytest.mark.timeout(60)
def test_a_roof_past_its_timeout_fails_and_stops_its_processes() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"the roof took longer than 0\.5 s"):
        _roof(_Stalls(4), [[0, 1], [2, 3]], 1, passes=1, timeout_s=0.5)
    assert time.monotonic() - start < 15


class _Dies(_Squares):
    """Sample 3 ends its process without a word, as the OOM killer would."""

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 3:
            os._exit(3)
        return super().__getitem__(index)


@pytest.mark.timeout(60)
def test_a_roof_process_that_dies_fails_the_roof_without_waiting_for_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"a roof process died \(exit code 3\)"):
        _roof(_Dies(4), [[0, 1], [2, 3]], 1, passes=1, timeout_s=50)
    assert time.monotonic() - start < 15


class _NoThreads:
    """A stand-in for ferry's loader: builds, but fails as its first epoch starts."""

    def __init__(self, dataset: Any, **options: Any) -> None:
        self.options = options

    def __iter__(self) -> Any:
        raise TypeError("thread workers are not supported here")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_failing_side_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from ferry.bench import scaling

    real = scaling.load_api
    calls: list[str] = []

    def load_api(name: str) -> Any:
        calls.append(name)
        api = real(name)
        if name == "ferry" and calls.count("ferry") == 2:  # the thread side's
            return dataclasses.replace(api, DataLoader=_NoThreads)
        return api

    monkeypatch.setattr(scaling, "load_api", load_api)
    config = ScalingConfig(workloads=("uint8",), workers=(1,), reps=1, quick=True)
    [row] = run_scaling(config, lambda line: None)
    assert row.roof is not None
    assert [(s.label, s.error) for s in row.sides] == [
        ("torch", None),
        ("ferry", None),
        ("ferry threads", "epoch 0: TypeError: thread workers are not supported here"),
    ]
    assert row.over_torch("ferry") is not None
    assert row.share_of_roof("ferry threads") is None
