"""``num_workers="auto"`` / ``prefetch_factor="auto"`` (autotuning).

The policy is tested on synthetic :class:`LoaderStats` (no processes, no clocks): each rule,
its caps, the trials and settling, and streams keeping their worker count. The loader tests
check what must hold whatever the machine's timing: the batches and their order never change,
``stats().tuning`` says what was chosen, and a changed count replaces persistent workers
without leaving the old ones behind. Where a test needs the count to change, a scripted tuner
changes it; no assertion depends on how fast anything runs.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import ferry
from _support import datasets as ds
from _support.compare import assert_same
from _support.processes import FAST, Kind, exited, poll, worker_pids
from ferry._engine.tuning import autotune
from ferry._engine.tuning.autotune import Tuner
from ferry.errors import MalformedState, StateMismatch
from ferry.stats import LoaderStats, WorkerStats

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

GiB = 2**30


# -- the policy, on synthetic statistics ---------------------------------------------------------


def tuner(
    num_workers: int | None = None,
    prefetch_factor: int | None = None,
    *,
    auto_prefetch: bool = True,
    iterable: bool = False,
    worker_type: str = "process",
    cpus: int | None = 8,
    memory: int | None = 16 * GiB,
) -> Tuner:
    """A tuner as the loader makes one, on a machine of ``cpus`` CPUs and ``memory`` bytes."""
    return Tuner(
        num_workers,
        prefetch_factor,
        auto_prefetch=auto_prefetch,
        iterable=iterable,
        worker_type=worker_type,
        cpus=cpus,
        memory=memory,
    )


def epoch(
    *,
    workers: int = 2,
    batches: int = 100,
    waited: int = 0,
    busy: float = 0.3,
    wall: float = 1.0,
    wait: float = 0.0,
    batch_bytes: int = 0,
) -> LoaderStats:
    """An epoch's statistics: every worker ``busy`` of ``wall`` seconds, the loop waiting
    ``wait`` seconds in all, for ``waited`` of the ``batches``."""
    return LoaderStats(
        engine="process",
        num_workers=workers,
        batches=batches,
        wall_s=wall,
        sampler_s=0.0,
        fetch_s=busy * wall * workers,
        collate_s=0.0,
        hand_off_s=0.0,
        wait_s=wait,
        pin_s=0.0,
        ready=batches - waited,
        waited=waited,
        hand_off_bytes=batch_bytes * batches,
        workers=tuple(
            WorkerStats(i, batches // workers, busy * wall, busy) for i in range(workers)
        ),
    )


def behind_and_busy(workers: int, *, worker_ms: float, loop_ms: float) -> LoaderStats:
    """The loop waited for most of 100 batches while the workers were 90 % busy: each batch
    took ``worker_ms`` of worker time and the loop's own step ``loop_ms``."""
    batches, busy = 100, 0.9
    wall = worker_ms * batches / 1000 / workers / busy
    return epoch(
        workers=workers,
        batches=batches,
        waited=80,
        busy=busy,
        wall=wall,
        wait=wall - loop_ms * batches / 1000,
    )


# uneven batches: the loop waited (40% of its time) although workers idle
BEHIND_IDLE: dict[str, Any] = {"waited": 70, "busy": 0.3, "wait": 0.4}
AHEAD_IDLE: dict[str, Any] = {"waited": 1, "busy": 0.2}  # loop never waits, workers mostly idle
# neither rule applies: 30 short waits, 5% of the wall time
BALANCED: dict[str, Any] = {"waited": 30, "busy": 0.6, "wait": 0.05}


@pytest.mark.parametrize(
    ("worker_type", "cpus", "expected"),
    [
        ("process", 2, 2),
        ("process", 6, 6),
        ("process", 64, autotune.PROCESS_START_CAP),
        ("process", 1, 1),
        ("process", None, autotune.UNKNOWN_CPUS),
        ("thread", 2, 2),
        ("thread", 64, autotune.THREAD_START_CAP),
    ],
)
def test_first_from_the_cpu_count(worker_type: str, cpus: int | None, expected: int) -> None:
    chosen = tuner(worker_type=worker_type, cpus=cpus)
    assert chosen.first() == (expected, autotune.DEFAULT_PREFETCH)
    assert chosen.reason.startswith(f"num_workers={expected}, prefetch_factor=2: ")
    assert f"{worker_type} workers start at one per CPU" in chosen.reason


def test_first_keeps_the_option_that_is_not_auto() -> None:
    assert tuner(num_workers=3).first() == (3, 2)
    assert tuner(prefetch_factor=5, auto_prefetch=False, cpus=4).first() == (4, 5)
    # prefetch_factor left None with num_workers="auto": torch's default, and not tuned.
    fixed = tuner(auto_prefetch=False, cpus=4)
    assert fixed.first() == (4, 2)
    assert "prefetch_factor starts" not in fixed.reason


@pytest.mark.parametrize(
    ("affinity", "machine", "ranks", "expected"),
    [
        (16, 16, None, 16),  # one process on the node
        (16, 16, "4", 4),  # torchrun's 4 local ranks share the node
        (16, 16, "3", 5),
        (2, 2, "8", 1),  # more ranks than CPUs: still one each
        (4, 16, "4", 4),  # bound to a subset: that is this rank's share already
        (16, 16, "many", 16),  # not a number: ignored
    ],
)
def test_cpus_are_shared_between_local_ranks(
    monkeypatch: pytest.MonkeyPatch, affinity: int, machine: int, ranks: str | None, expected: int
) -> None:
    monkeypatch.setattr(autotune, "available_cpus", lambda: (affinity, True))
    monkeypatch.setattr(os, "cpu_count", lambda: machine)
    if ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    assert autotune.cpus_for_this_process() == expected


def test_unknown_cpu_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(autotune, "available_cpus", lambda: (None, False))
    assert autotune.cpus_for_this_process() is None


def test_available_memory_is_known_here() -> None:
    memory = autotune.available_memory()
    assert memory is not None
    assert memory > 0


def test_more_workers_when_busy_workers_are_behind() -> None:
    chosen = tuner(cpus=8)
    # 20 ms of worker time per batch against a 6 ms step: 4 workers keep up.
    assert chosen.after_epoch(behind_and_busy(2, worker_ms=20, loop_ms=6), (2, 2)) == (4, 2)
    assert chosen.reason.startswith("num_workers=4, prefetch_factor=2 (on trial after epoch 1): ")
    assert "20.00 ms of worker time and the loop 6.00 ms, so 4 workers would keep up" in (
        chosen.reason
    )


def test_more_workers_at_least_one_at_most_twice_and_within_the_cpus() -> None:
    at_least_one = behind_and_busy(4, worker_ms=8, loop_ms=2)  # 4 would do, yet the loop waits
    assert tuner(cpus=8).after_epoch(at_least_one, (4, 2)) == (5, 2)
    loop_does_nothing = behind_and_busy(2, worker_ms=20, loop_ms=0)
    assert tuner(cpus=16).after_epoch(loop_does_nothing, (2, 2)) == (4, 2)
    assert tuner(cpus=3).after_epoch(loop_does_nothing, (2, 2)) == (3, 2)


def test_thread_workers_whose_reads_wait_go_past_the_cpu_count() -> None:
    """Threads that wait on their reads do not compete for the CPUs, so rule 1 may try more of
    them than CPUs (up to WAITING_THREAD_CAP); a trial keeps only a faster one."""
    from dataclasses import replace

    waiting = replace(
        behind_and_busy(2, worker_ms=20, loop_ms=0), engine="thread", read_wait_ratio=300.0
    )
    chosen = tuner(worker_type="thread", cpus=2)
    assert chosen.after_epoch(waiting, (2, 2)) == (4, 2)
    assert "thread workers whose reads wait are not bound by the CPUs" in chosen.reason
    at_cap = replace(
        behind_and_busy(autotune.WAITING_THREAD_CAP, worker_ms=20, loop_ms=0),
        engine="thread",
        read_wait_ratio=300.0,
    )
    capped = tuner(worker_type="thread", cpus=2)
    assert capped.after_epoch(at_cap, (autotune.WAITING_THREAD_CAP, 2)) == (
        autotune.WAITING_THREAD_CAP,
        2,
    )
    computing = replace(behind_and_busy(2, worker_ms=20, loop_ms=0), engine="thread")
    assert tuner(worker_type="thread", cpus=2).after_epoch(computing, (2, 2)) == (2, 2)


def test_busy_workers_at_one_per_cpu_settle() -> None:
    chosen = tuner(cpus=4)
    stats = behind_and_busy(4, worker_ms=20, loop_ms=1)
    assert chosen.after_epoch(stats, (4, 2)) == (4, 2)
    assert chosen.reason.startswith("num_workers=4, prefetch_factor=2 (settled after epoch 1): ")
    assert "the workers are the limit, at one per CPU (4 CPUs for this process)" in chosen.reason


def test_fixed_num_workers_is_never_changed() -> None:
    chosen = tuner(num_workers=2)
    assert chosen.after_epoch(behind_and_busy(2, worker_ms=20, loop_ms=1), (2, 2)) == (2, 2)
    assert "num_workers is fixed" in chosen.reason


def test_a_faster_trial_is_kept_if_batches_per_s_rose() -> None:
    chosen = tuner(cpus=8)
    assert chosen.after_epoch(behind_and_busy(2, worker_ms=12, loop_ms=4), (2, 2)) == (3, 2)
    # 100 batches in 0.6 s instead of 0.67 s: 11 % faster, and the loader keeps up now.
    assert chosen.after_epoch(epoch(workers=3, wall=0.6, **BALANCED), (3, 2)) == (3, 2)
    assert "the last change raised batches/s from 150.0 to 166.7" in chosen.reason
    assert "(settled after epoch " in chosen.reason


def test_workers_handing_in_batches_together_are_behind() -> None:
    """Two busy workers finish together: half the batches are ready when asked, yet the loop
    waits 60% of the time. Judged by that time, the loader is behind: more workers."""
    chosen = tuner(cpus=8)
    together = epoch(workers=2, waited=50, busy=0.9, wall=1.0, wait=0.6)
    assert chosen.after_epoch(together, (2, 2)) == (4, 2)  # twice as many, at most
    assert "the loop waited for 50 of 100 batches, 60% of its time, and" in chosen.reason


def test_a_faster_trial_is_undone_if_batches_per_s_did_not_rise() -> None:
    chosen = tuner(cpus=8)
    assert chosen.after_epoch(behind_and_busy(2, worker_ms=12, loop_ms=4), (2, 2)) == (3, 2)
    not_faster = epoch(workers=3, waited=80, busy=0.9, wall=0.66)  # 1 % only
    assert chosen.after_epoch(not_faster, (3, 2)) == (2, 2)
    assert chosen.reason.startswith("num_workers=2, prefetch_factor=2 (settled after epoch 2): ")
    assert "num_workers=3, prefetch_factor=2 was undone: 151.5 batches/s against 150.0" in (
        chosen.reason
    )
    # Settled: nothing changes any more, whatever later epochs look like.
    assert chosen.after_epoch(behind_and_busy(2, worker_ms=12, loop_ms=4), (2, 2)) == (2, 2)


def test_deeper_queue_when_idle_workers_are_behind() -> None:
    chosen = tuner(cpus=2)
    assert chosen.after_epoch(epoch(**BEHIND_IDLE), (2, 2)) == (2, 4)
    assert "batch times are uneven, so each worker loads more batches ahead" in chosen.reason
    assert chosen.after_epoch(epoch(wall=0.8, **BEHIND_IDLE), (2, 4)) == (2, 8)
    assert chosen.after_epoch(epoch(wall=0.6, **BEHIND_IDLE), (2, 8)) == (2, 8)
    assert f"prefetch_factor is at its cap, {autotune.PREFETCH_CAP}" in chosen.reason


def test_deeper_queue_only_when_prefetch_factor_is_auto() -> None:
    chosen = tuner(auto_prefetch=False)
    assert chosen.after_epoch(epoch(**BEHIND_IDLE), (2, 2)) == (2, 2)
    assert "batch times are uneven, but prefetch_factor is fixed" in chosen.reason


def test_deeper_queue_within_the_memory_budget() -> None:
    # 2 workers x 4 batches x 16 MiB = 128 MiB: over a tenth of 1 GiB.
    chosen = tuner(memory=GiB)
    assert chosen.after_epoch(epoch(batch_bytes=16 * 2**20, **BEHIND_IDLE), (2, 2)) == (2, 2)
    assert "prefetch_factor=4 would hold 128 MiB of batches, over 10% of the 1.0 GiB" in (
        chosen.reason
    )
    roomy = tuner(memory=2 * GiB)
    assert roomy.after_epoch(epoch(batch_bytes=16 * 2**20, **BEHIND_IDLE), (2, 2)) == (2, 4)


def test_one_worker_fewer_when_idle_workers_are_ahead() -> None:
    chosen = tuner(cpus=8)
    assert chosen.after_epoch(epoch(workers=4, **AHEAD_IDLE), (4, 2)) == (3, 2)
    assert "one worker fewer would be 27% busy and frees a CPU" in chosen.reason
    # Still ahead with 3: kept, and one fewer again.
    assert chosen.after_epoch(epoch(workers=3, waited=2, busy=0.27), (3, 2)) == (2, 2)
    assert "the last change kept the loader ahead" in chosen.reason


def test_a_leaner_trial_is_undone_if_the_loop_then_waits() -> None:
    chosen = tuner(cpus=8)
    assert chosen.after_epoch(epoch(workers=2, **AHEAD_IDLE), (2, 2)) == (1, 2)
    assert chosen.after_epoch(epoch(workers=1, waited=15, busy=0.45), (1, 2)) == (2, 2)
    assert chosen.reason == (
        "num_workers=2, prefetch_factor=2 (settled after epoch 2): num_workers=1, "
        "prefetch_factor=2 was undone: the loop waited for 15 of 100 batches, over 10%"
    )


@pytest.mark.parametrize(
    ("workers", "busy"),
    [(1, 0.1), (2, 0.4), (8, 0.65)],  # one worker left; the rest would be busy >= 70 %; not idle
)
def test_workers_are_kept_when_one_fewer_would_not_do(workers: int, busy: float) -> None:
    chosen = tuner(cpus=8)
    assert chosen.after_epoch(epoch(workers=workers, waited=0, busy=busy), (workers, 2)) == (
        workers,
        2,
    )
    assert "(settled after epoch " in chosen.reason
    assert "the loader keeps up" in chosen.reason


def test_a_balanced_epoch_settles() -> None:
    chosen = tuner()
    assert chosen.after_epoch(epoch(**BALANCED), (2, 2)) == (2, 2)
    assert chosen.reason == (
        "num_workers=2, prefetch_factor=2 (settled after epoch 1): the loop waited for 30 of 100 "
        "batches, 5% of its time, and the workers were 60% busy: the loader keeps up"
    )
    assert chosen.after_epoch(epoch(**AHEAD_IDLE), (2, 2)) == (2, 2)


def test_short_epochs_are_not_judged() -> None:
    chosen = tuner()
    short = epoch(batches=autotune.MIN_BATCHES - 1, waited=0, busy=0.1)
    assert chosen.after_epoch(short, (2, 2)) == (2, 2)
    assert "too few to judge" in chosen.reason
    # Not settled by it: a long epoch is judged.
    assert chosen.after_epoch(epoch(**AHEAD_IDLE), (2, 2)) == (1, 2)


def test_a_setting_once_left_is_not_tried_again() -> None:
    chosen = tuner(cpus=8)
    assert chosen.after_epoch(behind_and_busy(2, worker_ms=12, loop_ms=4), (2, 2)) == (3, 2)
    # Faster with 3, and now ahead with idle workers: 2 was left already, so 3 stays.
    assert chosen.after_epoch(epoch(workers=3, wall=0.5, **AHEAD_IDLE), (3, 2)) == (3, 2)
    assert "num_workers=2, prefetch_factor=2 was left before and is not tried again" in (
        chosen.reason
    )


@pytest.mark.parametrize(
    "stats",
    [
        behind_and_busy(2, worker_ms=20, loop_ms=1),
        epoch(**AHEAD_IDLE),
        epoch(**BEHIND_IDLE),
        epoch(**BALANCED),
    ],
    ids=["behind-busy", "ahead-idle", "behind-idle", "balanced"],
)
def test_a_stream_keeps_its_worker_count(stats: LoaderStats) -> None:
    """A stream's shards follow its worker count: another count would make other batches."""
    chosen = tuner(iterable=True, cpus=8)
    assert chosen.first() == (8, 2)
    assert "a stream keeps its worker count" in chosen.reason
    workers, _ = chosen.after_epoch(stats, (2, 2))
    assert workers == 2


def test_a_stream_tunes_prefetch_factor() -> None:
    chosen = tuner(iterable=True)
    assert chosen.after_epoch(epoch(**BEHIND_IDLE), (2, 2)) == (2, 4)


# -- for_options: which combinations are refused, as torch refuses the int ones -----------------


def test_no_tuner_without_auto() -> None:
    assert Tuner.for_options(2, None, iterable=False, worker_type="process") is None
    assert Tuner.for_options(0, None, iterable=True, worker_type="thread") is None


def raised(module: Any, **kwargs: Any) -> Exception:
    """What building ``module``'s DataLoader with ``kwargs`` raised."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            module.DataLoader(ds.Indices(10), **kwargs)
        except Exception as exc:  # the point is to compare whatever each raises
            return exc
    raise AssertionError(f"{module.__name__}.DataLoader accepted {kwargs}")


@pytest.mark.parametrize(
    ("ferry_kwargs", "torch_kwargs", "phrase"),
    [
        (
            {"num_workers": 0, "prefetch_factor": "auto"},
            {"num_workers": 0, "prefetch_factor": 2},
            "prefetch_factor option could only be specified in multiprocessing",
        ),
        (
            {"num_workers": -1, "prefetch_factor": "auto"},
            {"num_workers": -1, "prefetch_factor": 2},
            "num_workers option should be non-negative",
        ),
        (
            {"num_workers": "auto", "prefetch_factor": -1},
            {"num_workers": 2, "prefetch_factor": -1},
            "prefetch_factor option should be non-negative",
        ),
        (
            {"num_workers": "auto", "timeout": -1},
            {"num_workers": 2, "timeout": -1},
            "timeout option should be non-negative",
        ),
        ({"num_workers": "fast"}, {"num_workers": "fast"}, None),
        (
            {"num_workers": "auto", "prefetch_factor": "x"},
            {"num_workers": 2, "prefetch_factor": "x"},
            None,
        ),
    ],
    ids=[
        "zero-workers",
        "negative-workers",
        "negative-prefetch",
        "timeout",
        "str",
        "str-prefetch",
    ],
)
def test_refused_like_the_int_case_in_torch(
    ferry_kwargs: dict[str, Any], torch_kwargs: dict[str, Any], phrase: str | None
) -> None:
    expected, got = raised(tud, **torch_kwargs), raised(ferry, **ferry_kwargs)
    assert type(got) is type(expected)
    if phrase is not None:
        assert phrase in str(expected)
        assert phrase in str(got)


def test_a_fixed_option_is_checked_as_without_auto() -> None:
    """ferry refuses a float count (torch fails later, in range()); "auto" beside it changes
    nothing."""
    for prefetch in (2, "auto"):
        with pytest.raises(TypeError, match=r'num_workers must be an integer or "auto", got 2\.0'):
            ferry.DataLoader(ds.Indices(10), num_workers=2.0, prefetch_factor=prefetch)  # type: ignore[arg-type]


def test_a_string_other_than_auto_names_auto() -> None:
    with pytest.raises(TypeError, match="num_workers must be an integer or \"auto\", got 'fast'"):
        ferry.DataLoader(ds.Indices(10), num_workers="fast")  # type: ignore[arg-type]


# -- what tuning found, carried by a loader's state ----------------------------------------------


def plain(chosen: Tuner, setting: tuple[int, int], **kwargs: Any) -> Any:
    """``chosen``'s part of a loader state, through json as a checkpoint may take it."""
    options = {"worker_type": "process", "threads_for_waits": False, **kwargs}
    return json.loads(json.dumps(chosen.to_plain(setting, **options)))


def test_tuning_goes_on_where_it_was_on_a_machine_with_the_same_cpus() -> None:
    """A change on trial is judged in the resumed loader as in the saving one; a settled
    tuner stays settled; the tuner resumed from is left as it was."""
    saving = tuner(cpus=8)
    trial = saving.after_epoch(behind_and_busy(2, worker_ms=20, loop_ms=5), (2, 2))
    assert trial == (4, 2)
    assert "on trial" in saving.reason
    fresh = tuner(cpus=8)
    first = fresh.first()
    resumed, options = fresh.resumed(plain(saving, trial), first)
    assert (options.num_workers, options.prefetch_factor) == trial
    assert (options.worker_type, options.threads_for_waits) == ("process", False)
    assert resumed.reason.endswith("(the loaded state's tuning)")
    assert fresh.reason.startswith(f"num_workers={first[0]}")  # (untouched)
    # The trial did not raise batches/s: undone, as the saving tuner would have.
    assert resumed.after_epoch(behind_and_busy(2, worker_ms=20, loop_ms=5), trial) == (2, 2)
    assert "was undone" in resumed.reason
    settled = tuner(cpus=8)
    settled.after_epoch(epoch(**BALANCED), (2, 2))
    again, _ = tuner(cpus=8).resumed(plain(settled, (2, 2)), (8, 2))
    assert again.after_epoch(behind_and_busy(2, worker_ms=20, loop_ms=5), (2, 2)) == (2, 2)


def test_on_another_machine_the_counts_start_again_and_what_was_found_holds() -> None:
    """The counts were tuned to the saving machine's CPUs: another CPU count starts from its
    own (a stream keeps the count its state needs); the kind of worker and what was found
    about the dataset's reads are the dataset's, and hold."""
    saving = tuner(cpus=8)
    saving.after_epoch(epoch(**BALANCED), (6, 4))
    saving.threads_refused = saving.reads_compute = True
    state = plain(saving, (6, 4), worker_type="thread", threads_for_waits=True)
    elsewhere = tuner(cpus=16)
    resumed, options = elsewhere.resumed(state, elsewhere.first())
    assert (options.num_workers, options.prefetch_factor) == (8, 2)
    assert (options.worker_type, options.threads_for_waits) == ("thread", True)
    assert resumed.threads_refused
    assert resumed.reads_compute
    assert "tuned with 8 CPUs; 16 CPUs for this process, so tuning starts again" in resumed.reason
    # (and tuning does start again, where the saving tuner had settled)
    assert resumed.after_epoch(behind_and_busy(8, worker_ms=20, loop_ms=1), (8, 2)) != (8, 2)
    stream = tuner(cpus=16, iterable=True)
    _, options = stream.resumed(state, stream.first())
    assert options.num_workers == 6


def test_only_the_options_given_as_auto_are_restored() -> None:
    saving = tuner(cpus=8)
    state = plain(saving, (6, 4))
    _, options = tuner(num_workers=3, cpus=8).resumed(state, (3, 2))
    assert (options.num_workers, options.prefetch_factor) == (3, 4)
    _, options = tuner(auto_prefetch=False, prefetch_factor=5, cpus=8).resumed(state, (8, 5))
    assert (options.num_workers, options.prefetch_factor) == (6, 5)
    own_threads = tuner(cpus=8, worker_type="thread")  # the user's worker_type="thread"
    _, options = own_threads.resumed(state, (4, 2))
    assert (options.worker_type, options.threads_for_waits) == ("thread", False)


@pytest.mark.parametrize(
    ("entry", "value"),
    [
        ("num_workers", 0),
        ("num_workers", "4"),
        ("prefetch_factor", None),
        ("worker_type", "fiber"),
        ("threads_refused", 1),
        ("epochs", True),
        ("tried", [[2]]),
        ("trial", {"before": [2, 2], "goal": "sideways", "rate_before": 1.0}),
        ("trial", {"before": [2, 2], "goal": "faster"}),
        ("reason", None),
    ],
)
def test_a_malformed_tuning_names_its_entry(entry: str, value: Any) -> None:
    state = plain(tuner(cpus=8), (2, 2))
    state[entry] = value
    with pytest.raises(MalformedState, match=r"its 'tuning' entry '\w+' is"):
        tuner(cpus=8).resumed(state, (2, 2))
    with pytest.raises(MalformedState, match="'tuning' is a list"):
        tuner(cpus=8).resumed([], (2, 2))


# -- the loader with "auto" ---------------------------------------------------------------------


def batches(loader: Any, epochs: int = 3) -> list[list[Any]]:
    return [list(loader) for _ in range(epochs)]


def reference(shuffle: bool, n: int = 96, batch_size: int = 4) -> list[list[Any]]:
    """The batches of three epochs without workers."""
    generator = torch.Generator().manual_seed(7) if shuffle else None
    loader: ferry.DataLoader[Any] = ferry.DataLoader(
        ds.Items(n), batch_size=batch_size, shuffle=shuffle, generator=generator
    )
    return batches(loader)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shuffle", [False, True], ids=["sequential", "shuffled"])
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_auto_makes_the_batches_of_num_workers_0(kind: Kind, shuffle: bool) -> None:
    generator = torch.Generator().manual_seed(7) if shuffle else None
    loader: ferry.DataLoader[Any] = ferry.DataLoader(
        ds.Items(96),
        batch_size=4,
        shuffle=shuffle,
        generator=generator,
        num_workers="auto",
        prefetch_factor="auto",
        **kind.kwargs,
    )
    assert isinstance(loader.num_workers, int)
    assert loader.num_workers >= 1
    assert isinstance(loader.prefetch_factor, int)
    assert loader.stats().tuning.startswith(f"num_workers={loader.num_workers}, prefetch_factor=")
    assert_same(reference(shuffle), batches(loader))
    # Three epochs of 24 batches were judged: each ended in a trial or settled.
    tuning = loader.stats().tuning
    assert "(on trial after epoch " in tuning or "(settled after epoch " in tuning
    assert tuning in str(loader.stats())


class ScriptedTuner(Tuner):
    """Moves ``num_workers`` through ``counts``, one per epoch boundary (the real policy's
    decisions depend on timing; the loader's part must hold for any decision)."""

    def __init__(self, counts: list[int]) -> None:
        super().__init__(
            None,
            None,
            auto_prefetch=False,
            iterable=False,
            worker_type="process",
            cpus=2,
            memory=None,
        )
        self.counts = counts

    def after_epoch(
        self, stats: LoaderStats, current: tuple[int, int | None]
    ) -> tuple[int, int | None]:
        workers = self.counts.pop(0)
        self.reason = f"num_workers={workers} (scripted)"
        return workers, current[1]


def shuffled(kind: Kind, num_workers: int | str, *, persistent: bool) -> ferry.DataLoader[Any]:
    return ferry.DataLoader(
        ds.Items(96),
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(7),
        num_workers=num_workers,  # type: ignore[arg-type]
        persistent_workers=persistent,
        **kind.kwargs,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_a_changed_count_keeps_the_batches(kind: Kind) -> None:
    loader = shuffled(kind, "auto", persistent=False)
    loader._tuner = ScriptedTuner([1, 3])
    got, counts = [], []
    for _ in range(3):
        got.append(list(loader))
        counts.append(loader.stats().num_workers)
    assert counts[1:] == [1, 3]
    assert loader.stats().tuning == "num_workers=3 (scripted)"
    assert_same(reference(shuffle=True), got)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_a_changed_count_keeps_the_batches_of_persistent_workers(kind: Kind) -> None:
    """Persistent workers replaced after a change keep their base seed: the shuffles of the
    later epochs are those of an unchanged run."""
    fixed = shuffled(kind, 2, persistent=True)
    expected = batches(fixed)
    fixed._iterator = None  # stop its kept workers now
    loader = shuffled(kind, "auto", persistent=True)
    loader._tuner = ScriptedTuner([1, 1])  # one change, before the second epoch
    got = batches(loader)
    loader._iterator = None
    assert_same(expected, got)


@pytest.mark.timeout(60)
def test_persistent_workers_are_replaced_when_the_count_changes() -> None:
    loader: ferry.DataLoader[Any] = ferry.DataLoader(
        ds.Indices(40), batch_size=2, num_workers="auto", persistent_workers=True
    )
    loader._tuner = ScriptedTuner([1])
    first = iter(loader)
    old = worker_pids(first)
    assert [b.tolist() for b in first] == [[2 * i, 2 * i + 1] for i in range(20)]
    second = iter(loader)
    assert second is not first
    assert len(worker_pids(second)) == 1
    assert poll(lambda: all(exited(pid) for pid in old), 5.0), "the old workers are still running"
    assert [b.tolist() for b in second] == [[2 * i, 2 * i + 1] for i in range(20)]
    loader._iterator = None  # stop the kept workers now


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_a_stream_keeps_its_count(kind: Kind) -> None:
    loader: ferry.DataLoader[Any] = ferry.DataLoader(
        ds.FerryStream(120), batch_size=2, num_workers="auto", **kind.kwargs
    )
    chosen = loader.num_workers
    assert "a stream keeps its worker count" in loader.stats().tuning
    fixed: ferry.DataLoader[Any] = ferry.DataLoader(
        ds.FerryStream(120), batch_size=2, num_workers=chosen, **kind.kwargs
    )
    expected = batches(fixed)
    got = []
    for _ in range(3):
        got.append(list(loader))
        assert loader.num_workers == chosen
    assert_same(expected, got)


@pytest.mark.timeout(60)
def test_a_stream_resumes_with_its_count_on_a_machine_with_other_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream's state needs the worker count it was saved with (each worker reads its own
    shard): an "auto" loader on a machine with more CPUs takes it from the state, and the rest
    of the epoch is the saving loader's."""

    def stream(cpus: int) -> ferry.DataLoader[Any]:
        monkeypatch.setattr(autotune, "cpus_for_this_process", lambda: cpus)
        return ferry.DataLoader(ds.FerryStream(60), batch_size=3, num_workers="auto")

    saving = stream(cpus=2)
    iterator = iter(saving)
    for _ in range(7):
        next(iterator)
    state = saving.state_dict()
    rest = [b.tolist() for b in iterator]
    elsewhere = stream(cpus=3)
    assert elsewhere.num_workers == 3
    elsewhere.load_state_dict(state)
    assert elsewhere.num_workers == 2
    assert [b.tolist() for b in elsewhere] == rest
    assert "tuned with 2 CPUs; 3 CPUs for this process" in elsewhere.stats().tuning


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_state_dict_resumes_into_a_fresh_auto_loader(
    kind: Kind, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fresh loader goes on with the count tuning reached (on a machine with as many
    CPUs; the scripted tuner's are 2), and the batches are the uninterrupted run's."""
    monkeypatch.setattr(autotune, "cpus_for_this_process", lambda: 2)

    def build() -> ferry.DataLoader[Any]:
        return ferry.DataLoader(
            ds.Items(96),
            batch_size=4,
            shuffle=True,
            generator=torch.Generator().manual_seed(7),
            num_workers="auto",
            **kind.kwargs,
        )

    loader = build()
    loader._tuner = ScriptedTuner([1])
    list(loader)
    it = iter(loader)  # the second epoch, with 1 worker
    for _ in range(10):
        next(it)
    assert loader.num_workers == 1
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["tuning"]["num_workers"] == 1
    rest = list(it)

    resumed = build()
    assert resumed.num_workers == 2  # (from the CPU count)
    resumed.load_state_dict(state)
    assert resumed.num_workers == 1
    assert resumed.stats().tuning == "num_workers=1 (scripted) (the loaded state's tuning)"
    assert_same(rest, list(resumed))
    assert resumed.stats().num_workers == 1
    assert_same(reference(shuffle=True)[1][10:], rest)


def test_a_state_that_does_not_load_leaves_the_auto_loader_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A state whose tuning or whose position does not fit changes none of the loader's
    options; a loader with its options fixed takes the position and ignores the tuning, and
    a state without tuning (saved by an earlier ferry, or by a fixed loader) loads into an
    "auto" loader as it did."""
    monkeypatch.setattr(autotune, "cpus_for_this_process", lambda: 2)

    def auto(n: int = 40) -> ferry.DataLoader[Any]:
        return ferry.DataLoader(ds.Items(n), batch_size=4, num_workers="auto")

    saving = auto()
    saving._tuner = ScriptedTuner([1])
    list(saving)
    list(saving)  # (with 1 worker)
    state = saving.state_dict()
    assert state["tuning"]["num_workers"] == 1
    damaged = {**state, "tuning": {**state["tuning"], "worker_type": "fiber"}}
    for bad, error in ((damaged, MalformedState), (state, StateMismatch)):
        loader = auto(n=40 if bad is damaged else 44)  # (another length: does not fit)
        tuner_before = loader._tuner
        with pytest.raises(error):
            loader.load_state_dict(bad)
        assert (loader.num_workers, loader.worker_type, loader._tuner) == (
            2,
            "process",
            tuner_before,
        )
    fixed = ferry.DataLoader(ds.Items(40), batch_size=4, num_workers=2)
    fixed.load_state_dict(state)
    assert fixed.num_workers == 2
    assert "tuning" not in fixed.state_dict()
    untuned = {k: v for k, v in state.items() if k != "tuning"}
    loader = auto()
    loader.load_state_dict(untuned)
    assert loader.num_workers == 2
    assert len(list(loader)) == 10  # (the epoch after the one saved at its end)


def test_thread_workers_bound_by_the_gil_are_processes_again() -> None:
    """Thread workers that "auto" chose for reads that wait, whose reads then held the GIL most
    of the time while the loop waited (reads that compute in Python, which the judge can take
    for reads that wait), are processes again: one GIL each. Not when the reads left the GIL
    mostly free, on one CPU, on an epoch too short to judge, or for process workers."""
    from dataclasses import replace

    behind = replace(behind_and_busy(2, worker_ms=20, loop_ms=0), engine="thread")
    held = replace(behind, read_cpu_s=0.9 * behind.wall_s, read_span_s=behind.wall_s)
    assert held.bottleneck == "loader"
    chosen = tuner(cpus=8)
    why = chosen.gil_bound(held)
    assert "bound by the one GIL they share" in why
    assert "0.90 CPU seconds a second" in why
    assert chosen.back_to_processes((16, 2), why) == (8, 2)  # (one per CPU at most)
    assert chosen.threads_refused
    assert "process workers again" in chosen.reason
    assert tuner(num_workers=12, cpus=8).back_to_processes((12, 2), why) == (12, 2)  # (fixed)
    free = replace(held, read_cpu_s=0.3 * behind.wall_s)
    ahead = replace(held, waited=0, wait_s=0.0)
    assert ahead.bottleneck == "training loop"
    short = replace(held, batches=autotune.MIN_BATCHES - 1, waited=autotune.MIN_BATCHES - 2)
    processes = replace(held, engine="process")
    for stats, cpus in ((free, 8), (ahead, 8), (short, 8), (processes, 8), (held, 1)):
        assert tuner(cpus=cpus).gil_bound(stats) == ""
