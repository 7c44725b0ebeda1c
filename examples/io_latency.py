"""Samples that wait: how fast ferry loads them, epoch by epoch (the I/O-latency workload).

Each sample waits ``--latency`` seconds (``time.sleep``, which releases the GIL, standing for a
network read), then builds a 64 KiB float32 array; batch 32, 1,024 samples; every index is
checked to arrive exactly once per epoch.

    .venv/bin/python examples/io_latency.py --latency 0.01 --workers auto
    .venv/bin/python examples/io_latency.py --latency 0.05 --workers 2 --worker-type thread
    .venv/bin/python examples/io_latency.py --latency 0.01 --workers 2 --torch
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

import ferry


class Waiting(tud.Dataset[torch.Tensor]):
    def __init__(self, latency: float, n: int = 1024) -> None:
        self.latency, self.n = latency, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.latency)
        return torch.from_numpy(np.full(16384, index, dtype=np.float32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency", type=float, default=0.01, help="seconds per sample")
    parser.add_argument("--workers", default="auto", help='an int, or "auto" (ferry)')
    parser.add_argument("--worker-type", default="process", choices=["process", "thread"])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--torch", action="store_true", help="torch.utils.data's loader instead")
    args = parser.parse_args()
    workers: Any = args.workers if args.workers == "auto" else int(args.workers)
    data = Waiting(args.latency)
    if args.torch:
        loader: Any = tud.DataLoader(data, batch_size=32, num_workers=workers)
    else:
        loader = ferry.DataLoader(
            data, batch_size=32, num_workers=workers, worker_type=args.worker_type
        )
    for epoch in range(args.epochs):
        start, first, seen = time.perf_counter(), None, []
        for batch in loader:
            if first is None:
                first = time.perf_counter() - start
            seen += batch[:, 0].long().tolist()
        took = time.perf_counter() - start
        assert sorted(seen) == list(range(len(data))), "an index was lost or repeated"
        engine = "torch" if args.torch else loader.stats().engine
        print(
            f"epoch {epoch}: {len(data) / took:,.0f} samples/s, first batch "
            f"{1000 * (first or 0):.0f} ms ({engine} workers)"
        )
    if not args.torch and loader.stats().tuning:
        print("autotuning:", loader.stats().tuning)


if __name__ == "__main__":
    main()
