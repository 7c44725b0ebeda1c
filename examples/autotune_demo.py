"""num_workers="auto": what the tuner chose after each epoch, and why.

A light dataset (0.2 ms a sample) and a training step of 10 ms: the workers idle, so after the
first epoch the tuner tries one worker fewer.

    .venv/bin/python examples/autotune_demo.py
"""

from __future__ import annotations

import time

import torch

import ferry


class Light(ferry.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 400

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.0002)
        return torch.full((64,), index)


def main() -> None:
    loader = ferry.DataLoader(Light(), batch_size=8, num_workers="auto")
    for epoch in range(3):
        for _batch in loader:
            time.sleep(0.01)  # the training step
        print(f"after epoch {epoch}: autotuning: {loader.stats().tuning}")


if __name__ == "__main__":
    main()
