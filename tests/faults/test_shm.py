"""Running out of shared memory gives an OSError that says what to do, not a crash."""

from __future__ import annotations

import os

import pytest

from _support.processes import open_fds
from ferry._engine.transport import shm

GUIDANCE = ("shared memory", "batch_size", "num_workers", "prefetch_factor", "worker_type='thread'")


@pytest.mark.timeout(10)
def test_out_of_shared_memory_wording() -> None:
    error = shm._out_of_shared_memory(123456789)
    assert isinstance(error, OSError)
    message = str(error)
    assert "123456789 bytes" in message, message
    for words in GUIDANCE:
        assert words in message, (words, message)


@pytest.mark.timeout(10)
@pytest.mark.skipif(not shm.SLABS_SUPPORTED, reason="no memfd_create on this platform")
@pytest.mark.parametrize("size", [1 << 60, 1 << 50], ids=["2**60", "2**50"])
def test_absurd_slab_fails_with_guidance(size: int) -> None:
    fds = open_fds()
    with pytest.raises(OSError, match=f"{size} bytes") as caught:
        shm.Slab(0, size, os.getpid(), named=False)
    for words in GUIDANCE:
        assert words in str(caught.value), (words, str(caught.value))
    assert isinstance(caught.value.__cause__, OSError)
    assert open_fds() == fds, "the memory file of the failed slab was not closed"


@pytest.mark.timeout(10)
@pytest.mark.skipif(not shm.SLABS_SUPPORTED, reason="no memfd_create on this platform")
def test_worker_allocator_reports_the_same_error() -> None:
    """A batch tensor too large for memory, asked of a worker's allocator, raises the same
    OSError (which then travels to the training loop like any error in collate)."""
    allocator = shm.SlabAllocator(os.getpid())
    allocator.begin(())
    with pytest.raises(OSError, match="batch_size"):
        allocator.empty((1 << 40, 1 << 10), shm.torch.float32)
    allocator.abandon()
    allocator.close()


@pytest.mark.timeout(10)
@pytest.mark.skipif(not shm.SLABS_SUPPORTED, reason="no memfd_create on this platform")
def test_a_slab_announced_without_its_descriptor_yet_does_not_block() -> None:
    """A worker stopped (SIGSTOP) between a slab's announcement, its descriptor and its batch:
    the main side reads only what is there and comes back for the rest, so the loop (and its
    ``timeout``) is never stuck inside a read."""
    import multiprocessing
    import pickle

    from ferry._engine.crew.channels import ProcessChannel
    from ferry._engine.crew.group import ProcessHandle
    from ferry._engine.transport.messages import Done, NewSlab
    from ferry._engine.transport.slabfile import send_fd

    ours, theirs = multiprocessing.Pipe(duplex=True)
    worker = ProcessHandle(0, multiprocessing.Process(), ours)  # (not started: its pipe is read)
    read = ProcessChannel._read
    fd = os.memfd_create("ferry-test")
    try:
        os.ftruncate(fd, 4096)
        theirs.send_bytes(pickle.dumps(NewSlab(7, 4096)))
        assert read(None, worker) is None  # type: ignore[arg-type]
        assert worker.slabs.awaiting == NewSlab(7, 4096)
        assert not ours.poll(0)
        send_fd(theirs, fd)
        assert read(None, worker) is None  # type: ignore[arg-type]
        assert worker.slabs.awaiting is None
        theirs.send_bytes(pickle.dumps(Done(0, b"payload", (7,))))
        assert read(None, worker) == Done(0, b"payload", (7,))
        # All three at once: one read takes them all.
        theirs.send_bytes(pickle.dumps(NewSlab(8, 4096)))
        send_fd(theirs, fd)
        theirs.send_bytes(pickle.dumps(Done(1, b"next", (8,))))
        assert read(None, worker) == Done(1, b"next", (8,))
    finally:
        os.close(fd)
        ours.close()
        theirs.close()
        worker.slabs.close()
