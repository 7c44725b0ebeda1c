"""DistributedSampler and shard on real gloo process groups of 2 and 4 ranks, against torch.

Each world size is started once (a start-up costs seconds): ``_rank_main.py`` runs the whole
matrix of cases on every rank and writes the results to files, and the tests below read them.
The rank processes build their samplers from the process group, without num_replicas or rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from _support.ranks import PYTHON, run_ranks, stop

RANK_MAIN = Path(__file__).with_name("_rank_main.py")
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "torchrun_train.py"
# One intra-op thread per rank: the ranks share a few cores.
RANK_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
GROUP_DEADLINE_S = 150.0  # generous: the machine may be shared with other test runs

Results = list[dict[str, tuple[str, Any]]]


def _run_group(world: int, out_dir: Path) -> Results:
    """Starts ``world`` rank processes, waits for all of them, returns each rank's results."""
    return run_ranks(
        lambda rank, port: [PYTHON, str(RANK_MAIN), str(rank), str(world), str(port), str(out_dir)],
        world,
        out_dir,
        GROUP_DEADLINE_S,
        f"the world-{world} group",
    )


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def group(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Results:
    world: int = request.param
    return _run_group(world, tmp_path_factory.mktemp(f"world{world}"))


# Checks with spawned workers or DDP run on the group of two only (see _rank_main.run_checks).
WORLD_2_ONLY = pytest.mark.parametrize("group", [2], indirect=True, ids=["world2"])


def _ok(results: Results, check: str) -> list[Any]:
    """The result of ``check`` on every rank; fails on a rank where it raised."""
    values = []
    for rank, per_rank in enumerate(results):
        status, value = per_rank[check]
        assert status == "ok", f"rank {rank}, check {check}:\n{value}"
        values.append(value)
    return values


@pytest.mark.timeout(240)
def test_every_rank_yields_torchs_indices(group: Results) -> None:
    world = len(group)
    per_rank = _ok(group, "sampler")
    for case in per_rank[0]:
        for rank, cases in enumerate(per_rank):
            got = cases[case]
            assert got["ferry"] == got["torch"], (rank, case)
            assert got["chunks"] == got["ferry"], (rank, case)
            assert got["ferry_len"] == got["torch_len"] == len(got["ferry"]), (rank, case)
            assert got["attrs"] == got["torch_attrs"], (rank, case)
            assert got["attrs"][:2] == (world, rank), (rank, case)


@pytest.mark.timeout(240)
def test_ranks_cover_the_dataset_with_equal_lengths(group: Results) -> None:
    world = len(group)
    per_rank = _ok(group, "sampler")
    for case in per_rank[0]:
        n, _shuffle, drop_last, _seed, _epoch = case
        parts = [cases[case]["ferry"] for cases in per_rank]
        assert len({len(part) for part in parts}) == 1, case
        seen = Counter(i for part in parts for i in part)
        assert set(seen) <= set(range(n)), case
        if drop_last:
            assert sum(seen.values()) == n // world * world, case
            assert max(seen.values(), default=1) == 1, case
        else:
            assert set(seen) == set(range(n)), case


@pytest.mark.timeout(240)
def test_unpadded_ranks_see_each_sample_exactly_once(group: Results) -> None:
    world = len(group)
    per_rank = _ok(group, "sampler")
    for case in per_rank[0]:
        n = case[0]
        parts = [cases[case]["unpadded"] for cases in per_rank]
        assert sorted(i for part in parts for i in part) == list(range(n)), case
        assert [len(part) for part in parts] == [len(range(r, n, world)) for r in range(world)]
        assert [cases[case]["unpadded_len"] for cases in per_rank] == [len(p) for p in parts]


@pytest.mark.timeout(240)
def test_epochs_reshuffle_the_same_way_on_every_rank(group: Results) -> None:
    per_rank = _ok(group, "sampler")
    n = 33
    for rank_cases in per_rank:
        orders = {rank_cases[n, True, False, 0, epoch]["ferry"].__repr__() for epoch in (0, 1, 5)}
        assert len(orders) == 3
    # The same epoch gives one permutation split between ranks: no overlap within it.
    parts = [cases[n, True, True, 0, 1]["ferry"] for cases in per_rank]
    assert len({i for part in parts for i in part}) == sum(len(p) for p in parts)


@pytest.mark.timeout(240)
def test_shard_splits_a_stream_between_ranks(group: Results) -> None:
    world = len(group)
    shards = _ok(group, "shard")
    assert [s["info"] for s in shards] == [(rank, world) for rank in range(world)]
    assert sorted(i for s in shards for i in s["items"]) == list(range(23))
    assert [s["items"] for s in shards] == [list(range(r, 23, world)) for r in range(world)]


@pytest.mark.timeout(240)
def test_ferry_loader_matches_torch_loader(group: Results) -> None:
    for out in _ok(group, "loader_0"):
        assert out["ferry"] == out["torch"]
        assert out["len"][0] == out["len"][1]


@pytest.mark.timeout(240)
def test_ferry_loader_with_thread_workers_matches_torch_loader(group: Results) -> None:
    for out in _ok(group, "loader_threads"):
        assert out["ferry"] == out["torch"]


@pytest.mark.timeout(240)
@WORLD_2_ONLY
def test_ferry_loader_with_process_workers_matches_torch_loader(group: Results) -> None:
    for out in _ok(group, "loader_processes"):
        assert out["ferry"] == out["torch"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("check", ["stream_0", "stream_threads"])
def test_sharded_stream_through_loader_covers_it_once(group: Results, check: str) -> None:
    streams = _ok(group, check)
    assert sorted(i for s in streams for i in s) == list(range(23))


@pytest.mark.timeout(240)
@WORLD_2_ONLY
def test_sharded_stream_through_process_workers_covers_it_once(group: Results) -> None:
    """Workers learn the rank from the main process, so ranks x workers read disjoint shares."""
    streams = _ok(group, "stream_processes")
    assert sorted(i for s in streams for i in s) == list(range(23)), (
        "spawned workers did not learn their rank: the loader must pass "
        "ferry._core.ranks.process_group_rank_world() to each worker, which calls "
        "ferry._core.ranks.inherit_rank_world() before user code (docs/distributed.md)"
    )


@pytest.mark.timeout(240)
@WORLD_2_ONLY
def test_ddp_training_runs_in_step_on_every_rank(group: Results) -> None:
    runs = _ok(group, "ddp")
    assert len({r["steps"] for r in runs}) == 1
    assert runs[0]["steps"] == 4 * 4  # 64 samples / 2 ranks / batches of 8, for 4 epochs
    # DDP averages gradients, so every rank ends with the same weights.
    assert all(r["weights"] == runs[0]["weights"] for r in runs)
    for r in runs:
        assert r["losses"][-1] < r["losses"][0] / 4


# torch's gloo backend sometimes aborts a rank as its interpreter exits (a gloo thread drops
# its last tensor reference during finalization): the training finished, the exit did not.
# torch's own DataLoader gets the same abort; see the note in the example.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def _launch_example(cwd: Path) -> tuple[int, str]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(EXAMPLE),
            "--epochs",
            "2",
        ],
        cwd=cwd,
        env=RANK_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        output, _ = process.communicate(timeout=100)
    finally:
        stop([process])
    return process.returncode, output.decode(errors="replace")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_example_trains(tmp_path: Path) -> None:
    """The README's example, launched the way the README says."""
    returncode, text = _launch_example(tmp_path)
    if returncode != 0 and GLOO_EXIT_ABORT in text and "epoch 1" in text:
        returncode, text = _launch_example(tmp_path)  # gloo's exit race, not ours: once more
    assert returncode == 0, text
    assert "epoch 1" in text, text
