"""The parts of the state that let a resume fetch again what a stateful dataset's workers fetched
since their snapshot (``since``), and put back a user sampler's own generator
(``sampler_generator``): older states without them still load; another worker count is refused
when the workers' datasets have moved on since their snapshots."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import ferry
from resume import sdl_programs as sp


def _loader(num_workers: int, snapshot: int = 3, **kwargs: Any) -> ferry.DataLoader:
    return ferry.DataLoader(
        sp.Counting(12),
        batch_size=2,
        num_workers=num_workers,
        snapshot_every_n_steps=snapshot,
        multiprocessing_context="fork" if num_workers else None,
        **kwargs,
    )


def _saved_after(loader: ferry.DataLoader, batches: int) -> dict[str, Any]:
    it = iter(loader)
    for _ in range(batches):
        next(it)
    state = copy.deepcopy(loader.state_dict())
    del it
    return state


@pytest.mark.timeout(60)
def test_since_is_saved_as_runs_and_replayed() -> None:
    full = [sp.plain(b) for b in _loader(2)]
    state = _saved_after(_loader(2), 4)
    # worker 0 made batches 0 and 2, worker 1 batches 1 and 3, with no snapshot yet (every 3)
    assert [w["since"] for w in state["workers"]] == [[[0, 2, 2]], [[1, 2, 2]]]
    resumed = _loader(2)
    resumed.load_state_dict(state)
    assert [sp.plain(b) for b in resumed] == full[4:]


@pytest.mark.timeout(60)
# The loader with 3 workers warns, on a 2-CPU machine, that it has more workers than CPUs (in
# torch's phrase); it only refuses the state here and starts none.
@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker:UserWarning")
def test_another_worker_count_is_refused_once_workers_moved_on() -> None:
    state = _saved_after(_loader(2, snapshot=0), 3)
    with pytest.raises(ValueError, match=r"num_workers=2.*num_workers=3"):
        _loader(3, snapshot=0).load_state_dict(state)


@pytest.mark.timeout(60)
def test_states_without_the_new_keys_load() -> None:
    state = _saved_after(_loader(2), 1)
    for worker in state["workers"]:
        del worker["since"]
    del state["epoch"]["keys"]["sampler_generator"]
    resumed = _loader(2)
    resumed.load_state_dict(state)  # loads; resumes at the snapshot, as such states did
    assert len(list(resumed)) == 5


def test_sampler_generator_is_kept_for_a_foreign_sampler() -> None:
    def build() -> ferry.DataLoader:
        generator = torch.Generator().manual_seed(3)
        sampler = tud.RandomSampler(range(10), generator=generator)
        return ferry.DataLoader(list(range(10)), batch_size=3, sampler=sampler)

    loader = build()
    full = [[b.tolist() for b in loader] for _ in range(3)]
    loader = build()
    for _ in range(2):
        list(loader)
    state = _saved_after(loader, 2)
    assert isinstance(state["epoch"]["keys"]["sampler_generator"], str)
    resumed = build()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == full[2][2:]
