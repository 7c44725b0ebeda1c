"""A dataset with corrupt samples and a worker that gets killed: the loader carries on.

Run it::

    python examples/bad_data.py

``on_error="skip"`` drops the samples whose ``__getitem__`` raises (each one is logged), within
the ``max_errors`` budget; ``max_worker_restarts`` replaces a worker process that dies, and
the epoch's batches are those an undisturbed run makes.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile

import torch

from ferry import DataLoader, Dataset


class Images(Dataset[torch.Tensor]):
    """Every 50th sample is "corrupt"; the worker holding sample 123 is killed, once."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __len__(self) -> int:
        return 400

    def __getitem__(self, index: int) -> torch.Tensor:
        if index % 50 == 7:
            raise OSError(f"cannot decode image {index}: truncated file")
        if index == 123 and not os.path.exists(self.marker):
            open(self.marker, "w").close()  # a marker: the replacement lives on
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.full((3,), float(index))


def main() -> None:
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        loader = DataLoader(
            Images(os.path.join(tmp, "killed")),
            batch_size=32,
            num_workers=2,
            on_error="skip",
            max_errors=0.05,  # at most 5% of the samples seen
            max_worker_restarts=1,
        )
        sizes = [len(batch) for batch in loader]
    print(f"{len(sizes)} batches, sizes {sizes}")
    print(f"skipped {loader.stats().skipped} samples")


if __name__ == "__main__":
    main()
