"""One rank of a real ``torch.distributed`` group, started by ``test_distributed_groups.py``.

Usage: ``python _rank_main.py RANK WORLD PORT OUT_DIR``. The rank joins a gloo group over TCP on
127.0.0.1:PORT, runs every check below, and writes ``OUT_DIR/rank{RANK}.pkl``: a dict from check
name to ``("ok", result)`` or ``("error", traceback)``. A check that fails does not stop the
others, so one group start-up serves the whole matrix; every failure (ferry's loader not
importing included) reaches the test as an error, never as a skip.

Run as a script (not imported by name) so that it does not depend on how pytest imports test
modules. The datasets live in this script, which spawned loader workers import again (as
``__mp_main__``) to unpickle them.
"""

from __future__ import annotations

import datetime
import itertools
import os
import pickle
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import IterableDataset as TorchIterableDataset
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

from ferry.distributed import DistributedSampler, shard, shard_info
from ferry.loader import DataLoader as FerryDataLoader

SEEDS = (0, 11)
EPOCHS = (0, 1, 5)
STREAM_LENGTH = 23


def dataset_lengths(world: int) -> list[int]:
    """Lengths that divide by the world size, that do not, and that are smaller than it."""
    return sorted({0, 1, world - 1, world, world + 1, 2 * world + 1, 10, 17, 33})


class Rows:
    """A map-style dataset of ``(features, index)`` pairs, without any torch base class."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([float(i), float(i) * 0.5]), torch.tensor(i)


class ShardedStream(TorchIterableDataset[int]):
    """A stream of ``0 .. n-1`` of which each (rank, worker) reads its own share."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return shard(range(self.n))


def _sizes(sampler: Any) -> tuple[int, int, int, int]:
    return sampler.num_replicas, sampler.rank, sampler.num_samples, sampler.total_size


def sampler_matrix(world: int) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Every case: ferry's sampler (rank and world from the group) next to torch's.

    Keyed by ``(n, shuffle, drop_last, seed, epoch)``.
    """
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    cases = itertools.product(dataset_lengths(world), (True, False), (True, False), SEEDS)
    for n, shuffle, drop_last, seed in cases:
        options: dict[str, Any] = {"shuffle": shuffle, "seed": seed, "drop_last": drop_last}
        ours = DistributedSampler(range(n), **options)
        theirs = TorchDistributedSampler(range(n), **options)
        unpadded = DistributedSampler(range(n), shuffle=shuffle, seed=seed, pad=False)
        for epoch in EPOCHS:
            for sampler in (ours, theirs, unpadded):
                sampler.set_epoch(epoch)
            chunks = [*ours._index_chunks(), torch.empty(0, dtype=torch.int64)]
            out[n, shuffle, drop_last, seed, epoch] = {
                "ferry": list(ours),
                "torch": list(theirs),
                "ferry_len": len(ours),
                "torch_len": len(theirs),
                "attrs": _sizes(ours),
                "torch_attrs": _sizes(theirs),
                "chunks": torch.cat(chunks).tolist(),
                "unpadded": list(unpadded),
                "unpadded_len": len(unpadded),
            }
    return out


def shard_check() -> dict[str, Any]:
    return {"info": shard_info(), "items": list(shard(range(STREAM_LENGTH)))}


def _workers(num_workers: int, worker_type: str, context: str | None = None) -> dict[str, Any]:
    if num_workers == 0:
        return {}
    if worker_type == "thread":
        return {"num_workers": num_workers, "worker_type": "thread"}
    # Persistent: one start-up for all epochs (a spawned worker imports torch: seconds here).
    return {
        "num_workers": num_workers,
        "multiprocessing_context": context,
        "persistent_workers": True,
    }


def _epoch(loader: Iterable[Any]) -> list[Any]:
    """One epoch of ``loader`` as lists."""
    return [
        batch.tolist() if isinstance(batch, torch.Tensor) else [t.tolist() for t in batch]
        for batch in loader
    ]


def loader_check(num_workers: int = 0, worker_type: str = "process") -> dict[str, Any]:
    """Batches through ferry's DataLoader and torch's, for three epochs, with set_epoch.

    Process workers use the default start method (fork on Linux, as torch's loaders under DDP
    usually do) and persist across epochs, while the sampler reshuffles in the main process.
    """
    dataset = Rows(29)
    ours = DistributedSampler(dataset, seed=3)
    theirs = TorchDistributedSampler(dataset, seed=3)
    ferry_loader = FerryDataLoader(
        dataset, sampler=ours, batch_size=4, **_workers(num_workers, worker_type)
    )
    torch_loader = TorchDataLoader(dataset, sampler=theirs, batch_size=4)
    out: dict[str, Any] = {"ferry": [], "torch": [], "len": (len(ferry_loader), len(torch_loader))}
    for epoch in range(3):
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        out["ferry"].append(_epoch(ferry_loader))
        out["torch"].append(_epoch(torch_loader))
    return out


def stream_check(num_workers: int = 0, worker_type: str = "process") -> list[int]:
    """The items this rank's loader yields from a sharded stream, with ``num_workers`` workers.

    Process workers are spawned: unlike forked ones they have no copy of the process group, so
    only what the loader hands them tells them their rank.
    """
    loader = FerryDataLoader(
        ShardedStream(STREAM_LENGTH), batch_size=3, **_workers(num_workers, worker_type, "spawn")
    )
    return [item for batch in _epoch(loader) for item in batch]


def ddp_check() -> dict[str, Any]:
    """Trains a tiny linear model with DDP on ferry loaders; returns losses and final weights."""
    from torch.nn.parallel import DistributedDataParallel

    data_generator = torch.Generator().manual_seed(0)
    features = torch.randn(64, 3, generator=data_generator)
    targets = features @ torch.tensor([[1.5], [-2.0], [0.5]]) + 0.25

    class Pairs:
        def __len__(self) -> int:
            return len(features)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return features[i], targets[i]

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = DistributedSampler(Pairs(), seed=1)
    loader = FerryDataLoader(Pairs(), batch_size=8, sampler=sampler)
    losses: list[float] = []
    steps = 0
    for epoch in range(4):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            steps += 1
    weights = [p.detach().flatten().tolist() for p in model.module.parameters()]
    return {"losses": losses, "steps": steps, "weights": weights}


def run_checks(world: int) -> dict[str, tuple[str, Any]]:
    checks: dict[str, Callable[[], Any]] = {
        "sampler": lambda: sampler_matrix(world),
        "shard": shard_check,
        "loader_0": loader_check,
        "stream_0": stream_check,
        "loader_threads": lambda: loader_check(2, "thread"),
        "stream_threads": lambda: stream_check(2, "thread"),
    }
    if world == 2:  # spawned workers and DDP: on the smaller group only, to keep the suite fast
        checks["ddp"] = ddp_check
        checks["loader_processes"] = lambda: loader_check(2, "process")
        checks["stream_processes"] = lambda: stream_check(2, "process")
    results: dict[str, tuple[str, Any]] = {}
    for name, check in checks.items():
        try:
            results[name] = ("ok", check())
        except Exception:
            results[name] = ("error", traceback.format_exc())
        # Keep the ranks in step, so that a rank that failed early does not leave the others
        # waiting inside a collective of the next check.
        dist.barrier()
    return results


def main() -> None:
    rank, world, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        results = run_checks(world)
    finally:
        dist.destroy_process_group()
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(results, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
