"""One rank of a real gloo group, started by ``test_distributed_resume.py``.

Usage: ``python _resume_rank_main.py RANK WORLD PORT OUT_DIR PLAN``. ``PLAN`` is a JSON file: a
list of jobs run in order, each one of

- ``{"action": "save", "name", "config", "k", "state"}``: every rank iterates ``k`` batches of
  its loader; rank 0 writes ``loader.state_dict()`` to the JSON file ``state`` (as only rank 0
  of a DDP job saves a checkpoint). Result: the indices every rank saw (all_gather_object).
- ``{"action": "resume", "name", "config", "state", "num_workers"}``: every rank builds a
  fresh loader, loads the state from ``state`` and finishes the epoch, then runs the next one
  after ``set_epoch(epoch + 1)``. Result: every rank's batches of both (all_gather_object).

The samplers take the world size and rank from the process group. ``OUT_DIR/rank{RANK}.pkl``
gets a dict from job name to ``("ok", result)`` or ``("error", traceback)``; a failing job
does not stop the others.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import sys
import traceback
from typing import Any

import torch.distributed as dist

import ferry


class Indices:
    """A map-style dataset whose sample ``i`` is ``i``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _loader(config: dict[str, Any], num_workers: int) -> ferry.DataLoader[Any]:
    dataset = Indices(config["n"])
    sampler = ferry.DistributedSampler(
        dataset, shuffle=config["shuffle"], seed=config["seed"], drop_last=config["drop_last"]
    )
    sampler.set_epoch(config["epoch"])
    return ferry.DataLoader(
        dataset, batch_size=config["batch_size"], sampler=sampler, num_workers=num_workers
    )


def _gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def save(job: dict[str, Any]) -> list[Any]:
    loader = _loader(job["config"], 0)
    batches = []
    iterator = iter(loader)
    for _ in range(job["k"]):
        batches.append(next(iterator).tolist())
    if dist.get_rank() == 0:
        state = loader.state_dict()
        with open(job["state"] + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(job["state"] + ".tmp", job["state"])
    return _gather(batches)


def resume(job: dict[str, Any]) -> list[Any]:
    config = job["config"]
    with open(job["state"]) as f:
        state = json.load(f)
    loader = _loader(config, job["num_workers"])
    loader.load_state_dict(state)
    rest = [batch.tolist() for batch in loader]
    loader.sampler.set_epoch(config["epoch"] + 1)  # type: ignore[attr-defined]
    following = [batch.tolist() for batch in loader]
    return _gather({"rest": rest, "next": following})


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    out_dir, plan_path = sys.argv[4], sys.argv[5]
    with open(plan_path) as f:
        plan = json.load(f)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    results: dict[str, tuple[str, Any]] = {}
    try:
        for job in plan:
            try:
                run = save if job["action"] == "save" else resume
                results[job["name"]] = ("ok", run(job))
            except Exception:
                results[job["name"]] = ("error", traceback.format_exc())
            # In step: a state rank 0 wrote is on disk before any rank reads it, and a rank
            # that failed does not leave the others inside the next job's collective.
            dist.barrier()
    finally:
        dist.destroy_process_group()
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(results, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
