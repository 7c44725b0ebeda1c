"""Data-parallel training on CPU with torchrun, DDP and ferry's loader.

Run it with two processes on this machine::

    torchrun --standalone --nproc_per_node=2 examples/torchrun_train.py

or on two machines, HOST being the first one's address (run on each, with ``--node_rank=0``
on HOST and ``--node_rank=1`` on the other)::

    torchrun --nnodes=2 --nproc_per_node=4 --node_rank=0 \\
        --master_addr=HOST --master_port=29500 examples/torchrun_train.py

torchrun starts one process per rank and sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``, from which ``init_process_group`` builds the group. Each rank trains on its own
share of the data (``DistributedSampler``, reshuffled every epoch with ``set_epoch``), and DDP
averages the gradients, so the replicas stay identical. Validation uses ``pad=False``: every
sample is scored exactly once across the ranks, and the sums are added up with ``all_reduce``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ferry import DataLoader, TensorDataset
from ferry.distributed import DistributedSampler


def make_data(n: int, seed: int) -> TensorDataset:
    """A noisy linear problem, identical on every rank (same seed)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    true_weight = torch.linspace(-1.0, 1.0, 8).unsqueeze(1)
    y = x @ true_weight + 0.3 + 0.01 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def _wait_for_gloo_release(tensor: torch.Tensor) -> None:
    """Wait until gloo's worker thread has dropped its reference to ``tensor``.

    It drops it just after ``all_reduce`` returns, and dropping it takes the GIL: if that
    happens while the interpreter is shutting down, the process aborts ("terminate called
    without an active exception"). torch's own DataLoader gets the same abort; it is a race of
    the gloo backend, not of the loader.
    """
    use_count = getattr(tensor, "_use_count", None)  # a private torch API: skip if absent
    deadline = time.monotonic() + 1.0
    while use_count is not None and use_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.001)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-workers", type=int, default=0)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # CPU; use "nccl" on GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        train_set, val_set = make_data(1000, seed=0), make_data(203, seed=1)

        # Rank and world size come from the process group. The seed must match on every rank.
        train_sampler = DistributedSampler(train_set, shuffle=True, seed=42)
        val_sampler = DistributedSampler(val_set, shuffle=False, pad=False)
        train_loader = DataLoader(
            train_set,
            batch_size=args.batch_size,
            sampler=train_sampler,  # the sampler shuffles: leave shuffle unset
            num_workers=args.num_workers,
            persistent_workers=args.num_workers > 0,  # start workers once, not every epoch
            drop_last=True,
        )
        val_loader = DataLoader(val_set, batch_size=64, sampler=val_sampler)

        torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts them)
        model = DistributedDataParallel(torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

        for epoch in range(args.epochs):
            train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
            model.train()
            for x, y in train_loader:
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()  # DDP averages the gradients across ranks here
                optimizer.step()

            # Each rank scores its own, non-overlapping share; the sums give the exact mean.
            model.eval()
            totals = torch.zeros(2, dtype=torch.float64)
            with torch.no_grad():
                for x, y in val_loader:
                    error = torch.nn.functional.mse_loss(model.module(x), y, reduction="sum")
                    totals += torch.tensor([error.item(), len(y)], dtype=torch.float64)
            dist.all_reduce(totals)
            _wait_for_gloo_release(totals)
            if rank == 0:
                print(
                    f"epoch {epoch}: validation mse {totals[0] / totals[1]:.5f} over "
                    f"{int(totals[1])} samples, {len(train_loader)} steps per rank, "
                    f"{world} ranks",
                    flush=True,
                )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
