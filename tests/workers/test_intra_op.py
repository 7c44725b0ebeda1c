"""ferry's threads in the user's process run torch's parallel operations on one thread, as a
process worker does, and leave the user's threads' count alone.

Thread workers, the read pool and the pin thread each call ``one_intra_op_thread``. Without it
each of them started an OpenMP team as wide as the machine for a large ``torch.stack`` (15 thread
workers on 16 CPUs: 15 teams of 16). ``torch.set_num_threads(1)`` alone would also set the
process's default, which a thread takes at its first parallel operation: the user's main thread,
if the loader ran first, would then train on one thread. The programs run in a fresh process
whose default is 3 on any machine, set by a passing thread before the main thread has a count.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch

import ferry
import ferry._engine.transport.pin as pin_module
import ferry.loader

pytestmark = pytest.mark.timeout(90)

# The process's default set to 3 from a passing thread: the main thread is not set yet.
_DEFAULT_3 = """
import json, threading, time, torch
helper = threading.Thread(target=torch.set_num_threads, args=(3,))
helper.start()
helper.join()
"""

_COUNTS = (
    _DEFAULT_3
    + """
%s

def count_in_new_thread(before=None):
    seen = []
    def run():
        if before:
            before()
        seen.append(torch.get_num_threads())
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen[0]

print(json.dumps({
    "%s": count_in_new_thread(%s),
    "main": torch.get_num_threads(),
    "new": count_in_new_thread(),
}))
"""
)

_LOADER = (
    _DEFAULT_3
    + """
import ferry

class Counts(ferry.Dataset):
    def __len__(self):
        return 48

    def __getitem__(self, index):
        time.sleep(0.003)  # a read that waits: a batch's reads go to the read pool
        return threading.current_thread().name, torch.get_num_threads()

seen = {}
for workers, kind in ((0, "process"), (2, "thread")):
    loader = ferry.DataLoader(
        Counts(), batch_size=8, num_workers=workers, worker_type=kind, collate_fn=list
    )
    for batch in loader:
        for name, count in batch:
            seen.setdefault(f"{workers}:{name.rstrip('0123456789')}", set()).add(count)
print(json.dumps({
    "seen": {k: sorted(v) for k, v in seen.items()},
    "main": torch.get_num_threads(),
}))
"""
)


def _run(code: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_torchs_own_setting_from_a_thread_changes_the_main_threads() -> None:
    """The premise: ``torch.set_num_threads(1)`` on another thread leaves a main thread that
    has not run a parallel operation yet, and every later thread, with one thread."""
    got = _run(_COUNTS % ("", "thread", "lambda: torch.set_num_threads(1)"))
    assert got == {"thread": 1, "main": 1, "new": 1}


def test_one_intra_op_thread_sets_the_calling_thread_only() -> None:
    imports = "from ferry._core.intra_op import one_intra_op_thread"
    got = _run(_COUNTS % (imports, "thread", "one_intra_op_thread"))
    assert got == {"thread": 1, "main": 3, "new": 3}


def test_thread_workers_and_the_read_pool_run_on_one_intra_op_thread() -> None:
    got = _run(_LOADER)
    seen = got["seen"]
    # num_workers=0: the caller's thread reads, with its own count
    assert seen["0:MainThread"] == [3]
    # thread workers, and the reads they hand to the pool
    assert seen["2:ferry-worker-"] == [1]
    assert seen["2:ferry-read-"] == [1]
    assert got["main"] == 3


def test_the_pin_thread_runs_on_one_intra_op_thread_and_leaves_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counts: list[tuple[str, int]] = []

    def pin_tensor(tensor: torch.Tensor, device: str) -> torch.Tensor:
        counts.append((threading.current_thread().name, torch.get_num_threads()))
        return tensor.clone()

    monkeypatch.setattr(ferry.loader, "accelerator_available", lambda: True)
    monkeypatch.setattr(pin_module, "_pin_tensor", pin_tensor)
    default = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        loader = ferry.DataLoader(
            ferry.TensorDataset(torch.arange(32)), batch_size=8, num_workers=2, pin_memory=True
        )
        assert len(list(loader)) == 4
        later: list[int] = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(default)
    assert {name for name, _ in counts} == {"ferry-pin"}
    assert {count for _, count in counts} == {1}
    assert later == [3]  # (torch's own setting there made it 1 for every later thread)
