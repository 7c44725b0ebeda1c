"""Print ``loader.stats()`` for each engine on a dataset whose ``__getitem__`` sleeps 1 ms.

.venv/bin/python examples/stats_demo.py
"""

from __future__ import annotations

import time

import torch

import ferry


class SlowDataset(ferry.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 400

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.001)  # reading and decoding a sample
        return torch.full((1024,), index)


def main() -> None:
    for options in (
        {"num_workers": 0},
        {"num_workers": 2},
        {"num_workers": 2, "worker_type": "thread"},
    ):
        loader = ferry.DataLoader(SlowDataset(), batch_size=8, **options)
        for _batch in loader:
            time.sleep(0.002)  # the training step
        print(loader.stats(), end="\n\n")


if __name__ == "__main__":
    main()
