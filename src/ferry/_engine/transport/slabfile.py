"""The files behind shared-memory slabs, and their descriptors.

A slab's descriptor is held only while the slab travels: it is mapped with :func:`map_file`,
which keeps no descriptor (Python's ``mmap`` keeps a duplicate of it for the mapping's life),
and closed once the main process has it. Batches the user keeps therefore cost memory, never
descriptors, in either process, and a low ``ulimit -n`` is not reached by holding batches.

How a slab travels depends on torch's sharing strategy
(``torch.multiprocessing.set_sharing_strategy``), read in the main process when workers start:

* ``"file_descriptor"`` (the default): an anonymous file (``memfd_create``), its descriptor sent
  over the worker's connection (``SCM_RIGHTS``). No name, so nothing can ever be left in
  ``/dev/shm``.
* ``"file_system"``: a named file in ``/dev/shm``, found by name: no descriptor is ever passed.
  The main process removes the name as soon as it has mapped the file; a worker removes the names
  of its slabs when it exits (also when the main process was killed, which it notices within a
  quarter of a second), and the main process removes whatever a dead worker left.

Running out of descriptors (``EMFILE``/``ENFILE``) raises :class:`DescriptorLimitReached`, a
RuntimeError saying so and what to do; a worker reports it as the failure of that batch and
lives on.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import glob
import mmap
import os
import resource
import secrets
import socket
import weakref
from multiprocessing.connection import Connection
from typing import Any

import torch

__all__ = [
    "SHM_DIR",
    "DescriptorLimitReached",
    "create_file",
    "descriptor_limit",
    "is_descriptor_limit",
    "map_file",
    "named_slabs",
    "open_named",
    "recv_fd",
    "remove_names",
    "reserve",
    "send_fd",
    "shm_space",
]

SHM_DIR = "/dev/shm"
_PREFIX = "ferry-"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class DescriptorLimitReached(RuntimeError):
    """A process ran out of file descriptors while a slab was being made or received."""


def named_slabs() -> bool:
    """Whether slabs travel by name: torch's sharing strategy is ``file_system``."""
    strategy = torch.multiprocessing.get_sharing_strategy()  # type: ignore[no-untyped-call]
    return bool(strategy == "file_system" and os.path.isdir(SHM_DIR))


def map_file(fd: int, size: int) -> Any:
    """A writable buffer over ``size`` bytes of the shared file ``fd``, holding no descriptor.

    The memory is unmapped when the buffer and every view of it (memoryviews, tensors made by
    ``torch.frombuffer``) are gone.
    """
    address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        code = ctypes.get_errno()
        raise OSError(code, f"mmap of {size} bytes failed: {os.strerror(code)}")
    buffer = (ctypes.c_ubyte * size).from_address(address)
    weakref.finalize(buffer, _libc.munmap, address, size)
    return buffer


def _limit_text() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    shown = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
    try:
        return f"{len(os.listdir('/proc/self/fd'))} open, limit {shown}"
    except OSError:
        return f"limit {shown}"


def is_descriptor_limit(exc: BaseException) -> bool:
    """Whether ``exc`` says the process (or the system) is out of file descriptors."""
    return isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE)


def descriptor_limit(who: str, doing: str, slabs: str) -> DescriptorLimitReached:
    """The error for running out of descriptors; ``slabs`` is a sentence on the slabs held."""
    return DescriptorLimitReached(
        f"Too many open files: {who} reached its limit of open file descriptors "
        f"(RLIMIT_NOFILE; {_limit_text()}) while {doing}. {slabs} ferry keeps no descriptor "
        "for a slab once it is shared, so batches you hold cost memory, not descriptors: the "
        "descriptors in use are held by other code, most often files a dataset opens and "
        "keeps. Raise the limit (`ulimit -n`, or resource.setrlimit(resource.RLIMIT_NOFILE, "
        "...)), close files the dataset no longer needs, or drop references to old batches; "
        "torch.multiprocessing.set_sharing_strategy('file_system') makes ferry pass slabs by "
        "name, so the main process needs no descriptor to receive one."
    )


def create_file(owner_pid: int, slab_id: int, size: int, named: bool) -> tuple[int, str | None]:
    """A new shared file of ``size`` bytes: its descriptor, and its name if ``named``.

    Raises OSError from the system (the caller turns running out of descriptors into
    :class:`DescriptorLimitReached`, naming its slabs).
    """
    if named:
        name = os.path.join(
            SHM_DIR,
            f"{_PREFIX}{owner_pid}-{os.getpid()}-{slab_id}-{secrets.token_hex(4)}",
        )
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        return os.open(name, flags, 0o600), name
    return os.memfd_create(f"ferry-slab-{slab_id}", os.MFD_CLOEXEC), None


def reserve(fd: int, size: int, named: bool) -> None:
    """Give a new slab file its ``size`` and commit its memory now, so that running out is an
    OSError here (``ENOSPC`` when ``/dev/shm`` is full, for a ``named`` file) and never a
    SIGBUS when collate writes a page the system cannot give.

    Called through the module, so a test can stand in a full ``/dev/shm`` for named files.
    """
    os.ftruncate(fd, size)
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)


def shm_space() -> tuple[int, int]:
    """Size and free bytes of the file system at :data:`SHM_DIR` (0, 0 if unknown)."""
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return 0, 0
    return stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize


def open_named(name: str, size: int) -> Any:
    """Map a slab that travelled by name, and remove the name (the mapping keeps the file)."""
    fd = os.open(name, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    try:
        return map_file(fd, size)
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def remove_names(owner_pid: int, worker_pid: int | None = None) -> None:
    """Remove the names of slab files made for main process ``owner_pid`` (by one worker, or
    by all), e.g. those of a worker that died before the main process could map them."""
    worker = "*" if worker_pid is None else str(worker_pid)
    for name in glob.glob(os.path.join(SHM_DIR, f"{_PREFIX}{owner_pid}-{worker}-*")):
        with contextlib.suppress(OSError):
            os.unlink(name)


def _socket(conn: Connection) -> socket.socket:
    # A socket object over the connection's own descriptor: no duplicate (multiprocessing's
    # send_handle/recv_handle duplicate it, which fails exactly when descriptors ran out).
    return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=conn.fileno())


def send_fd(conn: Connection, fd: int) -> None:
    """Send descriptor ``fd`` over ``conn`` (a socket pair end), between two framed messages."""
    sock = _socket(conn)
    try:
        sock.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    finally:
        sock.detach()


def recv_fd(conn: Connection) -> int:
    """Receive one descriptor sent by :func:`send_fd`."""
    sock = _socket(conn)
    try:
        message, ancillary, flags, _ = sock.recvmsg(1, socket.CMSG_SPACE(array.array("i").itemsize))
    finally:
        sock.detach()
    if not message:
        raise EOFError("the worker's connection closed")
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if flags & socket.MSG_CTRUNC or not fds:
        for fd in fds:
            os.close(fd)
        # The kernel drops a descriptor the receiver has no room for.
        raise OSError(errno.EMFILE, "a shared-memory slab's descriptor was dropped on arrival")
    for extra in fds[1:]:
        os.close(extra)
    return fds[0]
