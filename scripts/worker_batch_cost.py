"""What a process worker spends on a batch beyond ``__getitem__``: collate, hand-off, engine.

The dataset returns at once a view of one 224x224x3 uint8 image: HWC seen as CHW
(``permute(2, 0, 1)``, what torchvision's ``pil_to_tensor`` returns), ``--layout contiguous``
the same image made contiguous, or ``--layout channels-last`` as a 4-d channels-last tensor.
So the worker's CPU time per batch (``/proc/PID/stat``, one persistent worker, batch 128, 100
batches an epoch, after a warm-up epoch) is what the loader adds to the dataset's work: the
stack of 128 images (about 10 ms on the 2-core dev machine, the floor) and the rest.
Each source tree runs in its own interpreter, the trees alternating round by round; the
median epoch of each round and the median over rounds are printed.

    git archive <commit> src | tar -x -C /tmp/base
    .venv/bin/python scripts/worker_batch_cost.py /tmp/base/src src --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

_RUN = """
import os, statistics, sys, time, torch
import ferry
layout = sys.argv[1]
torch.set_num_threads(1)
image = torch.randint(0, 255, (224, 224, 3), dtype=torch.uint8)
if layout == "contiguous":
    sample = image.permute(2, 0, 1).contiguous()
elif layout == "channels-last":
    sample = image.permute(2, 0, 1).unsqueeze(0).contiguous(memory_format=torch.channels_last)
else:
    sample = image.permute(2, 0, 1)
class Images:
    def __len__(self):
        return 128 * 100
    def __getitem__(self, index):
        return sample
def cpu_of(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
loader = ferry.DataLoader(Images(), batch_size=128, num_workers=1, persistent_workers=True,
                          shuffle=True)
first = iter(loader)
for _ in first:
    pass
(worker,) = first._workers  # (torch's name; a persistent loader keeps its workers)
per_batch = []
for _ in range(3):
    before = cpu_of(worker.pid)
    for _ in loader:
        pass
    per_batch.append((cpu_of(worker.pid) - before) / 100 * 1e3)
print(statistics.median(per_batch))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", help="src folders to compare, in turn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--layout", choices=("permuted", "contiguous", "channels-last"), default="permuted"
    )
    args = parser.parse_args()
    results: dict[str, list[float]] = {tree: [] for tree in args.trees}
    for round_ in range(args.rounds):
        order = args.trees if round_ % 2 == 0 else args.trees[::-1]
        for tree in order:
            done = subprocess.run(
                [sys.executable, "-c", _RUN, args.layout],
                env={"PYTHONPATH": tree, "PATH": "/usr/bin:/bin"},
                capture_output=True,
                text=True,
                timeout=300,
                check=True,
            )
            results[tree].append(float(done.stdout.split()[-1]))
    for tree, values in results.items():
        rounds = ", ".join(f"{v:.1f}" for v in values)
        print(f"{tree}: worker CPU ms a batch {statistics.median(values):.1f} (rounds: {rounds})")


if __name__ == "__main__":
    main()
