"""The process group's ``(rank, world_size)``, and the one a process worker inherits from the
main process (a worker started with spawn or forkserver has no process group of its own, yet
its share of a stream depends on its parent's rank: see docs/distributed.md)."""

from __future__ import annotations

import torch
import torch.distributed

__all__ = ["Inherited", "inherit_rank_world", "process_group_rank_world", "rank_world"]


def process_group_rank_world() -> tuple[int, int] | None:
    """``(rank, world_size)`` of this process's default process group, or None without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return None


class Inherited:
    """The main process's ``(rank, world_size)``, handed to a process worker at start-up.

    A worker started with spawn or forkserver has no process group of its own, yet its share
    of a stream depends on its parent's rank.
    """

    rank_world: tuple[int, int] | None = None


def inherit_rank_world(rank_world: tuple[int, int] | None) -> None:
    """Record the parent's ``(rank, world_size)`` in a process worker, before user code runs.

    The loader captures the value with :func:`process_group_rank_world` in the main process
    and passes it in the worker's start-up configuration.
    """
    Inherited.rank_world = rank_world


def rank_world() -> tuple[int, int]:
    """``(rank, world_size)`` to shard a stream by: the group's, else the parent's, else (0, 1)."""
    here = process_group_rank_world()
    if here is not None:
        return here
    if Inherited.rank_world is not None:
        return Inherited.rank_world
    return 0, 1
