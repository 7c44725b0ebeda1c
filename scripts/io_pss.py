"""Peak memory (PSS of the process tree) of one run of ``examples/io_latency.py``.

PSS counts a page shared by k processes as 1/k in each, so the sum over the main process and
its workers is the memory the run uses. Sampled every 20 ms with psutil; the arguments after
``--`` go to the example:

    .venv/bin/python scripts/io_pss.py -- --latency 0.01 --workers auto --epochs 2
    .venv/bin/python scripts/io_pss.py -- --latency 0.01 --workers 0 --epochs 2

Linux only (``/proc/<pid>/smaps_rollup``).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import psutil

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "io_latency.py"


def tree_pss(root: psutil.Process) -> int:
    total = 0
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += process.memory_full_info().pss
    return total


def main() -> None:
    args = sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else []
    child = subprocess.Popen([sys.executable, str(EXAMPLE), *args], stdout=subprocess.PIPE)
    root, peak = psutil.Process(child.pid), 0
    while child.poll() is None:
        try:
            peak = max(peak, tree_pss(root))
        except psutil.NoSuchProcess:
            break
        time.sleep(0.02)
    assert child.stdout is not None
    sys.stdout.write(child.stdout.read().decode())
    print(f"peak PSS of the process tree: {peak / 2**20:,.0f} MiB")


if __name__ == "__main__":
    main()
