"""``balance_workers=True``: the next batch goes to the worker that would finish it first, not
to the next in turn; the batches still come in the sampler's order (torch's), every one once,
across epochs, restarts (``test_restarts``) and a resume."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils.data as tud

import ferry
from _support.processes import FAST, Kind
from workers.balance_datasets import Uneven

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SEED = 7


def _loader(module: Any, dataset: Any, **options: Any) -> Any:
    options = {
        "batch_size": 4,
        "shuffle": True,
        "generator": torch.Generator().manual_seed(SEED),
        **options,
    }
    return module.DataLoader(dataset, **options)


def _epoch(loader: Any) -> tuple[list[int], list[int]]:
    """The sample indices of an epoch, in the order they came, and the worker of each."""
    batches = list(loader)
    both = torch.cat(batches) if batches else torch.empty(0, 2, dtype=torch.long)
    return both[:, 0].tolist(), both[:, 1].tolist()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", [Kind(name) for name in FAST], ids=str)
@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
def test_balanced_batches_come_in_torchs_order_and_the_slow_worker_makes_fewer(
    kind: Kind, persistent: bool
) -> None:
    """Worker 0 takes 20x longer a sample: with turns (torch) it makes a third of the
    batches, balanced far fewer, and in both the epoch's indices are torch's, in order."""
    dataset = Uneven(120)
    # (torch's workers draw their base seed from the generator: the reference has workers too;
    # the order does not depend on their speed, so theirs are all fast)
    expected = _loader(tud, Uneven(120, slow=0.001), num_workers=3, persistent_workers=persistent)
    balanced = _loader(
        ferry,
        dataset,
        num_workers=3,
        balance_workers=True,
        persistent_workers=persistent,
        **kind.kwargs,
    )
    for _ in range(2):
        want, _ = _epoch(expected)
        got, workers = _epoch(balanced)
        assert got == want
        per_worker = [workers.count(w) for w in range(3)]
        assert sum(per_worker) == 120
        assert per_worker[0] < min(per_worker[1:]), per_worker
    del expected, balanced  # (persistent workers end with their loader)


@pytest.mark.timeout(60)
def test_without_balance_the_workers_take_turns() -> None:
    """The default is torch's round-robin: each worker makes every third batch, whatever its
    speed (so a worker's random draws, seeded per worker, are torch's)."""
    got, workers = _epoch(_loader(ferry, Uneven(48), num_workers=3))
    assert workers == [(i // 4) % 3 for i in range(48)]
    assert sorted(got) == list(range(48))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", [Kind(name) for name in FAST], ids=str)
def test_a_balanced_loader_resumes_where_it_stopped(kind: Kind) -> None:
    """A state taken mid-epoch and loaded into a new loader gives the rest of that epoch and
    the next one, as the uninterrupted run did."""
    dataset = Uneven(64, slow=0.005)
    options = {"num_workers": 2, "balance_workers": True, **kind.kwargs}
    whole = _loader(ferry, dataset, **options)
    first, _ = _epoch(whole)
    second, _ = _epoch(whole)
    stopped = _loader(ferry, dataset, **options)
    iterator = iter(stopped)
    head = [int(i) for _ in range(5) for i in next(iterator)[:, 0]]
    state = stopped.state_dict()
    del iterator
    resumed = _loader(ferry, dataset, **options)
    resumed.load_state_dict(state)
    rest, _ = _epoch(resumed)
    assert head + rest == first
    assert _epoch(resumed)[0] == second


@pytest.mark.timeout(60)
def test_balance_with_auto_workers_keeps_the_order() -> None:
    dataset = Uneven(40, slow=0.002)
    got, _ = _epoch(_loader(ferry, dataset, num_workers="auto", balance_workers=True))
    want, _ = _epoch(_loader(ferry, dataset, num_workers="auto"))
    assert got == want


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"num_workers": 2, "balance_workers": 1}, TypeError, r"balance_workers must be True or "),
        ({"num_workers": 2, "balance_workers": "yes"}, TypeError, r"got 'yes'"),
        ({"num_workers": 0, "balance_workers": True}, ValueError, r"needs num_workers > 0"),
    ],
    ids=["int", "str", "no workers"],
)
def test_balance_workers_is_checked(options: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ferry.DataLoader(range(8), **options)


def test_balance_workers_needs_a_map_style_dataset() -> None:
    class Stream(ferry.IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(8))

    with pytest.raises(ValueError, match=r"needs a map-style dataset, got an IterableDataset"):
        ferry.DataLoader(Stream(), num_workers=2, balance_workers=True)
    assert ferry.DataLoader(Stream(), num_workers=2).balance_workers is False
