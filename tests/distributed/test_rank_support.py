"""The rank starter of the multi-process tests (``_support/ranks.py``) survives a port taken
between its choice and rank 0's listening (pytest-xdist runs two test files at once)."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from _support import ranks

# A stand-in for a rank: rank 0 listens on the port, as a process group's store does; each
# rank writes its number where run_ranks looks for results.
RANK = """
import pickle, socket, sys
rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if rank == 0:
    server = socket.socket()
    server.bind(("127.0.0.1", port))
    server.listen()
with open(f"{out}/rank{rank}.pkl", "wb") as f:
    pickle.dump((rank, port), f)
"""


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


def test_ranks_start_again_on_another_port_when_theirs_was_taken(
    tmp_path: Path, taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    chosen = iter([taken_port])
    real = ranks.free_port
    monkeypatch.setattr(ranks, "free_port", lambda: next(chosen, None) or real())

    got = ranks.run_ranks(
        lambda rank, port: [sys.executable, "-c", RANK, str(rank), str(port), str(tmp_path)],
        2,
        tmp_path,
        30.0,
        "stand-in ranks",
    )

    assert [rank for rank, _ in got] == [0, 1]
    ports = {port for _, port in got}
    assert len(ports) == 1
    assert ports != {taken_port}


def test_a_rank_that_fails_for_another_reason_fails_the_test(tmp_path: Path) -> None:
    with pytest.raises(pytest.fail.Exception, match="a rank failed"):
        ranks.run_ranks(
            lambda rank, port: [sys.executable, "-c", "raise SystemExit(3)"],
            2,
            tmp_path,
            30.0,
            "failing ranks",
        )
