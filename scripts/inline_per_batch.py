"""Per-batch time of the inline engine (num_workers=0) on the cheapest workload: min and median
over 14 epochs. Run it with PYTHONPATH pointing at two source trees, in turn, to compare them
by their best case, which this noisy machine disturbs less than the median.

    PYTHONPATH=/tmp/base/src .venv/bin/python scripts/inline_per_batch.py
    PYTHONPATH=src .venv/bin/python scripts/inline_per_batch.py
"""

import statistics
import time

import torch

import ferry

ds = ferry.TensorDataset(torch.randn(256 * 2000, 32), torch.randint(0, 10, (256 * 2000,)))
r = []
for _epoch in range(14):
    loader = ferry.DataLoader(
        ds, batch_size=256, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    it = iter(loader)
    next(it)
    t = time.perf_counter()
    n = 0
    for _ in it:
        n += 1
    r.append((time.perf_counter() - t) / n * 1e6)
print(f"min {min(r):.1f} med {statistics.median(r[2:]):.1f}")
