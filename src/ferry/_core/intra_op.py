"""torch's intra-op thread count for one thread, the others' left as they were.

A process worker runs torch's parallel operations (a large ``torch.stack``, a copy of more than
32,768 elements) on one thread: it calls ``torch.set_num_threads(1)``, as torch's workers do, and
the process is its own. ferry's threads inside the user's process (thread workers, the pin
thread, the read pool) need the same, or each of them starts an OpenMP team of its own as wide as
the machine: 15 thread workers on 16 CPUs would keep 15 x 16 threads busy for copies that one
thread does at memory speed. On 2 CPUs, 2 thread workers stacking uint8 images ran 1.1-1.9x
faster with one intra-op thread each (see ``docs/design/scaling.md``).

``torch.set_num_threads`` cannot do it alone: besides the calling thread's OpenMP count, it sets
the process's default, which every thread that has not run a parallel operation yet takes when it
first does, the user's main thread included (a training step would then run on one thread).
:func:`one_intra_op_thread` sets the calling thread's count and puts the default back from a
short-lived helper thread, whose own count is lost with it; :func:`settle` gives the calling
thread its count first, so that a loader's main thread is never caught in between.
"""

from __future__ import annotations

import os
import threading

import torch

__all__ = ["one_intra_op_thread", "settle"]


class _Guard:
    """Serializes the set-and-put-back of :func:`one_intra_op_thread` between threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def renew(self) -> None:
        self.lock = threading.Lock()  # a fork child's copy may be held by a thread it lacks


_guard = _Guard()
os.register_at_fork(after_in_child=_guard.renew)


def _openmp() -> bool:
    """Whether torch's intra-op pool is OpenMP's, whose thread count is each thread's own (the
    native pool's is the process's: setting it from one thread would change everyone's)."""
    try:
        return "parallel backend: OpenMP" in torch.__config__.parallel_info()
    except Exception:  # (an unusual build: leave torch's setting alone)
        return False


_PER_THREAD = _openmp()


def settle() -> None:
    """Gives the calling thread its intra-op thread count now (the process's default), as its
    first parallel operation would; called before starting threads that change the default for
    a moment."""
    torch.get_num_threads()


def one_intra_op_thread() -> None:
    """Makes torch's parallel operations started from the calling thread run on it alone; the
    count of every other thread, and the default new threads take, stay what they were."""
    if not _PER_THREAD:
        return
    before = torch.get_num_threads()  # (this thread takes the default now, if it had none)
    if before == 1:
        return
    with _guard.lock:
        torch.set_num_threads(1)
        helper = threading.Thread(
            target=torch.set_num_threads, args=(before,), name="ferry-intra-op", daemon=True
        )
        helper.start()
        helper.join()
