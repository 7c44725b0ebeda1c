"""Rebuild a nested sample with a function applied to its leaves: the walk of
:func:`ferry.collate.default_convert`, which treats containers as torch's does. Mappings and
sequences keep their type when it can be rebuilt (a copy updated in place for mutable ones),
namedtuples keep theirs, plain tuples become lists, and ``str``/``bytes`` are leaves.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

__all__ = ["is_namedtuple", "map_structure", "rebuild_mapping", "rebuild_sequence"]


def is_namedtuple(value: object) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def rebuild_mapping(template: Mapping[Any, Any], values: dict[Any, Any]) -> Any:
    """A mapping of ``template``'s type holding ``values``; a plain dict if it can't be built."""
    try:
        if isinstance(template, MutableMapping):
            clone = copy.copy(template)
            clone.update(values)
            return clone
        return type(template)(values)  # type: ignore[call-arg]
    except TypeError:
        return values


def rebuild_sequence(template: Sequence[Any], items: list[Any]) -> Any:
    """A sequence of ``template``'s type holding ``items``; the list itself if it can't be built."""
    try:
        if isinstance(template, MutableSequence):
            clone = copy.copy(template)
            for position, item in enumerate(items):
                clone[position] = item
            return clone
        return type(template)(items)  # type: ignore[call-arg]
    except TypeError:
        return items


def map_structure(data: Any, leaf: Callable[[Any], Any]) -> Any:
    """``data`` with ``leaf`` applied to every value that is not a container."""
    if isinstance(data, (str, bytes)):
        return leaf(data)
    if isinstance(data, Mapping):
        # (by key, as torch: a mapping's own __getitem__ is what it answers)
        return rebuild_mapping(data, {k: map_structure(data[k], leaf) for k in data})
    if is_namedtuple(data):
        return type(data)(*(map_structure(v, leaf) for v in data))
    if isinstance(data, tuple):
        return [map_structure(v, leaf) for v in data]
    if isinstance(data, Sequence):
        return rebuild_sequence(data, [map_structure(v, leaf) for v in data])
    return leaf(data)
