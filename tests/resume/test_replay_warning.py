"""``EpochReplayWarning``: said when an epoch would repeat an earlier one's draws, and only then.

An epoch that draws from torch's global RNG (a shuffle without a generator, new worker seeds)
and begins where an earlier epoch began repeats it: the loader warns. An epoch that draws
nothing from it repeats nothing, whatever the global RNG's state.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import ferry
from ferry.errors import EpochReplayWarning

pytestmark = pytest.mark.usefixtures("guard_global_state")


def _replay_warnings(loader: ferry.DataLoader[Any], epochs: int, reseed: bool) -> list[int]:
    """The epochs (0-based) during which the loader warned ``EpochReplayWarning``."""
    warned = []
    for epoch in range(epochs):
        if reseed:
            torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            list(loader)
        if any(issubclass(w.category, EpochReplayWarning) for w in caught):
            warned.append(epoch)
    loader._iterator = None  # persistent workers stop now
    return warned


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_reseeding_the_global_rng_before_each_epoch_warns(num_workers: int) -> None:
    loader = ferry.DataLoader(
        ferry.TensorDataset(torch.arange(8)), batch_size=4, shuffle=True, num_workers=num_workers
    )
    assert _replay_warnings(loader, 3, reseed=True) == [1, 2]


@pytest.mark.timeout(60)
def test_epochs_that_draw_from_the_global_rng_do_not_warn() -> None:
    loader = ferry.DataLoader(
        ferry.TensorDataset(torch.arange(8)), batch_size=4, shuffle=True, num_workers=2
    )
    assert _replay_warnings(loader, 3, reseed=False) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_persistent_workers_without_a_shuffle_do_not_warn(worker_type: str) -> None:
    loader = ferry.DataLoader(
        ferry.TensorDataset(torch.arange(8)),
        batch_size=4,
        num_workers=2,
        persistent_workers=True,
        worker_type=worker_type,
    )
    assert _replay_warnings(loader, 3, reseed=False) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_epoch_left_before_its_end_is_not_one_to_repeat(num_workers: int) -> None:
    """Lightning's sanity check takes two validation batches with the global RNG saved and put
    back (``isolate_rng``); the first validation epoch then begins where it began, with the
    same worker seeds, as with torch's loader. Nothing was trained on: no warning. An epoch
    run to its end and begun again from the same state still warns."""
    # (without workers, only a shuffle draws from the global RNG)
    loader = ferry.DataLoader(
        ferry.TensorDataset(torch.arange(16)),
        batch_size=4,
        shuffle=num_workers == 0,
        num_workers=num_workers,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = torch.get_rng_state()
        iterator = iter(loader)
        next(iterator), next(iterator)  # the sanity check: two batches, then left
        del iterator
        torch.set_rng_state(saved)
        list(loader)  # the first validation epoch, from the same state
        list(loader)  # the next one draws on
    assert not [w for w in caught if issubclass(w.category, EpochReplayWarning)]
    torch.set_rng_state(saved)
    with pytest.warns(EpochReplayWarning):
        list(loader)  # begins where the first validation epoch, which ended, began
