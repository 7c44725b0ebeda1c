"""``torch.utils.data._utils.collate``'s documented names, so that
``from ferry._utils.collate import collate, default_collate_fn_map`` replaces the import torch's
documentation shows for extending ``default_collate``. Everything here is
:mod:`ferry.collate`'s own object."""

from ferry.collate import (
    collate,
    collate_float_fn,
    collate_int_fn,
    collate_numpy_array_fn,
    collate_numpy_scalar_fn,
    collate_str_fn,
    collate_tensor_fn,
    default_collate,
    default_collate_fn_map,
    default_convert,
)

__all__ = [
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
