"""A small or full /dev/shm does not stop training under the ``file_system`` sharing strategy.

A worker whose named slab finds no room in /dev/shm makes it (and its later slabs) anonymous,
passed by descriptor as under the default strategy; the main process warns once
(:class:`ferry.errors.SharedMemoryWarning`, naming /dev/shm's size and the fix) and takes named
and anonymous slabs from the same worker. When anonymous memory fails too, the error says so.

Two ways to fill /dev/shm: a stand-in (``slabfile.reserve``, replaced before the workers fork,
fails named files with ENOSPC), which always runs; and a real 64 MB tmpfs on /dev/shm in a
private mount namespace (``unshare -m``, as root), skipped where that is not permitted.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import ferry
from _support import datasets as ds
from _support.processes import shared_mapping_of
from ferry._engine.transport import shm, slabfile
from ferry.errors import SharedMemoryWarning

pytestmark = [
    pytest.mark.skipif(not shm.SLABS_SUPPORTED, reason="no memfd_create on this platform"),
    pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm"),
]

FORK = {"multiprocessing_context": "fork"}
TESTS = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def file_system() -> Iterator[None]:
    before = torch.multiprocessing.get_sharing_strategy()  # type: ignore[no-untyped-call]
    torch.multiprocessing.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(before)  # type: ignore[no-untyped-call]


def full_after(named_ok: int, anonymous_ok: bool = True) -> Callable[[int, int, bool], None]:
    """A stand-in for ``slabfile.reserve``: each process's first ``named_ok`` named files get
    their memory, later ones fail as on a full /dev/shm (ENOSPC); anonymous ones too unless
    ``anonymous_ok``."""
    made: dict[int, int] = {}
    real = slabfile.reserve

    def reserve(fd: int, size: int, named: bool) -> None:
        if named:
            made[os.getpid()] = made.get(os.getpid(), 0) + 1
            if made[os.getpid()] > named_ok:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        elif not anonymous_ok:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, size, named)

    return reserve


def where(tensor: torch.Tensor) -> str:
    mapping = shared_mapping_of(tensor.data_ptr())
    assert mapping is not None
    return mapping[1]


def expected(index: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.stack([ds.Blocks(1, shape)[index * 2 + k] for k in (0, 1)])


def check_warning(caught: list[warnings.WarningMessage]) -> str:
    ours = [w for w in caught if issubclass(w.category, SharedMemoryWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    message = str(ours[0].message)
    for words in ("/dev/shm", "MiB", "file_system", "--shm-size", "default", "No space left"):
        assert words in message, (words, message)
    return message


@pytest.mark.timeout(60)
def test_a_full_dev_shm_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slabfile, "reserve", full_after(0))
    shape = (1 << 16,)
    loader = ferry.DataLoader(ds.Blocks(40, shape), batch_size=2, num_workers=2, **FORK)
    with file_system(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(loader)
    check_warning(caught)
    assert len(batches) == 20
    for index, batch in enumerate(batches):
        assert torch.equal(batch, expected(index, shape))
        assert "/memfd:ferry-slab-" in where(batch), where(batch)


@pytest.mark.timeout(60)
def test_named_and_anonymous_slabs_from_one_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's first slab is named, its later ones anonymous: the main process takes
    both, and the batches it holds stay intact."""
    monkeypatch.setattr(slabfile, "reserve", full_after(1))
    shape = (1 << 16,)
    loader = ferry.DataLoader(ds.Blocks(24, shape), batch_size=2, num_workers=1, **FORK)
    with file_system(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        held = list(loader)  # every batch held: each takes a slab of its own
    check_warning(caught)
    places = [where(batch) for batch in held]
    assert places[0].startswith(f"/dev/shm/ferry-{os.getpid()}-"), places[0]
    assert all("/memfd:ferry-slab-" in place for place in places[1:]), places
    for index, batch in enumerate(held):
        assert torch.equal(batch, expected(index, shape))


@pytest.mark.timeout(60)
def test_no_memory_at_all_is_still_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slabfile, "reserve", full_after(0, anonymous_ok=False))
    loader = ferry.DataLoader(ds.Blocks(8, (1 << 16,)), batch_size=2, num_workers=1, **FORK)
    with file_system(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(OSError, match=r"could not get \d+ bytes of shared memory") as error:
            next(iter(loader))
    assert "batch_size" in str(error.value), str(error.value)
    assert not [w for w in caught if issubclass(w.category, SharedMemoryWarning)]


SMALL_SHM = """
    import json, sys, warnings
    import torch
    import ferry
    from ferry.errors import SharedMemoryWarning

    sys.path.insert(0, sys.argv[1])
    from _support.datasets import Blocks

    torch.multiprocessing.set_sharing_strategy("file_system")
    # 8 MiB batches, 4 workers, prefetch_factor=4, 6 batches held at a time: well over 64 MB
    # of shared memory at once.
    loader = ferry.DataLoader(Blocks(256, (1 << 19,)), batch_size=4, num_workers=4,
                              prefetch_factor=4, multiprocessing_context="fork")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        held, good = [], 0
        for index, batch in enumerate(loader):
            good += int(batch[0, 0]) == 4 * index and int(batch[3, -1]) == 4 * index + 3
            held = [*held[-5:], batch]
    ours = [str(w.message) for w in caught if issubclass(w.category, SharedMemoryWarning)]
    print(json.dumps({"batches": index + 1, "good": good, "warnings": ours}))
"""


@pytest.mark.timeout(180)
def test_a_64_mb_dev_shm_in_a_private_mount_namespace(tmp_path: Path) -> None:
    """The real thing: /dev/shm is a 64 MB tmpfs (as in a default Docker container); torch's
    loader fails there after a few batches under ``file_system``, ferry's warns once and goes
    on."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here to make a private /dev/shm")
    script = tmp_path / "small_shm.py"
    script.write_text(textwrap.dedent(SMALL_SHM))
    # Exit status 77: a private mount namespace or the tmpfs mount is not permitted here.
    shell = (
        "mount -t tmpfs -o size=64m tmpfs /dev/shm || exit 77; "
        f'exec "{sys.executable}" "{script}" "{TESTS}"'
    )
    try:
        run = subprocess.run(
            ["unshare", "-m", "sh", "-c", shell],
            capture_output=True,
            text=True,
            timeout=150,
            check=False,
        )
    except OSError as exc:
        pytest.skip(f"unshare could not run: {exc}")
    if run.returncode == 77 or (run.returncode != 0 and "unshare:" in run.stderr):
        pytest.skip(f"a private /dev/shm is not permitted here: {run.stderr.strip()[-200:]}")
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["batches"] == 64
    assert result["good"] == 64
    assert len(result["warnings"]) == 1, result["warnings"]
    assert "/dev/shm is 64.0 MiB" in result["warnings"][0], result["warnings"][0]


@pytest.mark.timeout(10)
def test_the_allocator_says_why_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the worker: the named slab that found no room is made anonymous, so are the next
    ones, and only the first announcement carries the reason."""
    monkeypatch.setattr(slabfile, "reserve", full_after(1))
    allocator = shm.SlabAllocator(os.getpid(), named=True)
    try:
        announced = []
        for _ in range(3):  # three batches held at once: three slabs
            allocator.begin(())
            allocator.empty((1 << 20,), torch.uint8)
            (slab,) = allocator.finish()
            announced.append(allocator.announcement(slab))
            slab.shared()
        assert [a.name is not None for a in announced] == [True, False, False]
        assert [a.fallback for a in announced] == ["", os.strerror(errno.ENOSPC), ""]
    finally:
        allocator.close()
