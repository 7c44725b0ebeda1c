"""A list of Python objects kept in one shared buffer, so forked workers do not copy it.

Why: a map-style dataset that holds millions of Python objects (file paths, label dicts) in a
``list`` makes every process worker's memory grow by about the size of those objects, although
no worker changes them. Reading an object in CPython writes to it: its reference count goes up
and down, and a full garbage collection writes into the header of every container (``dict``,
``list``). Each such write to a page inherited through ``fork`` makes the kernel copy the page
for that worker (copy-on-write). Over an epoch every page holding an object is copied once per
worker: 3 million ``str`` with 2 workers cost about half a gigabyte, and the growth looks like a
leak.

:class:`SharedList` serializes the items once (pickle, highest protocol) back to back into one
anonymous shared file, with an ``int64`` array of their offsets after them, and keeps nothing
else: no per-item Python object, so no reference count to write. ``shared[i]`` decodes item
``i`` on access and returns a new object, private to the caller and freed after use. Workers map
the same pages as the main process and only read them:

* ``fork``: the workers inherit the mapping; reading it copies nothing.
* ``spawn``/``forkserver``: pickling a SharedList while a process is being started sends the
  file's descriptor (``multiprocessing.reduction.DupFd``) and the child maps the same pages: no
  bytes are copied, however long the list.
* Any other pickling (``pickle.dumps``, ``copy``) carries the bytes, so the result can be stored
  or sent anywhere; loading it makes a new shared file.

The price is a decode per access (about a microsecond for a short string) and immutability:
changing a returned object does not change the list.

Example::

    >>> class Images(ferry.Dataset):
    ...     def __init__(self, paths, labels):
    ...         self.items = ferry.SharedList(zip(paths, labels))  # not list(zip(...))
    ...     def __len__(self):
    ...         return len(self.items)
    ...     def __getitem__(self, i):
    ...         path, label = self.items[i]
    ...         return load(path), label
"""

from __future__ import annotations

import array
import mmap
import operator
import os
import pickle
import tempfile
import weakref
from collections.abc import Iterable, Iterator, Sequence
from multiprocessing import context as mp_context
from multiprocessing import reduction
from typing import Any, SupportsIndex, TypeVar, overload

__all__ = ["SharedList"]

T = TypeVar("T")

_PROTOCOL = pickle.HIGHEST_PROTOCOL
# First size of the file while items are written; it doubles as it fills.
_FIRST_CAPACITY = 1 << 16
_OFFSET = array.array("q").itemsize


class SharedList(Sequence[T]):
    """An immutable list of picklable objects held in one shared-memory buffer.

    ``SharedList(items)`` takes any iterable (read once). Indexing (negative indices too) and
    iteration decode items on access, so each access returns a new object; a slice gives a
    ``list``. Compare contents with ``list(shared) == other`` (``==`` compares
    identity). Use it in place of a ``list`` of many small Python objects in a dataset read by
    process workers: see the module docstring for why worker memory then stays flat.

    Example::

        >>> paths = ferry.SharedList(f"/data/{i}.jpg" for i in range(3))
        >>> len(paths), paths[-1], paths[:2]
        (3, '/data/2.jpg', ['/data/0.jpg', '/data/1.jpg'])
    """

    def __init__(self, items: Iterable[T]) -> None:
        try:
            iterator = iter(items)
        except TypeError:
            raise TypeError(
                f"SharedList(items): items must be an iterable, got {type(items).__qualname__}"
            ) from None
        fd = _anonymous_file()
        try:
            mapping, count, data_size = _write_items(fd, iterator)
        except BaseException:
            os.close(fd)
            raise
        self._attach(fd, count, data_size, mapping)

    def _attach(
        self, fd: int, count: int, data_size: int, mapping: mmap.mmap | None = None
    ) -> None:
        """Take ``fd`` (owned from now on), holding ``count`` items in ``data_size`` bytes, and
        its ``mapping`` if this process wrote it (else map it read-only)."""
        self._fd, self._count, self._data_size = fd, count, data_size
        self._finalizer = weakref.finalize(self, os.close, fd)
        start = _aligned(data_size)
        self._size = start + (count + 1) * _OFFSET
        if mapping is None:
            mapping = mmap.mmap(fd, self._size, access=mmap.ACCESS_READ)
        self._map = mapping
        view = memoryview(mapping).toreadonly()
        self._data = view[:data_size]
        self._offsets = view[start : self._size].cast("q")

    @classmethod
    def _from_descriptor(cls, fd: Any, count: int, data_size: int) -> SharedList[Any]:
        """Unpickle in a process being started: map the parent's file (no bytes copied)."""
        shared: SharedList[Any] = cls.__new__(cls)
        shared._attach(fd.detach(), count, data_size)
        return shared

    @classmethod
    def _from_bytes(cls, payload: bytes, count: int, data_size: int) -> SharedList[Any]:
        """Unpickle anywhere else: the bytes go into a new shared file."""
        fd = _anonymous_file()
        try:
            os.ftruncate(fd, len(payload))
            mapping = mmap.mmap(fd, len(payload))
            mapping[:] = payload
        except BaseException:
            os.close(fd)
            raise
        shared: SharedList[Any] = cls.__new__(cls)
        shared._attach(fd, count, data_size, mapping)
        return shared

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        popen = mp_context.get_spawning_popen()
        if popen is not None and hasattr(reduction, "DupFd"):
            # Pickled to start a process (spawn, forkserver): the child receives a duplicate
            # of the descriptor with its arguments and maps the same pages.
            return (type(self)._from_descriptor, (reduction.DupFd(self._fd), *self._shape()))
        whole = memoryview(self._map)
        payload: Any = pickle.PickleBuffer(whole) if operator.index(protocol) >= 5 else bytes(whole)
        return (type(self)._from_bytes, (payload, *self._shape()))

    def _shape(self) -> tuple[int, int]:
        return self._count, self._data_size

    # Immutable: a copy may share the buffer, as copies of a tuple do.
    def __copy__(self) -> SharedList[T]:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> SharedList[T]:
        return self

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory held: the pickled items and their offsets."""
        return self._size

    @overload
    def __getitem__(self, index: SupportsIndex) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: SupportsIndex | slice) -> T | list[T]:
        if isinstance(index, slice):
            return [self._load(i) for i in range(*index.indices(self._count))]
        return self._load(self._position(index))

    def __getitems__(self, indices: Sequence[SupportsIndex]) -> list[T]:
        """Items at ``indices``, in order (the loader fetches a whole batch with one call)."""
        return [self._load(self._position(i)) for i in indices]

    def __iter__(self) -> Iterator[T]:
        data, offsets, loads = self._data, self._offsets, pickle.loads
        for i in range(self._count):
            yield loads(data[offsets[i] : offsets[i + 1]])

    def _position(self, index: SupportsIndex) -> int:
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(
                f"SharedList indices must be integers or slices, got {type(index).__qualname__}"
            ) from None
        position = i + self._count if i < 0 else i
        if not 0 <= position < self._count:
            raise IndexError(
                f"SharedList index {i} is out of range for a list of length {self._count}"
            )
        return position

    def _load(self, i: int) -> T:
        item: T = pickle.loads(self._data[self._offsets[i] : self._offsets[i + 1]])
        return item

    def __repr__(self) -> str:
        return f"SharedList(<{self._count} items, {self._size} bytes shared>)"


def _anonymous_file() -> int:
    """A descriptor of a new, nameless file in memory: nothing to remove when done."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("ferry-shared-list", os.MFD_CLOEXEC)
    with tempfile.TemporaryFile() as file:  # unlinked at once where memfd is missing
        return os.dup(file.fileno())


def _aligned(size: int) -> int:
    return -(-size // _OFFSET) * _OFFSET


def _write_items(fd: int, items: Iterator[Any]) -> tuple[mmap.mmap, int, int]:
    """Pickle ``items`` into ``fd`` back to back, then their offsets: the mapping written
    through, the number of items and the bytes they take.

    The mapping stays this process's view of the file: it has every page mapped, so the pages
    workers read are shared with it and count as shared memory, not as the workers' own.
    """
    offsets = array.array("q", [0])
    capacity = _FIRST_CAPACITY
    os.ftruncate(fd, capacity)
    target = mmap.mmap(fd, capacity)
    try:
        end = 0
        for index, item in enumerate(items):
            try:
                blob = pickle.dumps(item, protocol=_PROTOCOL)
            except Exception as exc:
                raise TypeError(
                    f"SharedList item {index} ({type(item).__qualname__}) cannot be pickled: {exc}"
                ) from exc
            start, end = end, end + len(blob)
            if end > capacity:
                capacity = max(2 * capacity, end)
                target = _resized(target, fd, capacity)
            target[start:end] = blob
            offsets.append(end)
        table = _aligned(end)
        size = table + len(offsets) * _OFFSET
        target = _resized(target, fd, size)
        target[table:size] = offsets.tobytes()
    except BaseException:
        target.close()
        raise
    return target, len(offsets) - 1, end


def _resized(target: mmap.mmap, fd: int, size: int) -> mmap.mmap:
    """``target``, the mapping of ``fd``, over ``size`` bytes; the file grows or shrinks."""
    try:
        target.resize(size)
    except SystemError:  # no mremap (macOS): map the resized file again, its bytes stay
        target.close()
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    return target
