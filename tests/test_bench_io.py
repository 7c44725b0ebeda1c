"""Tests of the I/O-latency workloads of ``python -m ferry bench`` (io10, io50) and their
latency report: the dataset, the every-index-once check, the C/L and CPU bounds.

No speed is asserted: the sleeps are injected where a test needs none, and the one real run
only checks that the rows are made, checked and reported.
"""

from __future__ import annotations

import argparse
import json
import pickle
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from ferry.bench import cli, runner
from ferry.bench.latency import (
    LatencyLine,
    concurrency_bound,
    cpu_bound,
    format_latency,
    latency_lines,
    loader_concurrency,
)
from ferry.bench.measure import check_keys
from ferry.bench.report import to_json
from ferry.bench.results import Row, RunMetrics, Summary
from ferry.bench.runner import Config
from ferry.bench.workloads import WORKLOADS, LoaderAPI, SlowReads, sample_indices

pytestmark = pytest.mark.usefixtures("guard_global_state")


class _Clock:
    """An injected ``sleep`` that records the waits and advances a fake clock instead."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


# --- the dataset -----------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "latency_s"), [("io10", 0.010), ("io50", 0.050)])
def test_io_workloads_are_batch_32_of_1024_samples_waiting_their_latency(
    name: str, latency_s: float
) -> None:
    workload = WORKLOADS[name]
    assert workload.latency_s == latency_s
    assert (workload.batch_size, workload.batches * workload.batch_size) == (32, 1024)
    dataset = workload.dataset(workload.prepare(1024, False), 1024, runner.load_api("ferry"))
    assert isinstance(dataset, SlowReads)
    assert (dataset.latency_s, len(dataset)) == (latency_s, 1024)


def test_each_sample_waits_the_latency_then_returns_its_index_and_64_kib() -> None:
    clock = _Clock()
    dataset = SlowReads(0.05, 300, sleep=clock.sleep)
    for index in (0, 7, 299):
        got, payload = dataset[index]
        assert got == index
        assert payload.dtype == np.uint8
        assert payload.nbytes == 64 << 10
        assert (payload == index % 251).all()
    assert clock.waits == [0.05] * 3
    assert clock.now == pytest.approx(0.15)
    with pytest.raises(IndexError, match="out of range"):
        dataset[300]
    assert len(clock.waits) == 3  # an index out of range waits for nothing


def test_the_dataset_pickles_with_the_real_sleep() -> None:
    copy = pickle.loads(pickle.dumps(SlowReads(0.0, 4)))
    assert copy[2][0] == 2
    assert len(copy) == 4


def test_sample_indices_of_a_collated_batch() -> None:
    batch = [torch.tensor([5, 1, 9]), torch.zeros(3, 8, dtype=torch.uint8)]
    assert sample_indices(batch) == [5, 1, 9]


# --- every index exactly once ----------------------------------------------------------------


def test_a_whole_epoch_of_distinct_indices_passes() -> None:
    check_keys([3, 0, 2, 1], 4, whole_epoch=True)
    check_keys([3, 0], 4, whole_epoch=False)  # part of an epoch: nothing is missing yet


@pytest.mark.parametrize(
    ("seen", "whole_epoch", "message"),
    [
        ([0, 1, 1, 2, 3], True, "1 indices came more than once (first 1)"),
        ([0, 1, 3], True, "1 of 4 indices never came (first 2)"),
        ([0, 1, 2, 3, 7], True, "1 indices outside range(4) (first 7)"),
        ([2, 2], False, "came more than once"),
        ([-1], False, "outside range(4)"),
    ],
)
def test_lost_repeated_or_invented_indices_fail(
    seen: list[int], whole_epoch: bool, message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_keys(seen, 4, whole_epoch=whole_epoch)


# --- the bounds ------------------------------------------------------------------------------


def test_the_concurrency_bound_is_c_over_l() -> None:
    assert concurrency_bound(1, 0.010) == pytest.approx(100.0)
    assert concurrency_bound(2, 0.010) == pytest.approx(200.0)
    assert concurrency_bound(32, 0.050) == pytest.approx(640.0)
    with pytest.raises(ValueError):
        concurrency_bound(0, 0.01)
    with pytest.raises(ValueError):
        concurrency_bound(2, 0.0)


def test_the_cpu_bound_is_cores_times_batch_over_cpu_per_batch() -> None:
    assert cpu_bound(0.004, 32, 1) == pytest.approx(8000.0)
    assert cpu_bound(0.004, 32, 2) == pytest.approx(16000.0)
    assert cpu_bound(0.0, 32, 2) is None


class _Stats:
    def __init__(self, plain: dict[str, Any] | None) -> None:
        self.plain = plain

    def as_dict(self) -> dict[str, Any]:
        if self.plain is None:
            raise RuntimeError("no epoch yet")
        return self.plain


def _loader_with(plain: dict[str, Any] | None) -> Any:
    return SimpleNamespace(stats=lambda: _Stats(plain))


def test_concurrency_comes_from_the_loader_when_it_reports_it() -> None:
    assert loader_concurrency(_loader_with({"concurrency": 48, "num_workers": 2}), 2) == 48
    # No concurrency reported: the workers it resolved ("auto" included), else the argument.
    assert loader_concurrency(_loader_with({"num_workers": 6}), 2) == 6
    assert loader_concurrency(_loader_with({"num_workers": 0}), 0) == 1
    assert loader_concurrency(_loader_with({"concurrency": True}), 3) == 3  # not a count
    assert loader_concurrency(_loader_with(None), 4) == 4  # stats() raised
    assert loader_concurrency(object(), 0) == 1
    assert loader_concurrency(object(), 8) == 8


def test_concurrency_of_real_loaders() -> None:
    dataset = SlowReads(0.0, 8)
    torch_api, ferry_api = runner.load_api("torch"), runner.load_api("ferry")
    assert loader_concurrency(torch_api.DataLoader(dataset, num_workers=2), 2) == 2
    assert loader_concurrency(torch_api.DataLoader(dataset), 0) == 1
    ferry_loader = ferry_api.DataLoader(dataset, batch_size=4)
    assert loader_concurrency(ferry_loader, 0) == 1
    list(ferry_loader)
    assert loader_concurrency(ferry_loader, 0) == 1


def _side(samples_per_s: float, cpu_ms: float, concurrency: int | None, batch: int = 32) -> Summary:
    return Summary(
        batches_per_s=samples_per_s / batch,
        cpu_s_per_batch=cpu_ms / 1e3,
        peak_rss_bytes=1 << 28,
        first_batch_s=0.3,
        runs=3,
        epoch_batches_per_s=samples_per_s / batch,
        concurrency=concurrency,
    )


def _io_rows() -> list[Row]:
    torch0, torch2 = _side(98.0, 8.0, 1), _side(190.0, 4.0, 2)
    return [
        Row("io10", 0, None, 32, 32, torch0, _side(99.0, 3.2, 1), 9e4, latency_s=0.01),
        Row("io10", 2, "process", 32, 32, torch2, _side(196.0, 4.0, 2), 9e4, latency_s=0.01),
        # A ferry that reports 64 reads in flight, but spends 16 ms of CPU per batch.
        Row("io10", 2, "thread", 32, 32, torch2, _side(1900.0, 16.0, 64), 9e4, latency_s=0.01),
        Row("tensor", 0, None, 256, 10, _side(1e5, 1.0, 1), _side(1e5, 1.0, 1), 9e4),
    ]


def test_latency_lines_set_each_loader_beside_its_bounds() -> None:
    lines = latency_lines(_io_rows(), cpus=2)
    # torch once per worker count; the row without a latency has no line.
    assert [(x.workers, x.side) for x in lines] == [
        ("0", "torch"),
        ("0", "ferry"),
        ("2 proc", "torch"),
        ("2 proc", "ferry"),
        ("2 thread", "ferry"),
    ]
    inline, _, torch2, ferry2, threads = lines
    assert inline.concurrency_bound == pytest.approx(100.0)
    assert inline.samples_per_s == pytest.approx(98.0)
    assert inline.share_of_bound == pytest.approx(0.98)
    assert inline.cpu_bound == pytest.approx(32 / 0.008)  # one core inline
    assert torch2.cpu_bound == pytest.approx(2 * 32 / 0.004)  # 2 workers + main on 2 CPUs
    assert (torch2.concurrency_bound, ferry2.bound_by) == (pytest.approx(200.0), "C/L")
    assert threads.concurrency == 64
    assert threads.concurrency_bound == pytest.approx(6400.0)
    assert threads.cpu_bound == pytest.approx(32 / 0.016)  # one core: the GIL
    assert threads.bound_by == "CPU"


def test_a_side_without_reported_concurrency_is_given_its_workers() -> None:
    row = Row("io50", 2, "process", 32, 32, _side(39.0, 4.0, None), None, None, latency_s=0.05)
    [line] = latency_lines([row], cpus=2)
    assert (line.concurrency, line.concurrency_bound) == (2, pytest.approx(40.0))


def test_the_latency_table() -> None:
    table = format_latency(_io_rows(), cpus=2)
    lines = table.splitlines()
    assert lines[0].split() == [
        "workload",
        "workers",
        "loader",
        "L",
        "ms",
        "C",
        "C/L",
        "bound",
        "samples/s",
        "of",
        "C/L",
        "CPU",
        "bound",
        "bound",
        "by",
    ]
    assert lines[2].split() == ["io10", "0", "torch", "10", "1", "100", "98", "98%", "4,000", "C/L"]
    assert lines[6].split()[-5:] == ["6,400", "1,900", "30%", "2,000", "CPU"]
    assert "C/L bound: C / L samples/s" in table
    assert format_latency(_io_rows()[3:]) == ""


def test_json_has_a_latency_record_per_loader() -> None:
    document = json.loads(json.dumps(to_json(_io_rows(), {})))
    assert [r["latency_s"] for r in document["rows"]] == [0.01, 0.01, 0.01, None]
    records = document["latency"]
    assert len(records) == 5
    assert records[0]["concurrency_bound"] == pytest.approx(100.0)
    assert records[-1]["bound_by"] == "CPU"
    assert "latency" not in to_json(_io_rows()[3:], {})


def test_a_latency_line_without_a_rate_has_no_share() -> None:
    line = LatencyLine("io10", "0", "ferry", 0.01, 1, 100.0, None, None)
    assert line.share_of_bound is None
    assert line.bound_by == "C/L"


def test_summaries_keep_the_median_epoch_rate_and_concurrency() -> None:
    runs = [RunMetrics(32, 6.0, 0.01, 1, 0.3, 5.0, c) for c in (2, 2, 3)]
    summary = Summary.of(runs)
    assert summary is not None
    assert (summary.epoch_batches_per_s, summary.concurrency) == (5.0, 2)
    old_style = Summary.of([RunMetrics(32, 6.0, 0.01, 1, 0.3)])
    assert old_style is not None
    assert (old_style.epoch_batches_per_s, old_style.concurrency) == (None, None)


# --- quick mode and a real run ---------------------------------------------------------------


def test_the_quick_run_includes_the_io_rows_and_keeps_them_short() -> None:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    config = cli.config_from_args(parser.parse_args(["--quick"]))
    assert {"io10", "io50"} <= set(config.workloads)
    for name in ("io10", "io50"):
        workload = WORKLOADS[name]
        assert workload.latency_s is not None
        samples = config.batches(workload) * config.batch_size_of(workload)
        assert samples == 8
        assert samples * workload.latency_s <= 0.5  # an inline run at most; workers less
    # --batch-size still wins.
    assert Config(quick=True, batch_size=16).batch_size_of(WORKLOADS["io10"]) == 16


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_quick_io_rows_run_check_every_index_and_report_bounds() -> None:
    lines: list[str] = []
    config = Config(workloads=("io10",), workers=(0, 2), reps=1, quick=True)
    rows = runner.run_suite(config, lines.append)
    assert [(r.workload, r.workers, r.worker_type) for r in rows] == [
        ("io10", 0, None),
        ("io10", 2, "process"),
        ("io10", 2, "thread"),
    ]
    for row in rows:
        assert row.error is None, row.error
        assert row.latency_s == 0.01
        assert row.torch is not None
        assert row.ferry is not None
        assert row.torch.concurrency == max(row.workers, 1)
        assert (row.ferry.concurrency or 0) >= max(row.workers, 1)  # more if it reports more
        assert (row.torch.epoch_batches_per_s or 0) > 0
    table = format_latency(rows)
    assert len(table.splitlines()) >= 2 + 4  # torch and ferry inline, torch, ferry x2 with 2


class _DuplicatingLoader:
    """A stand-in for ferry's loader that hands out the first batch twice."""

    def __init__(self, dataset: Any, batch_size: int, **options: Any) -> None:
        self.dataset, self.batch_size = dataset, batch_size

    def __iter__(self) -> Any:
        size = self.batch_size
        first = [self.dataset[i] for i in range(size)]
        batch = [
            torch.tensor([i for i, _ in first]),
            torch.from_numpy(np.stack([a for _, a in first])),
        ]
        return iter([batch, batch])


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_loader_that_repeats_samples_fails_its_row(monkeypatch: pytest.MonkeyPatch) -> None:
    real = runner.load_api

    def load_api(name: str) -> LoaderAPI:
        api = real("torch")
        if name == "ferry":
            return LoaderAPI("ferry", _DuplicatingLoader, api.TensorDataset, api.get_worker_info)
        return api

    monkeypatch.setattr(runner, "load_api", load_api)
    config = Config(workloads=("io10",), workers=(0,), reps=1, quick=True)
    [row] = runner.run_suite(config, lambda line: None)
    assert row.torch is not None
    assert row.ferry is None
    assert row.error is not None
    assert "ferry: run: ValueError: 4 indices came more than once" in row.error


def test_a_full_run_leaves_out_the_inline_loader_on_latency_workloads() -> None:
    from ferry.bench.runner import plan

    full = Config(workloads=("io10", "tensor"), workers=(0, 2), reps=1, quick=False)
    assert [(g.workload.name, g.workers) for g in plan(full)] == [
        ("io10", 2),
        ("tensor", 0),
        ("tensor", 2),
    ]
    alone = Config(workloads=("io10",), workers=(0,), reps=1, quick=False)
    assert [g.workers for g in plan(alone)] == [0]
    quick = Config(workloads=("io10",), workers=(0, 2), reps=1, quick=True)
    assert [g.workers for g in plan(quick)] == [0, 2]
