"""Turning a list of samples into a batch: :func:`collate`, :func:`default_collate`,
:func:`default_convert` and the extensible :data:`default_collate_fn_map`.

The output is the one torch gives for the same input (types, dtypes, shapes, values,
containers). One thing differs underneath: batch tensors are allocated through the loader's
allocator (reused host buffers in the main process, shared memory in process workers), so each
sample is written once into memory that is already mapped, and nothing is copied again on its
way to the training loop.

Example::

    >>> default_collate([{"x": 1.0, "y": "a"}, {"x": 2.0, "y": "b"}])
    {'x': tensor([1., 2.], dtype=torch.float64), 'y': ['a', 'b']}
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ferry._core.alloc import active_allocator, batch_empty, extent_bytes
from ferry._core.info import get_worker_info
from ferry._structure import is_namedtuple, map_structure, rebuild_mapping, rebuild_sequence

try:
    import numpy as np
except ImportError:  # numpy is optional
    np = None  # type: ignore[assignment]

__all__ = [
    "CollateFn",
    "CollateFnMap",
    "collate",
    "collate_float_fn",
    "collate_int_fn",
    "collate_numpy_array_fn",
    "collate_numpy_scalar_fn",
    "collate_str_fn",
    "collate_tensor_fn",
    "default_collate",
    "default_collate_fn_map",
    "default_convert",
]

CollateFn = Callable[..., Any]
"""A per-type collate function: ``fn(batch, *, collate_fn_map) -> batched``."""
CollateFnMap = dict[type | tuple[type, ...], CollateFn]

# numpy dtypes that hold no numbers, as torch finds them: any of these letters in the dtype's
# string (bytes, str, object; the "a" also catches datetimes in attoseconds, "<M8[as]").
_NOT_NUMBERS = re.compile("[SaUO]")

_SPARSE_LAYOUTS = frozenset(
    {torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc}
)


def _unsupported(found: object) -> TypeError:
    """The error for a leaf no collate function takes (``found``: its type, or its dtype)."""
    return TypeError(
        "default_collate: batch must contain tensors, numpy arrays, numbers, dicts or lists; "
        f"found {found}. Batched are tensors, numpy arrays and scalars, numbers, str and bytes, "
        "and mappings or sequences of those: register a function for this type in "
        "collate_fn_map, or pass DataLoader(collate_fn=...)"
    )


def collate(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    """Batch a list of samples, structure first, leaves through ``collate_fn_map``.

    A leaf's function is found by its exact type, else by the first key (in insertion order) it
    is an instance of. Containers are walked: mappings by key (same mapping type when it can be
    rebuilt), namedtuples by field, other sequences by position (samples of unequal length are
    an error; tuples become lists).

    Example::

        >>> collate([(1, "a"), (2, "b")], collate_fn_map=default_collate_fn_map)
        [tensor([1, 2]), ['a', 'b']]
    """
    elem = batch[0]
    elem_type = type(elem)
    if collate_fn_map is not None:
        fn = collate_fn_map.get(elem_type)
        if fn is not None:
            return fn(batch, collate_fn_map=collate_fn_map)
        for key, fn in collate_fn_map.items():
            if isinstance(elem, key):
                return fn(batch, collate_fn_map=collate_fn_map)
    if isinstance(elem, Mapping):
        return rebuild_mapping(
            elem, {k: collate([d[k] for d in batch], collate_fn_map=collate_fn_map) for k in elem}
        )
    if is_namedtuple(elem):
        # Fields as far as every sample has them, as torch's zip reads them (no size check).
        fields = zip(*batch)  # noqa: B905
        return elem_type(*(collate(s, collate_fn_map=collate_fn_map) for s in fields))
    if isinstance(elem, Sequence):
        size = len(elem)
        for position, sample in enumerate(batch):
            if len(sample) != size:
                raise RuntimeError(
                    "each element in list of batch should be of equal size: sample 0 has "
                    f"{size} elements, sample {position} has {len(sample)}"
                )
        # Each position goes on as a tuple, as in torch (a position of strings stays a tuple).
        columns = [collate(s, collate_fn_map=collate_fn_map) for s in zip(*batch, strict=True)]
        if isinstance(elem, tuple):
            return columns
        return rebuild_sequence(elem, columns)
    raise _unsupported(elem_type)


def collate_tensor_fn(batch: Sequence[torch.Tensor], *, collate_fn_map: Any = None) -> Any:
    """Stack same-shaped tensors along a new first dimension, into the loader's batch memory."""
    elem = batch[0]
    if elem.is_nested:
        raise RuntimeError(
            "Batches of nested tensors are not currently supported by the default collate_fn: "
            "they cannot be stacked into one tensor; pass a collate_fn that builds the batch "
            "you need"
        )
    if elem.layout in _SPARSE_LAYOUTS:
        raise RuntimeError(
            "Batches of sparse tensors are not currently supported by the default collate_fn: "
            f"tensors of layout {elem.layout} cannot be stacked into one tensor; pass a "
            "collate_fn that builds the batch you need"
        )
    samples = list(batch)
    if get_worker_info() is not None:
        return _stack_in_worker(samples)
    allocator = active_allocator()
    if allocator is None or len(samples) * elem.nbytes < allocator.min_bytes:
        return torch.stack(samples, 0)
    if not _stackable_into_buffer(samples):
        return torch.stack(samples, 0)
    return _stack_into_buffer(samples)


def _stack_into_buffer(samples: list[torch.Tensor]) -> torch.Tensor:
    """``samples`` stacked into the loader's memory, in the first sample's dtype. ``out=``
    refuses what plain stack handles (tensors needing autograd, other devices): there torch's
    result, not a buffer, is what the batch must be."""
    first = samples[0]
    out = batch_empty((len(samples), *first.shape), first.dtype)
    try:
        return torch.stack(samples, 0, out=out)
    except RuntimeError:
        return torch.stack(samples, 0)


def _stack_in_worker(samples: list[torch.Tensor]) -> torch.Tensor:
    """A batch stacked in a worker, as torch's workers stack it: into new contiguous memory of
    the first sample's dtype, whatever the samples' layout (channels-last samples give a
    contiguous batch there, not a channels-last one) and dtypes (others are cast to the
    first's, not promoted). Where that ``out=`` stack fails (samples that record autograd, a
    dtype that cannot be cast to the first's), torch's worker fails; ferry stacks as outside a
    worker. Tensor subclasses and other devices are stacked as outside a worker, as torch's
    workers stack them."""
    first = samples[0]
    if first.device.type != "cpu" or any(type(t) is not torch.Tensor for t in samples):
        return torch.stack(samples, 0)
    try:
        return _stack_into_buffer(samples)
    except TypeError as exc:  # a dtype that cannot be cast to the first's
        other = next((i for i, t in enumerate(samples) if t.dtype != first.dtype), None)
        if other is None:
            raise
        raise TypeError(
            f"{exc}: in a worker, collate stacks a batch into its first sample's dtype "
            f"({first.dtype}), as torch's workers do, and sample {other} is "
            f"{samples[other].dtype}; give the samples one dtype (convert them in the dataset)"
        ) from exc


def _stackable_into_buffer(samples: list[torch.Tensor]) -> bool:
    """Whether ``stack(out=buffer)`` would give what plain ``stack`` gives, in what it could
    not refuse: plain tensors (no subclass hook) of one dtype (``out=`` would cast rather than
    promote) on the CPU, whose stack torch makes contiguous, as the buffer is. Autograd and
    devices make ``out=`` raise, which the caller catches.

    torch stacks into contiguous memory unless the samples are laid out alike in a way it
    keeps (4-d channels-last ones, say, give a batch whose samples stay channels-last). A
    contiguous first sample gives a contiguous batch; so do samples that all share one other
    layout where torch's own stack of that layout is contiguous (``image.permute(2, 0, 1)``,
    what torchvision's ``pil_to_tensor`` returns), which :func:`_stacks_contiguous` asks torch
    once per layout. Samples of mixed layouts are left to torch."""
    first = samples[0]
    dtype = first.dtype
    for t in samples:
        if type(t) is not torch.Tensor or t.dtype is not dtype:
            return False
    if first.device.type != "cpu":
        return False
    if first.is_contiguous():
        return True
    stride = first.stride()
    if any(t.stride() != stride for t in samples):
        return False
    return _stacks_contiguous(first)


_LAYOUTS: dict[tuple[Any, ...], bool] = {}  # (shape, strides, dtype) -> whether torch stacks it
_MAX_LAYOUTS = 64  # forgotten all at once past this: a dataset of ever-new shapes stays small
_MAX_PROBE_BYTES = 16 << 20  # larger samples are not probed: their batches stack as torch's


def _stacks_contiguous(sample: torch.Tensor) -> bool:
    """Whether torch's stack of samples laid out as ``sample`` is contiguous: asked of torch
    itself once per shape, strides and dtype, by stacking two uninitialised tensors of that
    layout (tens of microseconds for an image; torch's meta device would need no memory but
    imports some 800 modules on first use). False for samples over 16 MiB, not probed."""
    key = (tuple(sample.shape), sample.stride(), sample.dtype)
    known = _LAYOUTS.get(key)
    if known is None:
        if len(_LAYOUTS) >= _MAX_LAYOUTS:
            _LAYOUTS.clear()
        known = False
        if extent_bytes(key[0], key[1], sample.element_size()) <= _MAX_PROBE_BYTES:
            probe = torch.empty_strided(sample.shape, sample.stride(), dtype=sample.dtype)
            known = torch.stack([probe, probe]).is_contiguous()
        _LAYOUTS[key] = known
    return known


def collate_numpy_array_fn(
    batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None
) -> Any:
    """Numeric numpy arrays become one tensor (arrays of str or objects are an error)."""
    elem = batch[0]
    if _NOT_NUMBERS.search(elem.dtype.str):
        raise TypeError(
            "default_collate: batch must contain tensors, numpy arrays, numbers, dicts or "
            f"lists; found {elem.dtype}. numpy arrays of dtype {elem.dtype} hold no numbers and "
            "cannot be made a tensor: convert them in the dataset or pass a collate_fn"
        )
    try:
        # from_numpy is as_tensor's own path for an ndarray (same sharing, same warnings)
        # without its argument parsing: a third of the cost per sample.
        tensors = [torch.from_numpy(b) for b in batch]
    except (TypeError, ValueError):
        tensors = [torch.as_tensor(b) for b in batch]  # a non-array in the batch, say
    return collate(tensors, collate_fn_map=collate_fn_map)


def collate_numpy_scalar_fn(batch: Sequence[Any], *, collate_fn_map: Any = None) -> torch.Tensor:
    """numpy scalars become a 1-D tensor of their dtype."""
    return torch.as_tensor(batch)


def collate_float_fn(batch: Sequence[float], *, collate_fn_map: Any = None) -> torch.Tensor:
    """Python floats become a float64 tensor."""
    return torch.tensor(batch, dtype=torch.float64)


def collate_int_fn(batch: Sequence[int], *, collate_fn_map: Any = None) -> torch.Tensor:
    """Python ints (and bools) become an int64 (bool) tensor."""
    return torch.tensor(batch)


def collate_str_fn(batch: Sequence[str | bytes], *, collate_fn_map: Any = None) -> Any:
    """Strings and bytes stay a list."""
    return batch


default_collate_fn_map: CollateFnMap = {torch.Tensor: collate_tensor_fn}
"""The per-type functions :func:`default_collate` uses; add entries to extend it."""
if np is not None:
    default_collate_fn_map[np.ndarray] = collate_numpy_array_fn
    default_collate_fn_map[(np.bool_, np.number, np.object_)] = collate_numpy_scalar_fn
default_collate_fn_map[float] = collate_float_fn
default_collate_fn_map[int] = collate_int_fn
default_collate_fn_map[str] = collate_str_fn
default_collate_fn_map[bytes] = collate_str_fn
_PRISTINE_MAP = tuple(default_collate_fn_map.items())


def default_map_is_pristine() -> bool:
    """Whether :data:`default_collate_fn_map` still holds exactly its built-in entries.

    The loader's one-call tensor gather, which skips stacking rows, gives what the built-in
    functions would give; once a user extends or replaces an entry, batches must go through
    the map.
    """
    current = default_collate_fn_map
    return len(current) == len(_PRISTINE_MAP) and all(
        current.get(key) is fn for key, fn in _PRISTINE_MAP
    )


def default_collate(batch: Sequence[Any]) -> Any:
    """Batch a list of samples: tensors, arrays and numbers gain a first batch dimension.

    ========================  =============================================================
    sample element            batch
    ========================  =============================================================
    ``torch.Tensor``          stacked tensor
    numpy array / scalar      stacked tensor of the same dtype
    ``float`` / ``int``       float64 / int64 tensor (``bool`` gives a bool tensor)
    ``str`` / ``bytes``       list, unchanged
    mapping                   same mapping type, each value batched
    namedtuple                same namedtuple, each field batched
    other sequence            list (or same type) of batched positions
    ========================  =============================================================

    Example::

        >>> default_collate([(0, 1), (2, 3)])
        [tensor([0, 2]), tensor([1, 3])]
    """
    return collate(batch, collate_fn_map=default_collate_fn_map)


def _convert_leaf(data: Any) -> Any:
    elem_type = type(data)
    if elem_type.__module__ == "numpy" and elem_type.__name__ not in ("str_", "string_"):
        if elem_type.__name__ == "ndarray" and _NOT_NUMBERS.search(data.dtype.str):
            return data
        return torch.as_tensor(data)
    return data


def default_convert(data: Any) -> Any:
    """Turn numpy arrays and scalars in a sample into tensors; keep everything else.

    Used instead of :func:`default_collate` when automatic batching is off
    (``batch_size=None``). Containers are rebuilt as :func:`default_collate` does.

    Example::

        >>> default_convert({"a": np.array([1, 2]), "b": "text"})
        {'a': tensor([1, 2]), 'b': 'text'}
    """
    if isinstance(data, torch.Tensor):
        return data
    return map_structure(data, _convert_leaf)
