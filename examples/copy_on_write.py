"""Copy-on-write growth, as ``loader.stats()`` reports it.

A map-style dataset keeps 800,000 Python strings in a list; two forked process workers read
them in a shuffled epoch, and each copies the pages the strings sit on. ``--shared`` keeps them
in ``ferry.SharedList`` instead, ``--threads`` uses thread workers: neither copies.

    .venv/bin/python examples/copy_on_write.py
    .venv/bin/python examples/copy_on_write.py --shared
"""

from __future__ import annotations

import argparse
from typing import Any

import torch.utils.data as tud

import ferry


class Paths(tud.Dataset[int]):
    def __init__(self, n: int, shared: bool) -> None:
        items = [f"sample-{i:012d}-{'x' * (150 + i % 7)}" for i in range(n)]
        self.items: Any = ferry.SharedList(items) if shared else items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> int:
        return len(self.items[index])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=800_000)
    parser.add_argument("--shared", action="store_true", help="keep the items in a SharedList")
    parser.add_argument("--threads", action="store_true", help="thread workers")
    args = parser.parse_args()
    loader = ferry.DataLoader(
        Paths(args.items, args.shared),
        batch_size=256,
        shuffle=True,
        num_workers=2,
        worker_type="thread" if args.threads else "process",
        multiprocessing_context=None if args.threads else "fork",
    )
    for _ in loader:
        pass
    print(loader.stats())


if __name__ == "__main__":
    main()
