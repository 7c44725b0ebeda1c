"""Mid-epoch resume of a DataLoader over a DistributedSampler, same and other world sizes.

A loader's ``state_dict()`` holds the sampler's start (epoch, world size, positions used) and
a position in batches. Resumed with the world size it was saved with, each rank continues its
own epoch. Resumed with another, the positions of the epoch's list no rank had used are dealt
round-robin over the new ranks without padding. What a job relies on, checked here:

- same world size: every rank's batches before the save, then after the resume, are its
  uninterrupted epoch (torch's ``DistributedSampler``'s), batch for batch;
- another world size, rank 0's state loaded on every new rank (only rank 0 saves a
  checkpoint): no sample seen before the save is seen again, none is seen twice after it, and
  (``drop_last=False``) every sample no rank had seen is seen exactly once; with
  ``drop_last=True`` at most ``new_world - 1`` of them (the uneven tail) are left out;
- the epoch after the resumed one (``set_epoch(e + 1)``) is torch's epoch ``e + 1`` for the
  new world size.

"Seen before the save" means the indices the old ranks' first ``k`` batches delivered, which
include the repeats that pad an uneven epoch when ``drop_last=False``.

The first tests run in one process with explicit ``num_replicas``/``rank``; the last ones on
real gloo groups (``_resume_rank_main.py``), three launches in all.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

import ferry
from _support.ranks import PYTHON, run_ranks
from distributed._resume_rank_main import Indices

SEED = 5
EPOCH = 2  # the epoch saved mid-way: not 0, so a resume that forgets it shows
LENGTHS = (6, 16, 24, 19, 26, 29)  # divisible by 2 and 4, by 2 only, by neither
RESIZES = {2: (4, 3), 4: (2, 1)}


class Opts(NamedTuple):
    """The batch size and the sampler's options, the same on every rank and world size."""

    b: int
    shuffle: bool
    drop_last: bool
    seed: int = SEED


def _loader(n: int, world: int, rank: int, opts: Opts, epoch: int | None) -> ferry.DataLoader[Any]:
    """Rank ``rank``'s loader; ``epoch=None`` leaves the sampler at epoch 0 (no set_epoch)."""
    dataset = Indices(n)
    sampler = ferry.DistributedSampler(
        dataset,
        num_replicas=world,
        rank=rank,
        shuffle=opts.shuffle,
        seed=opts.seed,
        drop_last=opts.drop_last,
    )
    if epoch is not None:
        sampler.set_epoch(epoch)
    return ferry.DataLoader(dataset, batch_size=opts.b, sampler=sampler, num_workers=0)


def _torch_epoch(n: int, world: int, rank: int, opts: Opts, epoch: int) -> list[list[int]]:
    """Rank ``rank``'s batches of epoch ``epoch`` with torch's sampler (the oracle)."""
    sampler = TorchDistributedSampler(
        range(n),
        num_replicas=world,
        rank=rank,
        shuffle=opts.shuffle,
        seed=opts.seed,
        drop_last=opts.drop_last,
    )
    sampler.set_epoch(epoch)
    keys = list(sampler)
    return [keys[i : i + opts.b] for i in range(0, len(keys), opts.b)]


def _batches(loader: ferry.DataLoader[Any]) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def _take(loader: ferry.DataLoader[Any], k: int) -> list[list[int]]:
    iterator = iter(loader)
    return [next(iterator).tolist() for _ in range(k)]


def _json(state: dict[str, Any]) -> dict[str, Any]:
    text = json.dumps(state)
    assert json.loads(text) == state, "state_dict() is not plain JSON data"
    return dict(json.loads(text))


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def _stops(n: int, world: int, b: int, drop_last: bool) -> list[int]:
    """Batch counts ``k`` to save after: early, middle and late, but before the epoch's end."""
    per_rank = n // world if drop_last else -(-n // world)
    batches = -(-per_rank // b)
    return sorted(k for k in {1, 2, batches // 2, batches - 2, batches - 1} if 1 <= k < batches)


def resume_problems(
    n: int, before: list[int], after: list[list[int]], drop_last: bool
) -> list[str]:
    """What is wrong with a resume on ``len(after)`` new ranks, after the old ranks delivered
    ``before`` (padding repeats included): each problem in words, none when all is well."""
    problems = []
    seen = set(before)
    flat = [i for part in after for i in part]
    twice = sorted(i for i, count in Counter(flat).items() if count > 1)
    again = sorted(seen.intersection(flat))
    outside = sorted(set(flat) - set(range(n)))
    missing = sorted(set(range(n)) - seen - set(flat))
    sizes = [len(part) for part in after]
    if twice:
        problems.append(f"seen twice after the resume: {twice}")
    if again:
        problems.append(f"seen before the save and again after it: {again}")
    if outside:
        problems.append(f"not indices of the dataset: {outside}")
    if drop_last and len(missing) >= len(after):
        problems.append(f"{len(missing)} unseen samples left out (more than the tail): {missing}")
    if not drop_last and missing:
        problems.append(f"never seen: {missing}")
    if sizes and max(sizes) - min(sizes) > 1:
        problems.append(f"the new ranks' shares are uneven: {sizes} samples")
    return problems


# -- one process, explicit ranks --------------------------------------------------------------


def _same_world_cases() -> list[tuple[int, bool, bool, int]]:
    return [
        (w, s, d, b) for w in (2, 4) for s in (True, False) for d in (True, False) for b in (1, 3)
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("world", "shuffle", "drop_last", "b"), _same_world_cases())
def test_same_world_resume_continues_every_ranks_epoch(
    world: int, shuffle: bool, drop_last: bool, b: int
) -> None:
    opts = Opts(b, shuffle, drop_last)
    for n in LENGTHS:
        for k in _stops(n, world, b, drop_last):
            case = f"n={n} k={k}"
            old = [_loader(n, world, r, opts, EPOCH) for r in range(world)]
            firsts = [_take(loader, k) for loader in old]
            states = [_json(loader.state_dict()) for loader in old]
            for rank in range(world):
                whole = _torch_epoch(n, world, rank, opts, EPOCH)
                fresh = _loader(n, world, rank, opts, EPOCH)
                assert _batches(fresh) == whole, case
                # Its own state, and rank 0's (only rank 0 saves): the ranks step in lockstep.
                for state in (states[rank], states[0]):
                    # No set_epoch on the new sampler: the state says which epoch it was.
                    new = _loader(n, world, rank, opts, None)
                    new.load_state_dict(state)
                    assert firsts[rank] + _batches(new) == whole, (case, rank)
                    new.sampler.set_epoch(EPOCH + 1)  # type: ignore[attr-defined]
                    following = _torch_epoch(n, world, rank, opts, EPOCH + 1)
                    assert _batches(new) == following, (case, rank)


@pytest.mark.timeout(60)
def test_rank_with_nothing_left_reads_nothing_in_the_resumed_epoch() -> None:
    """Resumed on more ranks than samples left, a rank whose share is empty ends the epoch at
    once (it does not start the epoch over, nor the next one)."""
    n, opts = 4, Opts(1, False, False)
    old = [_loader(n, 2, r, opts, EPOCH) for r in range(2)]
    assert [_take(loader, 1) for loader in old] == [[[0]], [[1]]]
    state = _json(old[0].state_dict())  # samples 2 and 3 are left: for new ranks 0 and 1
    after = []
    for rank in range(4):
        new = _loader(n, 4, rank, opts, EPOCH)
        new.load_state_dict(state)
        after.append(_batches(new))
    assert after == [[[2]], [[3]], [], []]


def _resize_cases() -> list[tuple[int, int, bool, bool, int]]:
    return [
        (w, nw, s, d, b)
        for w, targets in RESIZES.items()
        for nw in targets
        for s in (True, False)
        for d in (True, False)
        for b in (1, 3)
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("world", "new_world", "shuffle", "drop_last", "b"), _resize_cases())
def test_resume_on_another_world_size_sees_every_unseen_sample_once(
    world: int, new_world: int, shuffle: bool, drop_last: bool, b: int
) -> None:
    opts = Opts(b, shuffle, drop_last)
    failures = []
    for n in LENGTHS:
        for k in _stops(n, world, b, drop_last):
            case = f"n={n} k={k}"
            old = [_loader(n, world, r, opts, EPOCH) for r in range(world)]
            before = [i for loader in old for i in _flat(_take(loader, k))]
            state = _json(old[0].state_dict())  # only rank 0 saves
            news = []
            for rank in range(new_world):
                # As a training loop does at each epoch's start, the restored epoch included.
                new = _loader(n, new_world, rank, opts, EPOCH)
                new.load_state_dict(state)
                news.append(new)
            after = [_flat(_batches(new)) for new in news]
            problems = resume_problems(n, before, after, drop_last)
            if problems:
                failures.append(f"{case}: per new rank {after}: " + "; ".join(problems))
            for rank, new in enumerate(news):
                new.sampler.set_epoch(EPOCH + 1)  # type: ignore[attr-defined]
                following = _torch_epoch(n, new_world, rank, opts, EPOCH + 1)
                assert _batches(new) == following, (case, rank)
    assert not failures, f"{len(failures)} resumes went wrong:\n" + "\n".join(failures)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("worlds", [(2, 3, 4), (4, 3, 3), (4, 2, 1)], ids=str)
def test_resumed_epoch_can_be_saved_and_resumed_again(
    worlds: tuple[int, int, int], b: int, drop_last: bool
) -> None:
    """A second save mid-way through the resumed epoch, resumed on a third world size."""
    first, second, third = worlds
    n, opts = 29, Opts(b, True, drop_last)
    old = [_loader(n, first, r, opts, EPOCH) for r in range(first)]
    before = [i for loader in old for i in _flat(_take(loader, 1))]
    state = _json(old[0].state_dict())
    middle = []
    for rank in range(second):
        loader = _loader(n, second, rank, opts, EPOCH)
        loader.load_state_dict(state)
        middle.append(loader)
    # One more batch on every rank of the second world (each has more than one left).
    iterators = [iter(loader) for loader in middle]
    mid = [next(iterator).tolist() for iterator in iterators]
    state = _json(middle[0].state_dict())
    after = []
    for rank in range(third):
        loader = _loader(n, third, rank, opts, EPOCH)
        loader.load_state_dict(state)
        after.append(_flat(_batches(loader)))
    # Nothing repeated so far.
    assert len(set(before + _flat(mid))) == len(set(before)) + len(_flat(mid)), (before, mid)
    if third == second:
        # The same world size: each rank simply finishes its share of the resumed epoch.
        rest = [[i for batch in iterator for i in batch.tolist()] for iterator in iterators]
        assert after == rest
    assert resume_problems(n, before + _flat(mid), after, drop_last) == []


# -- real process groups ----------------------------------------------------------------------

RESUME_MAIN = Path(__file__).with_name("_resume_rank_main.py")
LAUNCH_DEADLINE_S = 60.0  # each; three launches stay within the tests' timeout

CONFIGS: dict[str, dict[str, Any]] = {
    "shuffled": {"n": 23, "batch_size": 2, "shuffle": True, "drop_last": False, "seed": 7,
                 "epoch": 1},
    "drop_last": {"n": 26, "batch_size": 3, "shuffle": True, "drop_last": True, "seed": 3,
                  "epoch": 0},
    "tail": {"n": 10, "batch_size": 1, "shuffle": False, "drop_last": False, "seed": 0,
             "epoch": 3},
}  # fmt: skip
# Batches every rank runs before rank 0 saves, by config and world size. "tail" saved on 2
# ranks leaves fewer unseen samples (2) than new ranks when resumed on 4: ranks 2 and 3 then
# have nothing left to read in the epoch.
STOPS = {"shuffled": {2: 2, 4: 2}, "drop_last": {2: 1, 4: 1}, "tail": {2: 4, 4: 2}}
# (saved on, resumed on): one of each direction and both same-size cases.
RESUMES = [(4, 2), (2, 2), (2, 4), (4, 4)]


def _launch(world: int, jobs: list[dict[str, Any]], out_dir: Path) -> list[dict[str, Any]]:
    out_dir.mkdir()
    plan = out_dir / "plan.json"
    plan.write_text(json.dumps(jobs))
    return run_ranks(
        lambda rank, port: [
            PYTHON,
            str(RESUME_MAIN),
            str(rank),
            str(world),
            str(port),
            str(out_dir),
            str(plan),
        ],
        world,
        out_dir,
        LAUNCH_DEADLINE_S,
        f"the world-{world} resume launch",
    )


def _save_job(name: str, world: int, states: Path) -> dict[str, Any]:
    config = CONFIGS[name]
    return {
        "action": "save",
        "name": f"save{world}-{name}",
        "config": config,
        "k": STOPS[name][world],
        "state": str(states / f"{name}-world{world}.json"),
    }


def _resume_job(name: str, old: int, new: int, states: Path) -> dict[str, Any]:
    # Resumed on 4 ranks with one process worker each: the state came from num_workers=0.
    return {
        "action": "resume",
        "name": f"resume{old}to{new}-{name}",
        "config": CONFIGS[name],
        "state": str(states / f"{name}-world{old}.json"),
        "num_workers": 1 if new == 4 else 0,
    }


@pytest.fixture(scope="module")
def group_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Any]]:
    """Three launches: 4 ranks save; 2 ranks resume that (4->2), save, and resume their own
    (2->2, fresh loaders in the same processes); 4 ranks resume both states (2->4, 4->4)."""
    root = tmp_path_factory.mktemp("resume")
    states = root / "states"
    states.mkdir()
    launches = [
        (4, [_save_job(name, 4, states) for name in CONFIGS]),
        (
            2,
            [_resume_job(name, 4, 2, states) for name in CONFIGS]
            + [_save_job(name, 2, states) for name in CONFIGS]
            + [_resume_job(name, 2, 2, states) for name in CONFIGS],
        ),
        (4, [_resume_job(name, old, 4, states) for old in (2, 4) for name in CONFIGS]),
    ]
    results: dict[str, tuple[str, Any]] = {}
    for number, (world, jobs) in enumerate(launches):
        per_rank = _launch(world, jobs, root / f"launch{number}")
        for job in jobs:
            status, value = per_rank[0][job["name"]]
            if status != "ok":  # a failure on any rank counts: the first one's traceback
                status, value = next(
                    (r[job["name"]] for r in per_rank if r[job["name"]][0] != "ok"),
                    (status, value),
                )
            results[job["name"]] = (status, value)
    return results


def _result(runs: dict[str, tuple[str, Any]], name: str) -> Any:
    status, value = runs[name]
    assert status == "ok", f"{name}:\n{value}"
    return value


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize(("old", "new"), RESUMES, ids=str)
def test_group_resume_sees_every_sample_once(
    group_runs: dict[str, tuple[str, Any]], old: int, new: int, name: str
) -> None:
    config = CONFIGS[name]
    n, b, shuffle, drop_last = (config[key] for key in ("n", "batch_size", "shuffle", "drop_last"))
    epoch = config["epoch"]
    opts = Opts(b, shuffle, drop_last, config["seed"])
    firsts = _result(group_runs, f"save{old}-{name}")  # every old rank's first k batches
    resumed = _result(group_runs, f"resume{old}to{new}-{name}")
    assert len(firsts) == old
    assert len(resumed) == new
    k = STOPS[name][old]
    assert firsts == [_torch_epoch(n, old, r, opts, epoch)[:k] for r in range(old)]
    if old == new:
        for rank in range(new):
            whole = _torch_epoch(n, new, rank, opts, epoch)
            assert firsts[rank] + resumed[rank]["rest"] == whole, rank
    else:
        before = [i for batches in firsts for i in _flat(batches)]
        after = [_flat(part["rest"]) for part in resumed]
        assert resume_problems(n, before, after, drop_last) == [], after
    for rank in range(new):
        following = _torch_epoch(n, new, rank, opts, epoch + 1)
        assert resumed[rank]["next"] == following, rank


@pytest.mark.timeout(60)
def test_set_epoch_to_another_epoch_starts_that_epoch_afresh() -> None:
    """Lightning resumes an end-of-epoch checkpoint by moving to the next epoch and calling
    set_epoch before iter(): the saved position belongs to the epoch before, so the sampler
    must yield the new epoch in full. Set to the saved epoch, it continues the saved one."""
    n, opts = 10, Opts(2, True, False)
    old = _loader(n, 2, 0, opts, EPOCH)
    firsts = _take(old, 3)  # the whole of rank 0's epoch: 5 indices in batches of 2
    state = _json(old.state_dict())
    moved = _loader(n, 2, 0, opts, EPOCH + 1)
    moved.load_state_dict(state)
    assert _batches(moved) == _torch_epoch(n, 2, 0, opts, EPOCH + 1)
    same = _loader(n, 2, 0, opts, EPOCH)
    same.load_state_dict(state)
    assert firsts + _batches(same) == _torch_epoch(n, 2, 0, opts, EPOCH)
    assert _batches(same) == _torch_epoch(n, 2, 0, opts, EPOCH)  # the loop's next epoch
