"""pin_memory=True on a real GPU: ferry against torch.utils.data, same program.

Checks that every batch comes out pinned and equal to torch's, then measures the host-to-device
hand-off: a loop that moves each batch to the GPU with ``non_blocking=True`` (what a training
loop does), in batches per second, median of ``--reps`` runs, torch and ferry alternating.

    python examples/gpu_handoff.py            # needs a CUDA device
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.utils.data as tud

import ferry


class Images(tud.Dataset[tuple[torch.Tensor, int]]):
    """uint8 images made on the fly, as a decoded-image dataset hands them out."""

    def __init__(self, n: int) -> None:
        self.n = n
        generator = torch.Generator().manual_seed(3)
        self.base = torch.randint(0, 255, (3, 224, 224), dtype=torch.uint8, generator=generator)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.base.roll(index, dims=2), index % 10


def _loaders(module: Any, workload: str, workers: int, worker_type: str, pin: bool) -> Any:
    extra = {"worker_type": worker_type} if module is ferry and workers else {}
    if workload == "tensor":
        x = torch.randn(65_536, 256, generator=torch.Generator().manual_seed(0))
        y = torch.randint(0, 10, (65_536,), generator=torch.Generator().manual_seed(1))
        dataset: Any = module.TensorDataset(x, y)
        batch = 1024
    else:
        dataset = Images(1024)
        batch = 64
    return module.DataLoader(
        dataset,
        batch_size=batch,
        shuffle=True,
        generator=torch.Generator().manual_seed(2),
        num_workers=workers,
        pin_memory=pin,
        persistent_workers=workers > 0,
        **extra,
    )


def _run(loader: Any, device: torch.device) -> tuple[float, bool]:
    pinned = True
    start = time.perf_counter()
    count = 0
    for xb, yb in loader:
        pinned = pinned and xb.is_pinned() and yb.is_pinned()
        xb.to(device, non_blocking=True)
        yb.to(device, non_blocking=True)
        count += 1
    torch.cuda.synchronize(device)
    return count / (time.perf_counter() - start), pinned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    device = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}")
    print("| workload | workers | pin | torch b/s | ferry b/s | ferry/torch | pinned | equal |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for workload in ("tensor", "image"):
        for workers, worker_type in ((0, "process"), (2, "process"), (2, "thread")):
            for pin in (False, True):
                torch_loader = _loaders(tud, workload, workers, worker_type, pin)
                ferry_loader = _loaders(ferry, workload, workers, worker_type, pin)
                equal = all(
                    torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                    for a, b in zip(torch_loader, ferry_loader, strict=True)
                )
                speeds: dict[str, list[float]] = {"torch": [], "ferry": []}
                pinned = {"torch": True, "ferry": True}
                _run(torch_loader, device)  # warm-up: workers, pinned pools, CUDA context
                _run(ferry_loader, device)
                for _ in range(args.reps):
                    for name, loader in (("torch", torch_loader), ("ferry", ferry_loader)):
                        rate, ok = _run(loader, device)
                        speeds[name].append(rate)
                        pinned[name] = pinned[name] and ok
                t, f = statistics.median(speeds["torch"]), statistics.median(speeds["ferry"])
                kind = f"{workers} {worker_type}" if workers else "0"
                is_pinned = f"{pinned['torch']}/{pinned['ferry']}" if pin else "-"
                print(
                    f"| {workload} | {kind} | {pin} | {t:,.0f} | {f:,.0f} | {f / t:.2f}x "
                    f"| {is_pinned} | {equal} |",
                    flush=True,
                )
                if pin and not pinned["ferry"]:
                    raise SystemExit("ferry returned an unpinned batch with pin_memory=True")
                if not equal:
                    raise SystemExit("ferry's batches differ from torch's")


if __name__ == "__main__":
    main()
