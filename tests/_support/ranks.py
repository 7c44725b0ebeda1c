"""Starting and stopping the rank processes of multi-process tests (distributed, ecosystem)."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

PYTHON = sys.executable


def free_port() -> int:
    """A TCP port free on the loopback address, for a process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """Terminate, then kill, whatever is still running; reap everything."""
    for p in processes:
        if p.poll() is None:
            p.terminate()
    for p in processes:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


def env_rank(rank: int, world: int, port: int) -> dict[str, str]:
    """The environment torchrun gives a rank (one node, loopback rendezvous), one thread each."""
    return {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "NODE_RANK": "0",
        "OMP_NUM_THREADS": "1",  # the ranks share a few cores
    }


def run_ranks(
    command: Callable[[int, int], list[str]],
    world: int,
    out_dir: Path,
    deadline_s: float,
    what: str,
) -> list[Any]:
    """Starts ``world`` processes (``command(rank, port)``, environment :func:`env_rank`), waits
    for all of them, and returns what each pickled to ``out_dir/rank{N}.pkl``.

    Every process is reaped whatever happens; a rank that fails, runs past ``deadline_s`` or
    writes no result fails the test with every rank's log (``out_dir/rank{N}.log``). The port is
    free when chosen, but another process (pytest-xdist runs two test files at once) may take it
    before rank 0 listens on it: the ranks are started once more, on another port, when a log
    says so.
    """
    results = [out_dir / f"rank{rank}.pkl" for rank in range(world)]
    for attempt in range(2):
        codes, timed_out = _start_and_wait(command, world, out_dir, deadline_s)
        if not timed_out and not any(codes) and all(r.exists() for r in results):
            loaded = []
            for path in results:
                with path.open("rb") as f:
                    loaded.append(pickle.load(f))
            return loaded
        texts = [(out_dir / f"rank{rank}.log").read_text(errors="replace") for rank in range(world)]
        if not attempt and not timed_out and any(w in t for t in texts for w in _PORT_TAKEN):
            for path in results:
                path.unlink(missing_ok=True)
            continue
        why = f"ran past {deadline_s} s" if timed_out else "failed"
        output = "\n".join(
            f"--- rank {rank} (exit {code}) ---\n" + text[-6000:]
            for rank, (code, text) in enumerate(zip(codes, texts, strict=True))
        )
        pytest.fail(f"{what}: a rank {why}:\n{output}")
    raise AssertionError("unreachable")


_PORT_TAKEN = ("Address already in use", "EADDRINUSE")


def _start_and_wait(
    command: Callable[[int, int], list[str]], world: int, out_dir: Path, deadline_s: float
) -> tuple[list[int | None], bool]:
    """The ranks started on a free port and waited for: their exit codes, and whether the
    deadline passed (every process is reaped either way)."""
    port = free_port()
    logs = [(out_dir / f"rank{rank}.log").open("wb") for rank in range(world)]
    processes: list[subprocess.Popen[bytes]] = []
    timed_out = False
    try:
        for rank in range(world):
            processes.append(
                subprocess.Popen(
                    command(rank, port),
                    stdout=logs[rank],
                    stderr=subprocess.STDOUT,
                    env=env_rank(rank, world, port),
                )
            )
        deadline = time.monotonic() + deadline_s
        for p in processes:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        stop(processes)
        for log in logs:
            log.close()
    return [p.returncode for p in processes], timed_out
