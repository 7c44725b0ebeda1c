"""Tests of ``python -m ferry doctor``: loading MODULE:FUNCTION, measuring, the rules, the report.

End-to-end runs use the sleep-based loaders of ``tests/doctor_workloads.py``: a sleep takes no
CPU, so the speed-ups they assert (with a wide margin) hold on a busy two-core machine. The
rules are also tested one by one on hand-made statistics. No absolute time is asserted.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data

import ferry
from doctor_workloads import SleepyDataset
from ferry.__main__ import main
from ferry.bench.measure import descendants
from ferry.doctor import advice as rules
from ferry.doctor import cli
from ferry.doctor.advice import Advice, Findings, advise, nothing_to_gain
from ferry.doctor.measure import Measurement, ThreadProbe, measure
from ferry.doctor.options import build_loader, loader_options, with_changes
from ferry.doctor.progress import Bound, Console
from ferry.doctor.tries import variants
from ferry.stats import LoaderStats, WorkerStats

pytestmark = pytest.mark.usefixtures("guard_global_state")


def new_children(before: set[int]) -> set[int]:
    """Processes started since ``before`` that are still alive (the suite's own long-lived
    helpers, such as a forkserver or resource tracker from earlier tests, are in ``before``)."""
    return set(descendants()) - before


WORKLOADS = Path(__file__).resolve().parent / "doctor_workloads.py"
SHORT = ["--batches", "20", "--seconds", "10", "--quiet"]


def doctor(
    function: str, *options: str, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    """Run ``ferry doctor`` in this process on a loader of doctor_workloads."""
    status = main(["doctor", f"{WORKLOADS}:{function}", *options])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def two_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rules see two CPUs, whatever the machine has (the sleeps scale to two anyway)."""
    monkeypatch.setattr(cli, "available_cpus", lambda: (2, True))


# --- end to end -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("two_cpus")
def test_a_slow_getitem_is_named_and_the_advice_is_faster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = set(descendants())
    report_path = tmp_path / "report.json"
    status, out, _ = doctor(
        "slow_loader", *SHORT, "--try", "--json", str(report_path), capsys=capsys
    )
    assert status == 0, out
    assert "Bottleneck: the loader." in out
    assert "The loader's work: fetch 100%" in out or "The loader's work: fetch 9" in out
    report = json.loads(report_path.read_text())
    assert report["bottleneck"] == report["run"]["stats"]["bottleneck"]
    assert max(report["stage_shares"], key=report["stage_shares"].get) == "fetch"
    advised = {a["option"]: a for a in report["advice"]}
    # A sleep is a read that waits: thread workers, which read a batch's samples at once, not
    # more processes that would each read one at a time.
    assert "num_workers" not in advised
    assert advised["worker_type"]["current"] == "'process' (num_workers=0)"
    assert "the reads wait, not compute" in advised["worker_type"]["reason"]
    assert "(with num_workers=2): making a batch took" in out
    # A sleep releases the GIL: the probe sees two threads make about twice the batches.
    assert report["thread_probe"]["two_threads"] > 1.4 * report["thread_probe"]["one_thread"]
    assert advised["worker_type"]["changes"] == {"num_workers": 2, "worker_type": "thread"}
    assert "SleepyDataset.__getitems__" in advised["__getitems__"]["suggested"]
    tries = {t["setting"]: t for t in report["tries"]}
    assert set(tries) == {"num_workers=2, worker_type='thread'"}
    assert all(t["error"] is None for t in tries.values())
    assert tries["num_workers=2, worker_type='thread'"]["speedup"] > 1.4
    assert "speed-up" in out
    assert "as given" in out
    assert not new_children(before), "a worker process outlived the doctor"


@pytest.mark.timeout(30)
def test_a_fast_loader_has_nothing_to_gain(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = doctor("fast_loader", *SHORT, "--try", capsys=capsys)
    assert status == 0
    assert "Advice: nothing to gain from the loader's options: a batch is made in" in out
    assert "num_workers=" not in out.split("Advice")[1]
    assert "Tried: nothing" in out


@pytest.mark.timeout(30)
def test_a_slow_training_step_is_the_bottleneck(capsys: pytest.CaptureFixture[str]) -> None:
    # A step 200 times the batch's 0.1 ms: the loop waits under 10% of the time even when a
    # loaded machine makes the batch ten times slower.
    status, out, _ = doctor("fast_loader", *SHORT, "--step-ms", "20", capsys=capsys)
    assert status == 0
    assert "Bottleneck: the training loop." in out
    assert "a 20 ms sleep standing for the training step" in out
    assert "the loader keeps up" in out


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("two_cpus")
@pytest.mark.slow
def test_a_torch_loader_is_measured_then_converted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report_path = tmp_path / "report.json"
    status, out, _ = doctor("slow_torch_loader", *SHORT, "--json", str(report_path), capsys=capsys)
    assert status == 0
    assert "torch.utils.data.DataLoader as given:" in out
    assert "equivalent ferry.DataLoader" in out
    assert "loader: ferry.DataLoader(SleepyDataset, batch_size=4, num_workers=0)" in out
    report = json.loads(report_path.read_text())
    assert report["kind"] == "torch"
    assert report["torch_run"]["stats"] is None
    assert report["torch_run"]["batches"] == 20
    assert report["run"]["stats"]["engine"] == "inline"
    assert report["options"]["collate_fn"] is None  # torch's default: ferry picks its own
    assert "worker_type" in {a["option"] for a in report["advice"]}  # its reads wait


@pytest.mark.timeout(30)
def test_json_is_plain_data_with_stats_advice_and_tries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report_path = tmp_path / "out" / "report.json"  # the directory is made
    status, _, _ = doctor("fast_loader", *SHORT, "--try", "--json", str(report_path), capsys=capsys)
    assert status == 0
    report = json.loads(report_path.read_text())
    assert report["spec"] == f"{WORKLOADS}:fast_loader"
    assert report["kind"] == "ferry"
    assert report["bound"] == {"batches": 20, "seconds": 10.0}
    assert report["advice"] == []
    assert report["tries"] == []
    assert report["nothing_to_gain"].startswith("a batch is made in")
    run = report["run"]
    assert run["batches"] == 20
    assert run["warmup"] == 1
    assert run["epoch_batches"] == 64
    assert run["stats"]["batches"] == 19  # the steady state: the warm-up batch left out
    assert set(run["stats"]["stages_s"]) == {
        "sampler",
        "fetch",
        "collate",
        "hand_off",
        "wait",
        "pin",
    }
    assert report["options"]["dataset"] == "TensorDataset"
    assert report["meta"]["command_line"].endswith("--json " + str(report_path))


@pytest.mark.timeout(30)
def test_autotuning_is_shown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = set(descendants())
    report_path = tmp_path / "report.json"
    status, out, _ = doctor(
        "auto_loader", "--batches", "12", "--quiet", "--json", str(report_path), capsys=capsys
    )
    assert status == 0
    tuning = json.loads(report_path.read_text())["tuning"]
    assert tuning
    assert tuning in " ".join(out.split())  # the text report wraps long lines
    assert not new_children(before)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "expected MODULE:FUNCTION"),
        (f"{WORKLOADS}:", "expected MODULE:FUNCTION"),
        ("no_such_module_for_doctor:make", "cannot import 'no_such_module_for_doctor': no module"),
        ("/no/such/file.py:make", "no such file: '/no/such/file.py'"),
        (f"{WORKLOADS}:missing", "has no function 'missing'"),
        (f"{WORKLOADS}:NOT_CALLABLE", "has a int, not a function 'NOT_CALLABLE'"),
        (f"{WORKLOADS}:not_a_loader", "returned list, not a DataLoader"),
        (f"{WORKLOADS}:broken_loader", "RuntimeError: the dataset's files are missing"),
    ],
)
def test_a_bad_spec_exits_2_saying_why(
    spec: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["doctor", spec]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""


def test_a_module_that_fails_to_import_shows_its_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    module = tmp_path / "doctor_broken_module.py"
    module.write_text("import no_such_dependency_of_doctor\n")
    assert main(["doctor", f"{module}:make"]) == 2
    err = capsys.readouterr().err
    assert f"cannot import '{module}'" in err
    assert "No module named 'no_such_dependency_of_doctor'" in err


def test_a_module_name_is_imported(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(WORKLOADS.parent))
    loader = cli.load_loader("doctor_workloads:fast_loader")
    assert isinstance(loader, ferry.DataLoader)


def test_plot_without_matplotlib_exits_2_before_measuring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    monkeypatch.setattr(cli, "load_loader", lambda spec: pytest.fail("loaded the loader"))
    assert main(["doctor", f"{WORKLOADS}:fast_loader", "--plot", str(tmp_path / "d.png")]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err
    assert "pip install matplotlib (ferry-data's extra 'bench' has it)" in err


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("two_cpus")
def test_plot_is_a_png_with_the_tries(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "doctor.png"
    status, _, _ = doctor(
        "slow_loader",
        "--batches",
        "8",
        "--seconds",
        "5",
        "--quiet",
        "--try",
        "--plot",
        str(plot),
        capsys=capsys,
    )
    assert status == 0
    assert plot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.timeout(60)
def test_end_to_end_in_a_subprocess(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    command = [sys.executable, "-m", "ferry", "doctor", f"{WORKLOADS}:fast_loader"]
    command += ["--batches", "30", "--json", str(report_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=50, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"ferry doctor: {WORKLOADS}:fast_loader\n")
    # stderr is not a terminal: a status line per measurement instead of a bar.
    assert "ferry doctor: measuring the loader (up to 30 batches or 30 s)" in done.stderr
    assert "\r" not in done.stderr
    assert json.loads(report_path.read_text())["advice"] == []


# --- measuring ---------------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.timeout(30)
def test_measure_leaves_the_warm_up_out_and_draws_a_bar() -> None:
    screen = _Terminal()
    loader = ferry.DataLoader(SleepyDataset(), batch_size=1, num_workers=2, worker_type="thread")
    run = measure(loader, "measuring", Bound(10, 0.0), Console(quiet=False, stream=screen))
    assert (run.batches, run.warmup, run.steady_batches, run.ended) == (10, 2, 8, False)
    assert run.stats is not None
    assert run.stats.batches == 8
    # Batches the workers made in the window: those delivered in it, give or take those in
    # flight at its two ends (made before the warm-up's end, or not yet delivered at the end).
    in_flight = loader.num_workers * loader.prefetch_factor
    assert abs(sum(w.batches for w in run.stats.workers) - 8) <= in_flight
    assert all(0 < w.busy_fraction <= 1 for w in run.stats.workers)
    assert run.epoch_batches == 400
    assert run.first_batch_s > 0
    assert run.batches_per_s > 0
    assert "\rmeasuring: [" in screen.getvalue()
    assert screen.getvalue().endswith("\r\033[K")  # the bar is cleared at the end


@pytest.mark.timeout(30)
def test_a_short_epoch_is_measured_whole() -> None:
    loader = ferry.DataLoader(list(range(6)), batch_size=2)
    run = measure(loader, "measuring", Bound(100, 0.0), Console(quiet=True))
    assert (run.batches, run.warmup, run.ended, run.epoch_batches) == (3, 0, True, 3)
    assert run.stats is not None
    assert run.stats.batches == 3


def test_quiet_console_writes_nothing() -> None:
    screen = _Terminal()
    console = Console(quiet=True, stream=screen)
    console.start("measuring", Bound(5, 1.0))
    console.update(3, 0.5)
    console.finish()
    console.say("hello")
    assert screen.getvalue() == ""


# --- options -----------------------------------------------------------------------------------


def _batches(loader: Any) -> list[Any]:
    return [batch.tolist() for batch in loader]


@pytest.mark.parametrize(
    "make",
    [
        lambda data, seed: torch.utils.data.DataLoader(
            data, batch_size=3, shuffle=True, drop_last=True, generator=seed
        ),
        lambda data, seed: torch.utils.data.DataLoader(
            data,
            batch_sampler=torch.utils.data.BatchSampler(
                torch.utils.data.RandomSampler(data, generator=seed), 4, drop_last=False
            ),
        ),
        lambda data, seed: torch.utils.data.DataLoader(data, batch_size=None, generator=seed),
    ],
    ids=["shuffled", "batch_sampler", "unbatched"],
)
def test_a_torch_loader_converts_to_the_same_batches(make: Any) -> None:
    data = torch.arange(20)
    expected = _batches(make(data, torch.Generator().manual_seed(7)))
    converted = build_loader(loader_options(make(data, torch.Generator().manual_seed(7))))
    assert isinstance(converted, ferry.DataLoader)
    assert _batches(converted) == expected


def test_options_keep_ferry_options_and_drop_worker_options_without_workers() -> None:
    loader = ferry.DataLoader(
        SleepyDataset(),
        batch_size=4,
        num_workers=2,
        worker_type="thread",
        prefetch_factor=3,
        persistent_workers=True,
        timeout=5,
    )
    options = loader_options(loader)
    assert options["worker_type"] == "thread"
    assert options["prefetch_factor"] == 3
    assert options["collate_fn"] is ferry.default_collate
    both = {"balance_workers": True, "move_workers": True}
    inline = with_changes({**options, **both}, {"num_workers": 0})
    assert (inline["prefetch_factor"], inline["persistent_workers"], inline["timeout"]) == (
        None,
        False,
        0,
    )
    assert (inline["balance_workers"], inline["move_workers"]) == (False, None)
    assert build_loader(inline).num_workers == 0
    # Process workers moved round the CPUs, advised to become threads: nothing left to move.
    threads = with_changes({**options, "move_workers": True}, {"worker_type": "thread"})
    assert threads["move_workers"] is None
    assert build_loader(threads).worker_type == "thread"


# --- the rules ---------------------------------------------------------------------------------


def _stats(**fields: Any) -> LoaderStats:
    """An inline epoch of 100 batches in 1 s, 9.5 ms of fetch and collate a batch."""
    values: dict[str, Any] = {
        "engine": "inline",
        "num_workers": 0,
        "batches": 100,
        "wall_s": 1.0,
        "sampler_s": 0.001,
        "fetch_s": 0.9,
        "collate_s": 0.05,
        "hand_off_s": 0.0,
        "wait_s": 0.96,
        "pin_s": 0.0,
        "ready": 0,
        "waited": 100,
        "hand_off_bytes": 0,
        "workers": (),
    }
    values.update(fields)
    return LoaderStats(**values)


def _workers(count: int, busy: float) -> tuple[WorkerStats, ...]:
    return tuple(WorkerStats(i, 100 // count, busy, busy) for i in range(count))


def _findings(stats: LoaderStats | None = None, **fields: Any) -> Findings:
    stats = stats or _stats()
    run_fields: dict[str, Any] = {
        "label": "run",
        "batches": stats.batches + 1,
        "warmup": 1,
        "first_batch_s": 0.01,
        "steady_s": stats.wall_s,
        "ended": False,
        "epoch_batches": 1000,
        "batch_bytes": 1024,
        "wait_median_s": 0.009,
        "wait_max_s": 0.02,
        "stats": stats,
    }
    run_fields.update(fields.pop("run", {}))
    options = {
        "dataset": SleepyDataset(),
        "batch_size": 4,
        "num_workers": stats.num_workers,
        "worker_type": "process" if stats.engine == "inline" else stats.engine,
        "prefetch_factor": 2 if stats.num_workers else None,
        "persistent_workers": False,
        "pin_memory": False,
    }
    options.update(fields.pop("options", {}))
    values: dict[str, Any] = {"cpus": 4, "accelerator": None, **fields}
    return Findings(run=Measurement(**run_fields), options=options, **values)


def _advised(f: Findings) -> dict[str, Advice]:
    return {a.option: a for a in advise(f)}


def test_more_workers_for_a_busy_main_process() -> None:
    advice = rules.more_workers(_findings())
    assert advice is not None
    assert (advice.current, advice.suggested, advice.changes) == ("0", "4", {"num_workers": 4})
    assert str(advice).startswith("num_workers=0 → 4: fetch and collate take 95% of the wall")
    assert "4 CPUs are available" in advice.reason


def test_more_workers_for_a_stream_says_it_must_split_itself() -> None:
    class Stream(ferry.IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(10))

    advice = rules.more_workers(_findings(options={"dataset": Stream()}))
    assert advice is not None
    assert "a stream must split itself between the workers (get_worker_info())" in advice.reason


def test_more_workers_with_a_step_asks_for_as_many_as_keep_up() -> None:
    advice = rules.more_workers(_findings(step_s=0.005))
    assert advice is not None
    assert advice.suggested == "2"  # 9.5 ms of work a batch, a batch every 5 ms
    assert "2 workers keep up" in advice.reason


@pytest.mark.parametrize(
    "findings",
    [
        _findings(_stats(fetch_s=0.05, collate_s=0.0)),  # 0.5 ms a batch: fast enough
        _findings(_stats(wait_s=0.05)),  # the loop hardly waits
        _findings(_stats(engine="process", num_workers=4, workers=_workers(4, 1.0)), cpus=4),
        _findings(_stats(engine="process", num_workers=2, workers=_workers(2, 0.5))),
    ],
    ids=["fast", "loop-bound", "all-cpus", "idle-workers"],
)
def test_no_more_workers(findings: Findings) -> None:
    assert rules.more_workers(findings) is None


def test_threads_when_two_threads_are_twice_as_fast() -> None:
    advice = rules.thread_workers(_findings(threads=ThreadProbe(10.0, 19.0)))
    assert advice is not None
    assert advice.changes == {"num_workers": 4, "worker_type": "thread"}
    assert "1.90x" in advice.reason
    assert "releases the GIL" in advice.reason
    assert rules.thread_workers(_findings(threads=ThreadProbe(10.0, 10.5))) is None


def test_threads_instead_of_processes_only_when_processes_cost_something() -> None:
    stats = _stats(engine="process", num_workers=2, workers=_workers(2, 1.0), hand_off_s=0.2)
    gil_free = ThreadProbe(10.0, 19.0)
    advice = rules.thread_workers(_findings(stats, threads=gil_free))
    assert advice is not None
    assert advice.changes == {"worker_type": "thread"}
    assert "and with processes moving batches out is 17% of the loader's work" in advice.reason
    cheap = _stats(engine="process", num_workers=2, workers=_workers(2, 1.0), hand_off_s=0.01)
    assert rules.thread_workers(_findings(cheap, threads=gil_free)) is None
    slow_start = {"first_batch_s": 1.0, "epoch_batches": 100}
    advice = rules.thread_workers(_findings(cheap, threads=gil_free, run=slow_start))
    assert advice is not None
    assert "starting them 50% of an epoch" in advice.reason


def test_threads_when_moving_batches_costs_more_than_making_them() -> None:
    stats = _stats(
        engine="process",
        num_workers=2,
        workers=_workers(2, 0.9),
        fetch_s=0.2,
        collate_s=0.0,
        hand_off_s=0.5,
        hand_off_bytes=100 * 2**20,
    )
    advice = rules.thread_workers(_findings(stats, threads=ThreadProbe(10.0, 19.0)))
    assert advice is not None
    assert advice.changes == {"worker_type": "thread"}
    assert "(5 ms, 1.0 MiB) costs more than making it (2 ms)" in advice.reason
    assert rules.worth_probing_threads(_findings(stats))  # (also when batches are quick)


@pytest.mark.parametrize("probe", [None, ThreadProbe(10.0, 10.5), ThreadProbe(10.0, 13.0)])
def test_no_threads_for_work_that_holds_the_gil_or_was_not_tried(
    probe: ThreadProbe | None,
) -> None:
    """CPU-bound Python work holds the GIL (15 thread workers decoding JPEGs: 0.25x torch's
    15 processes, on a 16-CPU host); threads are advised only where two were seen to run in
    parallel."""
    stats = _stats(
        engine="process",
        num_workers=2,
        workers=_workers(2, 0.9),
        fetch_s=0.2,
        collate_s=0.0,
        hand_off_s=0.5,
        hand_off_bytes=100 * 2**20,
    )
    assert rules.thread_workers(_findings(stats, threads=probe)) is None
    assert rules.thread_workers(_findings(threads=probe)) is None


def test_processes_when_threads_take_turns_on_the_gil() -> None:
    stats = _stats(engine="thread", num_workers=2, workers=_workers(2, 1.0))
    advice = rules.process_workers(_findings(stats, threads=ThreadProbe(10.0, 10.2)))
    assert advice is not None
    assert str(advice).startswith("worker_type='thread' → 'process': two worker threads made only")
    assert rules.process_workers(_findings(stats, threads=ThreadProbe(10.0, 19.0))) is None


def test_deeper_prefetch_when_idle_workers_still_keep_the_loop_waiting() -> None:
    stats = _stats(engine="process", num_workers=2, workers=_workers(2, 0.5), ready=60, waited=40)
    advice = rules.deeper_prefetch(_findings(stats))
    assert advice is not None
    assert (advice.current, advice.suggested) == ("2", "4")
    assert "idle 50% of the time, yet the loop waited for 40 of 100 batches" in advice.reason
    busy = _stats(engine="process", num_workers=2, workers=_workers(2, 0.95), waited=40)
    assert rules.deeper_prefetch(_findings(busy)) is None


def _uneven(*busy_per_batch: float, batches: int = 25) -> tuple[WorkerStats, ...]:
    return tuple(
        WorkerStats(i, batches, busy * batches, 0.9) for i, busy in enumerate(busy_per_batch)
    )


def test_balanced_workers_when_the_workers_run_at_different_speeds() -> None:
    """Taking turns, the worker on the slow CPU holds the epoch back: balance them."""
    workers = _uneven(0.010, 0.015, 0.011, 0.010)
    stats = _stats(engine="process", num_workers=4, workers=workers)
    advice = rules.balanced_workers(_findings(stats))
    assert advice is not None
    assert (advice.option, advice.current, advice.suggested) == ("balance_workers", "False", "True")
    assert advice.changes == {"balance_workers": True}
    assert "worker 1 took 15 ms a batch and worker 0 10 ms (1.50x)" in advice.reason
    assert "which worker makes a batch" in advice.reason
    assert "balance_workers" in _advised(_findings(stats))


def test_no_balanced_workers_advice_without_the_gap_or_the_need() -> None:
    even = _stats(engine="process", num_workers=2, workers=_uneven(0.010, 0.0115))
    assert rules.balanced_workers(_findings(even)) is None  # (1.15x: within the noise)
    uneven = _stats(engine="process", num_workers=2, workers=_uneven(0.010, 0.020))
    assert rules.balanced_workers(_findings(uneven)) is not None
    done = _findings(uneven, options={"balance_workers": True})
    assert rules.balanced_workers(done) is None  # (already balanced)

    class Stream(ferry.IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(10))

    stream = _findings(uneven, options={"dataset": Stream()})
    assert rules.balanced_workers(stream) is None  # (a stream's order depends on the worker)
    keeping_up = _stats(engine="process", num_workers=2, workers=_uneven(0.01, 0.02), wait_s=0.0)
    assert rules.balanced_workers(_findings(keeping_up)) is None  # (not the bottleneck)
    few = _stats(engine="process", num_workers=2, workers=_uneven(0.01, 0.02, batches=3))
    assert rules.balanced_workers(_findings(few)) is None  # (too few batches to tell)


def test_getitems_for_a_dataset_fetched_sample_by_sample() -> None:
    advice = rules.batch_getitems(_findings())
    assert advice is not None
    assert advice.changes == {}
    assert str(advice).startswith("__getitems__: implement SleepyDataset.__getitems__(indices)")
    assert "4 __getitem__ calls a batch, 2.25 ms each" in advice.reason
    subset = ferry.Subset(SleepyDataset(), range(10))
    advice = rules.batch_getitems(_findings(options={"dataset": subset}))
    assert advice is not None
    assert "SleepyDataset has no __getitems__" in advice.reason


def test_no_getitems_advice_when_the_dataset_has_it_or_batching_is_off() -> None:
    rows = ferry.TensorDataset(torch.zeros(10))
    assert rules.batch_getitems(_findings(options={"dataset": rows})) is None
    assert rules.batch_getitems(_findings(options={"batch_size": None})) is None


def test_persistent_workers_when_start_up_is_a_large_share_of_an_epoch() -> None:
    stats = _stats(engine="process", num_workers=2, workers=_workers(2, 1.0))
    slow_start = {"first_batch_s": 1.0, "epoch_batches": 100}
    advice = rules.keep_workers(_findings(stats, run=slow_start))
    assert advice is not None
    assert advice.changes == {"persistent_workers": True}
    assert "of a 100-batch epoch" in advice.reason
    long_epoch = {"first_batch_s": 1.0, "epoch_batches": 10_000}
    assert rules.keep_workers(_findings(stats, run=long_epoch)) is None
    kept = _findings(stats, run=slow_start, options={"persistent_workers": True})
    assert rules.keep_workers(kept) is None


def test_pin_memory_for_large_batches_with_an_accelerator() -> None:
    large = {"batch_bytes": 4 * 2**20}
    advice = rules.pin_batches(_findings(run=large, accelerator="cuda"))
    assert advice is not None
    assert "4.0 MiB of tensors and a cuda device" in advice.reason
    assert rules.pin_batches(_findings(run=large)) is None
    assert rules.pin_batches(_findings(accelerator="cuda")) is None


def test_nothing_to_gain_says_why() -> None:
    assert "the loader keeps up" in nothing_to_gain(_findings(_stats(wait_s=0.01)))
    fast = _findings(_stats(fetch_s=0.01, collate_s=0.0))
    assert "a batch is made in 0.1 ms" in nothing_to_gain(fast)
    assert advise(fast) == []


def test_variants_try_each_change_then_all_together_once() -> None:
    advice = [
        Advice("num_workers", "0", "2", "", {"num_workers": 2}),
        Advice(
            "worker_type", "'process'", "'thread'", "", {"num_workers": 2, "worker_type": "thread"}
        ),
        Advice("__getitems__", "", "implement", ""),
        Advice("pin_memory", "False", "True", "", {"pin_memory": True}),
    ]
    assert [label for label, _ in variants(advice)] == [
        "num_workers=2",
        "num_workers=2, worker_type='thread'",
        "pin_memory=True",
        "num_workers=2, worker_type='thread', pin_memory=True",
    ]


# --- reads that wait ------------------------------------------------------------------------------


def test_reads_that_wait_call_for_thread_workers_not_more_processes() -> None:
    stats = _stats(
        engine="process", num_workers=2, workers=_workers(2, 1.0), cpu_s=0.02, cpu_made_s=0.95
    )
    findings = _findings(stats)
    advice = rules.waiting_reads(findings)
    assert advice is not None
    assert (advice.current, advice.suggested) == ("'process'", "'thread'")
    assert advice.changes == {"worker_type": "thread", "num_workers": 2}
    assert "making a batch took 48x the CPU time it used" in advice.reason
    assert rules.more_workers(findings) is None  # more processes would still read one by one
    assert rules.thread_workers(findings) is None  # (said once)
    assert next(iter(_advised(findings))) == "worker_type"


@pytest.mark.parametrize(
    "findings",
    [
        _findings(_stats(cpu_s=0.9, cpu_made_s=0.95)),  # the batches computed: about 1x
        _findings(_stats(cpu_s=0.0)),  # not measured
        _findings(_stats(cpu_s=0.02, cpu_made_s=0.95, wait_s=0.05)),  # the loader keeps up
        _findings(_stats(engine="thread", num_workers=2, cpu_s=0.02, cpu_made_s=0.95)),
    ],
    ids=["computes", "unmeasured", "loop-bound", "threads"],
)
def test_no_thread_advice_for_reads_that_do_not_wait(findings: Findings) -> None:
    assert rules.waiting_reads(findings) is None


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_the_stats_measure_how_much_of_a_batch_waited() -> None:
    def made_per_cpu(dataset: Any) -> float:
        loader = ferry.DataLoader(dataset, batch_size=4, num_workers=2)
        for _ in loader:
            pass
        return loader.stats().made_per_cpu

    from workers.test_auto_threads import Busy  # spins: its batches compute

    assert made_per_cpu(SleepyDataset()) >= rules.READS_WAIT
    assert 0 < made_per_cpu(Busy(n=32, work=0.002)) < rules.READS_WAIT


# --- copy-on-write growth -------------------------------------------------------------------------


def _growing(growth_mib: int) -> tuple[WorkerStats, ...]:
    return tuple(
        WorkerStats(i, 50, 0.5, 0.5, memory_bytes=400 << 20, memory_growth_bytes=growth_mib << 20)
        for i in range(2)
    )


def test_workers_that_copy_the_dataset_are_told_to_share_it() -> None:
    stats = _stats(engine="process", num_workers=2, workers=_growing(300), wait_s=0.01)
    findings = _findings(stats, threads=ThreadProbe(10.0, 19.0))
    assert rules.worth_probing_threads(_findings(stats))
    advice = rules.copy_on_write(findings)
    assert advice is not None  # (whether or not the loader is the bottleneck)
    assert (advice.option, advice.current, advice.suggested) == (
        "worker_type",
        "'process'",
        "'thread'",
    )
    assert advice.changes == {"worker_type": "thread"}
    assert "grew by 600 MiB in one epoch" in advice.reason
    assert "copy-on-write" in advice.reason
    assert "ferry.SharedList" in advice.reason
    assert rules.thread_workers(findings) is None  # (said once)


def test_copy_on_write_with_a_gil_bound_getitem_calls_for_a_shared_list() -> None:
    stats = _stats(engine="process", num_workers=2, workers=_growing(300))
    probe = ThreadProbe(one_thread=10.0, two_threads=10.5)
    advice = rules.copy_on_write(_findings(stats, threads=probe))
    assert advice is not None
    assert (advice.option, advice.current, advice.changes) == ("dataset", "", {})
    assert "ferry.SharedList" in advice.suggested
    assert "holds the GIL" in advice.reason
    untried = rules.copy_on_write(_findings(stats))  # (threads only where seen in parallel)
    assert untried is not None
    assert "ferry.SharedList" in untried.suggested
    assert "could not try them" in untried.reason


@pytest.mark.parametrize(
    "stats",
    [
        _stats(engine="process", num_workers=2, workers=_growing(10)),  # a working set
        _stats(engine="process", num_workers=2, workers=_workers(2, 0.5)),  # not measured
        _stats(engine="thread", num_workers=2, workers=_workers(2, 0.5)),
    ],
    ids=["small", "unmeasured", "threads"],
)
def test_no_copy_on_write_advice_without_the_growth(stats: LoaderStats) -> None:
    assert rules.copy_on_write(_findings(stats)) is None
