"""Starting and stopping the rank processes of multi-process tests (distributed, ecosystem)."""

from __future__ import annotations

import socket
import subprocess


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
