"""Targeted tests of ``DataLoader.state_dict``/``load_state_dict`` (mid-epoch resume).

The oracle is always an uninterrupted run of a loader built the same way. "A new process" is
simulated by a fresh loader (fresh dataset, sampler and generators, the generators seeded with
other seeds) loading the state after a JSON (or ``torch.save``) round trip: the common case is
:func:`_support.resume.assert_resumes_exactly`.
"""

from __future__ import annotations

import collections
import copy
import io
import json
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ferry
from _support.compare import canon
from _support.processes import PROCESSES, Kind
from _support.resume import assert_resumes_exactly
from resume import datasets as rd

# A loader resumed with num_workers=3 on a 2-CPU machine warns about the CPU count, in torch's
# phrase (the worker count is what these tests vary, not a mistake).
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker:UserWarning")

Loader = ferry.DataLoader[Any]


# -- helpers -------------------------------------------------------------------------------------


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def epoch_of(batches: Iterator[Any]) -> list[Any]:
    return [canon(batch) for batch in batches]


def epochs(loader: Loader, count: int) -> list[list[Any]]:
    return [epoch_of(iter(loader)) for _ in range(count)]


def round_trip(state: dict[str, Any]) -> dict[str, Any]:
    text = json.dumps(state)
    loaded: dict[str, Any] = json.loads(text)
    assert loaded == state, "the state is not plain data: a JSON round trip changed it"
    return loaded


def take(iterator: Iterator[Any], count: int) -> list[Any]:
    return [canon(next(iterator)) for _ in range(count)]


def stop(loader: Loader) -> None:
    loader._iterator = None  # persistent workers stop now


def multiset(batches: list[Any]) -> collections.Counter[Any]:
    return collections.Counter(batches)


def shuffled(seed: int = 1, n: int = 10, batch_size: int = 3, **kwargs: Any) -> Loader:
    return ferry.DataLoader(
        ferry.TensorDataset(torch.arange(n)),
        batch_size=batch_size,
        shuffle=True,
        generator=gen(seed),
        **kwargs,
    )


def resumed_epochs(loader: Loader, state: dict[str, Any], count: int) -> list[list[Any]]:
    loader.load_state_dict(round_trip(state))
    got = epochs(loader, count)
    stop(loader)
    return got


# -- the edge points of an epoch -----------------------------------------------------------------

EDGE_SAMPLERS = ["sequential", "shuffle", "weighted", "stateful"]


def edge_loader(sampler: str, seed: int) -> Loader:
    """10 samples in batches of 4: three batches an epoch (4, 4, 2)."""
    dataset = ferry.TensorDataset(torch.arange(10))
    if sampler == "sequential":
        return ferry.DataLoader(dataset, batch_size=4, generator=gen(seed))
    if sampler == "shuffle":
        return ferry.DataLoader(dataset, batch_size=4, shuffle=True, generator=gen(seed))
    if sampler == "weighted":
        weights = [float(1 + i % 4) for i in range(10)]
        own = ferry.WeightedRandomSampler(weights, 10, generator=gen(seed + 100))
        return ferry.DataLoader(dataset, batch_size=4, sampler=own, generator=gen(seed))
    user = rd.StatefulShuffler(10, 7)
    return ferry.DataLoader(dataset, batch_size=4, sampler=user, generator=gen(seed))


# edge -> (epoch, batch) where the next iter() of a loader holding the state begins
EDGES = {
    "fresh": (0, 0),  # never iterated
    "between_epochs": (1, 0),  # a for loop over epoch 0 finished
    "after_iter": (1, 0),  # iter() of epoch 1 made, no batch taken
    "mid_epoch": (1, 1),  # one batch of epoch 1 taken
    # every batch of epoch 1 taken, StopIteration not seen: as torchdata's loader, the resumed
    # iterator ends epoch 1 without a batch, and the next iter() begins epoch 2
    "after_last_batch": (1, 3),
    "after_stop_iteration": (2, 0),  # StopIteration of epoch 1 seen, iterator still held
}


def reach(loader: Loader, edge: str) -> Iterator[Any] | None:
    """Drive ``loader`` to ``edge``; returns the live iterator, if any (kept alive)."""
    if edge == "fresh":
        return None
    for _ in loader:
        pass
    if edge == "between_epochs":
        return None
    iterator = iter(loader)
    if edge == "mid_epoch":
        next(iterator)
    elif edge in ("after_last_batch", "after_stop_iteration"):
        for _ in range(3):
            next(iterator)
        if edge == "after_stop_iteration":
            assert next(iterator, None) is None
    return iterator


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sampler", EDGE_SAMPLERS)
@pytest.mark.parametrize("edge", list(EDGES))
def test_state_at_every_edge_point(edge: str, sampler: str) -> None:
    reference = epochs(edge_loader(sampler, seed=1), 4)
    assert all(len(e) == 3 for e in reference)

    loader = edge_loader(sampler, seed=1)
    iterator = reach(loader, edge)
    state = round_trip(loader.state_dict())
    del iterator

    epoch, batch = EDGES[edge]
    fresh = edge_loader(sampler, seed=2)
    got = resumed_epochs(fresh, state, 4 - epoch)
    expected = [reference[epoch][batch:], *reference[epoch + 1 :]]
    assert got == expected


@pytest.mark.timeout(30)
def test_last_batch_and_stop_iteration_states_resume_as_torchdata_does() -> None:
    """After the last batch with StopIteration not seen, the resumed iterator ends the epoch
    without a batch (the user's loop then counts it done), and the next one yields the next
    epoch in full; after StopIteration, the next iterator yields the next epoch at once. This
    is torchdata's StatefulDataLoader's behaviour (tests/resume/test_sdl_parity.py)."""
    states = []
    for edge in ("after_last_batch", "after_stop_iteration"):
        loader = shuffled(seed=1, batch_size=4)  # three batches an epoch, as reach() expects
        iterator = reach(loader, edge)
        states.append(loader.state_dict())
        del iterator
    reference = epochs(shuffled(seed=1, batch_size=4), 3)
    last_batch, stop_iteration = states
    assert resumed_epochs(shuffled(seed=9, batch_size=4), last_batch, 2) == [[], reference[2]]
    assert resumed_epochs(shuffled(seed=9, batch_size=4), stop_iteration, 1) == [reference[2]]


class _Rewinding(ferry.IterableDataset):  # type: ignore[type-arg]
    """A stream whose position is the dataset's state, set back to 0 when a pass runs out."""

    def __init__(self, n: int) -> None:
        self.n, self.pos = n, 0

    def __iter__(self) -> Iterator[int]:
        while self.pos < self.n:
            self.pos += 1
            yield self.pos - 1
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_a_stream_that_ran_out_in_its_short_last_batch_has_nothing_left(workers: int) -> None:
    """Saved after the short last batch (StopIteration not seen), a stream whose dataset
    rewinds itself as it runs out says "position 0": the mark that it had run out must win,
    or the resumed epoch reads it all again. torchdata's fetcher keeps the mark without
    workers, and loses it with them (it replays the epoch); ferry ends the epoch in both."""

    def loader() -> ferry.DataLoader[Any]:
        options: dict[str, Any] = {"multiprocessing_context": "fork"} if workers else {}
        return ferry.DataLoader(_Rewinding(10), batch_size=3, num_workers=workers, **options)

    whole = [b.tolist() for b in loader()]  # the epoch, each worker's copy in turn
    original = loader()
    iterator = iter(original)
    assert [next(iterator).tolist() for _ in whole] == whole
    state = json.loads(json.dumps(original.state_dict()))
    del iterator
    resumed = loader()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == []  # the saved epoch: nothing left
    assert [b.tolist() for b in resumed] == whole  # the next one, from the start


@pytest.mark.timeout(30)
def test_state_right_after_load_is_the_loaded_state() -> None:
    original = shuffled(seed=1)
    iterator = iter(original)
    take(iterator, 2)
    state = round_trip(original.state_dict())

    resumed = shuffled(seed=5)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    resumed_iterator = iter(resumed)
    assert resumed.state_dict() == state  # iter() alone hands out nothing

    # A state taken then (before any batch) resumes at the same point too.
    relay = shuffled(seed=6)
    relay.load_state_dict(round_trip(resumed.state_dict()))

    third = take(iterator, 1)
    assert take(resumed_iterator, 1) == third
    moved = round_trip(resumed.state_dict())
    assert moved != state  # the position moved with the batch
    assert take(iter(relay), 1) == third
    # ... to where the uninterrupted loader stands after the same batch.
    follower = shuffled(seed=7)
    follower.load_state_dict(moved)
    assert epoch_of(iter(follower)) == epoch_of(iterator)


@pytest.mark.timeout(30)
def test_calling_state_dict_does_not_change_the_run() -> None:
    reference = epochs(shuffled(seed=1, num_workers=2, worker_type="thread"), 2)
    loader = shuffled(seed=1, num_workers=2, worker_type="thread")
    got = []
    for _ in range(2):
        batches = []
        for batch in loader:
            batches.append(canon(batch))
            loader.state_dict()
        got.append(batches)
    assert got == reference


@pytest.mark.timeout(60)
def test_resume_twice_in_a_row() -> None:
    """Interrupted in epoch 0, resumed (threads) and interrupted again in epoch 1, resumed
    again (a process worker): the batches are those of one uninterrupted run."""
    reference = epochs(
        ferry.DataLoader(rd.Ints(11), batch_size=2, shuffle=True, generator=gen(1)), 3
    )
    first: Loader = ferry.DataLoader(rd.Ints(11), batch_size=2, shuffle=True, generator=gen(1))
    got = take(iter(first), 2)
    state = round_trip(first.state_dict())

    second: Loader = ferry.DataLoader(
        rd.Ints(11),
        batch_size=2,
        shuffle=True,
        generator=gen(2),
        num_workers=2,
        worker_type="thread",
    )
    second.load_state_dict(state)
    got += epoch_of(iter(second))
    iterator = iter(second)
    got += take(iterator, 3)
    state = round_trip(second.state_dict())
    del iterator

    third: Loader = ferry.DataLoader(
        rd.Ints(11),
        batch_size=2,
        shuffle=True,
        generator=gen(3),
        num_workers=1,
        multiprocessing_context="fork",
    )
    third.load_state_dict(state)
    got += epoch_of(iter(third)) + epoch_of(iter(third))
    assert got == [b for e in reference for b in e]


# -- plain data ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_torch_save_and_weights_only_load_round_trip() -> None:
    def make(seed: int) -> Loader:
        return ferry.DataLoader(
            rd.Augmented(8),
            batch_size=2,
            shuffle=True,
            generator=gen(seed),
            num_workers=2,
            multiprocessing_context="fork",
        )

    def through_torch_save(state: dict[str, Any]) -> dict[str, Any]:
        buffer = io.BytesIO()
        torch.save({"loader": state}, buffer)
        buffer.seek(0)
        loaded: dict[str, Any] = torch.load(buffer, weights_only=True)["loader"]
        assert loaded == state
        return loaded

    run = assert_resumes_exactly(make, at=3, epochs=2, round_trip=through_torch_save)
    # The workers' generators (they drew augmentations) are part of the state.
    assert all(worker["rng"] is not None for worker in run.state["workers"])


# -- the global RNG ------------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop_at", [0, 2])
def test_random_sampler_without_generator_draws_from_global_rng_as_a_fresh_iterator(
    workers: int, stop_at: int
) -> None:
    """With generator=None the shuffle's seed and the base seed come from torch's global RNG,
    which is the user's to restore: here the "new process" seeds it as the first one did. The
    resumed epoch continues the interrupted permutation (the state holds its seeds), and it
    draws from the global RNG what a fresh iterator draws, draw for draw: it leaves the
    global RNG where the uninterrupted epoch left it, so later epochs match too."""
    options: dict[str, Any] = {"num_workers": workers}
    if workers:
        options["worker_type"] = "thread"

    def make() -> Loader:
        return ferry.DataLoader(
            ferry.TensorDataset(torch.arange(10)), batch_size=3, shuffle=True, **options
        )

    torch.manual_seed(3)
    reference_loader = make()
    reference, rng_after = [], []
    for _ in range(3):
        reference.append(epoch_of(iter(reference_loader)))
        rng_after.append(torch.get_rng_state())

    torch.manual_seed(3)
    loader = make()
    iterator = iter(loader)
    delivered = take(iterator, stop_at)
    state = round_trip(loader.state_dict())
    del iterator

    torch.manual_seed(3)  # the new process, seeded as the first
    fresh = make()
    fresh.load_state_dict(state)
    assert delivered + epoch_of(iter(fresh)) == reference[0]
    assert torch.equal(torch.get_rng_state(), rng_after[0])
    assert epochs(fresh, 2) == reference[1:]
    stop(fresh)


# -- user samplers -------------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("workers", [0, 2])
def test_snapshot_every_n_steps_with_a_stateful_sampler(workers: int) -> None:
    def make(every: int) -> Loader:
        options: dict[str, Any] = {"num_workers": workers}
        if workers:
            options["worker_type"] = "thread"
        return ferry.DataLoader(
            rd.Ints(20),
            batch_size=2,
            sampler=rd.StatefulShuffler(20, 7),
            snapshot_every_n_steps=every,
            **options,
        )

    every_step = make(1)
    reference = epochs(every_step, 2)
    every_third = make(3)
    epochs(every_third, 1)
    # Snapshots are taken every third key, not every key (10 batches an epoch).
    assert isinstance(every_step.sampler, rd.StatefulShuffler)
    assert isinstance(every_third.sampler, rd.StatefulShuffler)
    calls_every_step = every_step.sampler.state_calls
    calls_every_third = every_third.sampler.state_calls
    assert calls_every_third <= 10 // 3 + 2 < calls_every_step

    loader = make(3)
    iterator = iter(loader)
    delivered = take(iterator, 4)
    state = round_trip(loader.state_dict())
    del iterator
    keys = state["epoch"]["keys"]
    assert keys["kind"] == "stateful"
    assert keys["snapshot_at"] == 3  # the last snapshot at or before batch 4
    assert keys["snapshot"] == {"seed": 7, "epoch": 0, "yielded": 6}

    fresh = make(3)
    fresh.load_state_dict(state)
    got = epoch_of(iter(fresh))
    sampler = fresh.sampler
    assert isinstance(sampler, rd.StatefulShuffler)
    assert sampler.loads == [{"seed": 7, "epoch": 0, "yielded": 6}]
    assert delivered + got == reference[0]
    assert epoch_of(iter(fresh)) == reference[1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("drop_last", [False, True])
def test_stateful_sampler_state_after_last_batch_keeps_the_epoch_boundary(drop_last: bool) -> None:
    """A state taken after the last batch of an epoch resumes with the next epoch in full,
    with that epoch's own base seed: with process workers the augmentations show it. (With
    drop_last=False the last batch is partial, so the sampler's iteration ran to its end
    and the sampler already moved on to its next epoch when the snapshot was taken.)"""

    def make(seed: int) -> Loader:
        return ferry.DataLoader(
            rd.Augmented(5),
            batch_size=2,
            sampler=rd.StatefulShuffler(5, 7),
            drop_last=drop_last,
            generator=gen(seed),
            num_workers=2,
            multiprocessing_context="fork",
        )

    run = assert_resumes_exactly(make, at=len(make(1)), epochs=3)
    # The resumed iterator ends epoch 0 without a batch; then epochs 1 and 2 as they were.
    assert run.rest[0] == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("batch_size", [None, 2])
def test_sampler_with_stateful_iterator(batch_size: int | None) -> None:
    """The state lives on the sampler's iterator (the sampler object has none)."""

    def make() -> Loader:
        return ferry.DataLoader(
            rd.Ints(9), batch_size=batch_size, sampler=rd.IterStatefulShuffler(9, 7)
        )

    run = assert_resumes_exactly(lambda seed: make(), in_epoch=1, at=2, epochs=2)
    assert run.state["epoch"]["keys"]["kind"] == "stateful"


@pytest.mark.timeout(30)
def test_stateless_user_sampler_is_fast_forwarded() -> None:
    def make(workers: int) -> Loader:
        options: dict[str, Any] = {"worker_type": "thread"} if workers else {}
        return ferry.DataLoader(
            rd.Ints(9), batch_size=2, sampler=rd.FixedOrder(9), num_workers=workers, **options
        )

    run = assert_resumes_exactly(
        lambda seed: make(0), resume_with=lambda seed: make(2), at=3, epochs=2
    )
    assert run.state["epoch"]["keys"]["kind"] == "skip"


# -- out of order --------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_out_of_order_state_resumes_every_batch_exactly_once() -> None:
    """in_order=False: batch 0 is held back while the other worker delivers; the state then
    has batches delivered ahead of its position, and the resumed epoch must deliver the rest,
    each batch once."""

    def make(seed: int) -> Loader:
        return ferry.DataLoader(
            rd.Gated(12),
            batch_size=2,
            shuffle=False,
            generator=gen(seed),
            num_workers=2,
            worker_type="thread",
            in_order=False,
        )

    rd.GATE.set()
    reference = epochs(make(1), 2)
    rd.GATE.clear()
    try:
        loader = make(1)
        iterator = iter(loader)
        delivered = take(iterator, 2)
        state = round_trip(loader.state_dict())
    finally:
        rd.GATE.set()
    del iterator
    assert state["epoch"]["position"] == 0
    assert state["epoch"]["ahead"], "the scenario needs batches delivered out of order"

    got = resumed_epochs(make(2), state, 2)
    assert multiset(delivered + got[0]) == multiset(reference[0])
    assert multiset(got[1]) == multiset(reference[1])


# -- iterable-style datasets ---------------------------------------------------------------------


def thread_options(workers: int) -> dict[str, Any]:
    return {"num_workers": workers, "worker_type": "thread"} if workers else {}


def stream_epochs(loader: Loader, count: int) -> list[list[list[int]]]:
    return [[batch.tolist() for batch in loader] for _ in range(count)]


def interrupted_stream(
    make: Callable[[], Loader], batches: int
) -> tuple[list[list[list[int]]], list[list[int]], dict[str, Any]]:
    """Two uninterrupted epochs of ``make()``, and a run of it stopped after ``batches``: the
    batches it delivered and its state (after a JSON round trip)."""
    reference = stream_epochs(make(), 2)
    loader = make()
    iterator = iter(loader)
    delivered = [next(iterator).tolist() for _ in range(batches)]
    state = round_trip(loader.state_dict())
    del iterator
    return reference, delivered, state


@pytest.mark.timeout(30)
@pytest.mark.parametrize("workers", [0, 2])
def test_stateless_stream_resumes_by_dropping_and_warns_once(workers: int) -> None:
    def make() -> Loader:
        return ferry.DataLoader(rd.Stream(14), batch_size=3, **thread_options(workers))

    reference, delivered, state = interrupted_stream(make, 2)

    fresh = make()
    with pytest.warns(UserWarning, match=r"dropping the 6 samples") as record:
        fresh.load_state_dict(state)
    assert len([w for w in record if "fast-forwards" in str(w.message)]) == 1
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        fresh.load_state_dict(state)  # warned once per loader
    assert not [w for w in again if "fast-forwards" in str(w.message)]

    got = stream_epochs(fresh, 2)
    stop(fresh)
    assert [delivered + got[0], got[1]] == reference


@pytest.mark.timeout(30)
@pytest.mark.parametrize("workers", [0, 2])
def test_stream_with_stateful_iterator_resumes_without_replay(workers: int) -> None:
    def make() -> Loader:
        return ferry.DataLoader(rd.StatefulStream(14), batch_size=3, **thread_options(workers))

    reference, delivered, state = interrupted_stream(make, 2)
    delivered_items = {v for batch in delivered for v in batch}

    fresh = make()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fresh.load_state_dict(state)
    assert not [w for w in record if issubclass(w.category, UserWarning)]
    dataset = fresh.dataset
    first = [batch.tolist() for batch in fresh]
    # No item before the resume point was made again: the stream iterators seeked.
    assert dataset.loads, "the stream iterators' load_state_dict was not called"
    assert not delivered_items & set(dataset.produced)
    assert sorted(dataset.produced) == sorted(set(range(14)) - delivered_items)
    assert delivered + first == reference[0]
    assert stream_epochs(fresh, 1) == reference[1:]
    stop(fresh)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["inline", "fork"])
def test_stream_with_dataset_state_resumes(kind: str) -> None:
    options: dict[str, Any] = {}
    if kind == "fork":
        options = {"num_workers": 2, "multiprocessing_context": "fork"}

    def make() -> Loader:
        return ferry.DataLoader(rd.PositionedStream(13), batch_size=2, **options)

    reference = stream_epochs(make(), 2)
    loader = make()
    iterator = iter(loader)
    delivered = [next(iterator).tolist() for _ in range(3)]
    state = round_trip(loader.state_dict())
    del iterator
    assert any(w["snapshot"]["dataset"] is not None for w in state["workers"])

    fresh = make()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fresh.load_state_dict(state)
    assert not [w for w in record if "fast-forwards" in str(w.message)]
    got = stream_epochs(fresh, 2)
    stop(fresh)
    assert [delivered + got[0], got[1]] == reference
    if kind == "inline":
        # Resumed at the dataset's position: the 6 delivered items were not made again.
        assert fresh.dataset.produced[:7] == list(range(6, 13))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dataset", ["stateless", "stateful_iterator"])
def test_sharded_stream_resumes_with_the_same_worker_count(dataset: str) -> None:
    def make() -> Loader:
        data = rd.Stream(15) if dataset == "stateless" else rd.StatefulStream(15)
        return ferry.DataLoader(data, batch_size=2, num_workers=2, multiprocessing_context="fork")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (a stateless stream is replayed)
        assert_resumes_exactly(lambda seed: make(), at=3, epochs=2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("other", [0, 1, 3])
def test_sharded_stream_refuses_another_worker_count(other: int) -> None:
    loader: Loader = ferry.DataLoader(rd.StatefulStream(15), batch_size=2, **thread_options(2))
    iterator = iter(loader)
    take(iterator, 3)
    state = round_trip(loader.state_dict())
    del iterator
    fresh: Loader = ferry.DataLoader(rd.StatefulStream(15), batch_size=2, **thread_options(other))
    with pytest.raises(ValueError, match=rf"num_workers=2.*num_workers={other}"):
        fresh.load_state_dict(state)
    # The failed load left nothing behind: the loader starts a fresh epoch.
    assert sorted(v for b in fresh for v in b.tolist()) == list(range(15))
    stop(fresh)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stop_at", [1, 2, 3])
@pytest.mark.parametrize("other", [0, 1, 3])
def test_per_shard_state_resumes_with_another_worker_count(stop_at: int, other: int) -> None:
    loader: Loader = ferry.DataLoader(rd.ShardedStream(), batch_size=2, **thread_options(2))
    iterator = iter(loader)
    delivered = [v for _ in range(stop_at) for v in next(iterator).tolist()]
    state = round_trip(loader.state_dict())
    del iterator

    fresh: Loader = ferry.DataLoader(rd.ShardedStream(), batch_size=2, **thread_options(other))
    fresh.load_state_dict(state)
    rest = [v for b in fresh for v in b.tolist()]
    assert sorted(delivered + rest) == rd.all_shard_items()  # every item exactly once
    assert sorted(v for b in fresh for v in b.tolist()) == rd.all_shard_items()  # next epoch
    stop(fresh)


# -- map-style: another number of workers --------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        (Kind("fork"), Kind("thread")),
        (Kind("thread"), Kind("fork")),
    ],
    ids=str,
)
@pytest.mark.parametrize("load_workers", [0, 3])
def test_map_style_resumes_with_another_worker_count(
    saved: Kind, loaded: Kind, load_workers: int
) -> None:
    def make(seed: int, workers: int, kind: Kind) -> Loader:
        options = kind.kwargs if workers else {}
        return ferry.DataLoader(
            rd.Ints(11),
            batch_size=2,
            shuffle=True,
            generator=gen(seed),
            num_workers=workers,
            **options,
        )

    reference = epochs(make(1, 0, saved), 3)
    loader = make(1, 2, saved)
    iterator = iter(loader)
    delivered = take(iterator, 3)
    state = round_trip(loader.state_dict())
    del iterator
    assert state["loader"]["num_workers"] == 2
    got = resumed_epochs(make(2, load_workers, loaded), state, 3)
    assert [delivered + got[0], *got[1:]] == reference


@pytest.mark.timeout(60)
def test_map_style_dataset_with_state_needs_the_same_worker_count() -> None:
    def make(seed: int, workers: int) -> Loader:
        return ferry.DataLoader(
            rd.Counted(12),
            batch_size=2,
            shuffle=True,
            generator=gen(seed),
            num_workers=workers,
            multiprocessing_context="fork",
        )

    # The same count resumes each worker's dataset state: the fetch counts go on.
    run = assert_resumes_exactly(lambda seed: make(seed, 2), at=3, epochs=2)
    with pytest.raises(ValueError, match=r"num_workers=2.*num_workers=1"):
        make(2, 1).load_state_dict(run.state)


# -- persistent workers and start methods --------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("edge", ["mid_epoch", "between_epochs"])
def test_persistent_workers_resume_with_their_generators(edge: str) -> None:
    def make(seed: int) -> Loader:
        return ferry.DataLoader(
            rd.Augmented(8),
            batch_size=2,
            shuffle=True,
            generator=gen(seed),
            num_workers=2,
            multiprocessing_context="fork",
            persistent_workers=True,
        )

    reference_loader = make(1)
    reference = epochs(reference_loader, 3)
    stop(reference_loader)

    loader = make(1)
    try:
        epochs(loader, 1)
        delivered: list[Any] = []
        if edge == "mid_epoch":
            iterator = iter(loader)
            delivered = take(iterator, 3)
        state = round_trip(loader.state_dict())
        if edge == "between_epochs":
            iterator = iter(loader)

        fresh = make(2)
        got = resumed_epochs(fresh, state, 2)
        assert [delivered + got[0], got[1]] == reference[1:]

        # Loading into the same loader, whose persistent workers are live (and have moved
        # on since the state was taken), resumes at the state as well.
        assert delivered + epoch_of(iterator) == reference[1]
        loader.load_state_dict(state)
        assert epochs(loader, 2) == got
    finally:
        stop(loader)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", PROCESSES, indirect=True)
@pytest.mark.slow
def test_each_start_method_restores_worker_generators(kind: Kind) -> None:
    """Interrupted with fork workers, resumed in the "new process" with ``kind`` workers (spawn
    and forkserver import the dataset by reference: module level in resume.datasets)."""

    def make(seed: int, options: dict[str, Any]) -> Loader:
        return ferry.DataLoader(
            rd.Augmented(6),
            batch_size=2,
            shuffle=True,
            generator=gen(seed),
            num_workers=2,
            persistent_workers=True,
            **options,
        )

    assert_resumes_exactly(
        lambda seed: make(seed, {"multiprocessing_context": "fork"}),
        resume_with=lambda seed: make(seed, kind.kwargs),
        at=2,
        epochs=2,
    )


# -- refused states ------------------------------------------------------------------------------


def valid_state() -> dict[str, Any]:
    loader: Loader = ferry.DataLoader(rd.Ints(10), batch_size=3, shuffle=True, generator=gen(1))
    iterator = iter(loader)
    next(iterator)
    return round_trip(loader.state_dict())


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("build", "match"),
    [
        (
            lambda: ferry.DataLoader(rd.Ints(11), batch_size=3, shuffle=True),
            r"dataset_length: the state has 10, this loader has 11",
        ),
        (
            lambda: ferry.DataLoader(rd.Ints(10), batch_size=4, shuffle=True),
            r"batch_size: the state has 3, this loader has 4",
        ),
        (
            lambda: ferry.DataLoader(rd.Ints(10), batch_size=3, shuffle=False),
            r"sampler: the state has 'RandomSampler', this loader has 'SequentialSampler'",
        ),
        (
            lambda: ferry.DataLoader(rd.Ints(10), batch_size=3, sampler=rd.FixedOrder(10)),
            r"sampler: the state has 'RandomSampler', this loader has 'FixedOrder'",
        ),
        (
            lambda: ferry.DataLoader(rd.Ints(10), batch_size=3, shuffle=True, drop_last=True),
            r"drop_last: the state has False, this loader has True",
        ),
        (
            lambda: ferry.DataLoader(rd.Stream(10), batch_size=3),
            r"dataset: the state has 'map', this loader has 'iterable'",
        ),
    ],
    ids=["dataset_length", "batch_size", "sampler", "user_sampler", "drop_last", "iterable"],
)
def test_state_of_another_loader_is_refused(build: Callable[[], Loader], match: str) -> None:
    loader = build()
    with pytest.raises(ValueError, match=match):
        loader.load_state_dict(valid_state())


@pytest.mark.timeout(30)
def test_state_of_another_batch_size_says_it_does_not_fit() -> None:
    # A well-formed state from a loader built otherwise is a mismatch, not a damaged state:
    # the message's whole first sentence says so, naming what differs on both sides.
    loader = ferry.DataLoader(rd.Ints(10), batch_size=4, shuffle=True)
    with pytest.raises(ValueError) as refused:
        loader.load_state_dict(valid_state())
    first_sentence = str(refused.value).split(". ", 1)[0] + "."
    assert first_sentence == (
        "DataLoader state does not fit this loader: it was saved from a loader with other data "
        "or options (batch_size: the state has 3, this loader has 4)."
    )
    assert "malformed" not in str(refused.value)


def _set(path: tuple[str, ...], value: Any) -> Callable[[dict[str, Any]], Any]:
    def change(state: dict[str, Any]) -> Any:
        target = state
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return state

    return change


def _delete(key: str) -> Callable[[dict[str, Any]], Any]:
    def change(state: dict[str, Any]) -> Any:
        del state[key]
        return state

    return change


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s: [s], r"expects the dict"),
        (lambda s: None, r"expects the dict"),
        (json.dumps, r"expects the dict"),
        (_set(("format",), "torchdata.StatefulDataLoader"), r"'format'"),
        (_delete("format"), r"'format'"),
        (_set(("version",), 99), r"version 99"),
        (_delete("epoch"), r"malformed"),
        (_delete("loader"), r"malformed"),
        (_delete("workers"), r"malformed"),
        (_set(("workers",), 5), r"malformed"),
        (_set(("workers",), [{}, {}, {}]), r"malformed"),
        (_set(("epoch", "keys"), None), r"malformed"),
        (_set(("epoch", "keys", "kind"), "bogus"), r"unknown sampler kind"),
        (_set(("epoch", "position"), -1), r"malformed"),
        (_set(("epoch", "ahead"), 5), r"malformed"),
        (_set(("epoch", "generator"), 5), r"malformed"),
    ],
    ids=[
        "list",
        "none",
        "json_text",
        "format",
        "no_format",
        "version",
        "no_epoch",
        "no_loader",
        "no_workers",
        "workers_not_a_list",
        "too_many_workers",
        "keys_none",
        "unknown_kind",
        "negative_position",
        "ahead_not_a_list",
        "generator_not_a_string",
    ],
)
def test_malformed_state_is_refused(change: Callable[[dict[str, Any]], Any], match: str) -> None:
    reference = epoch_of(
        iter(ferry.DataLoader(rd.Ints(10), batch_size=3, shuffle=True, generator=gen(1)))
    )
    loader: Loader = ferry.DataLoader(rd.Ints(10), batch_size=3, shuffle=True, generator=gen(1))
    bad = change(copy.deepcopy(valid_state()))
    with pytest.raises(ValueError, match=match):
        loader.load_state_dict(bad)
    # Nothing of the refused state was kept: the loader begins its first epoch afresh.
    assert epoch_of(iter(loader)) == reference


@pytest.mark.parametrize("every", [-1, -3])
def test_snapshot_every_n_steps_must_not_be_negative(every: int) -> None:
    with pytest.raises(ValueError, match=rf"snapshot_every_n_steps.*got {every}"):
        ferry.DataLoader(rd.Ints(4), snapshot_every_n_steps=every)


# -- size ----------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["thread", "fork"], indirect=True)
def test_state_is_small_and_does_not_grow_with_the_dataset(kind: Kind) -> None:
    sizes = {}
    for n in (100, 1_000_000):
        loader: Loader = ferry.DataLoader(
            rd.Huge(n),
            batch_size=32,
            shuffle=True,
            generator=gen(1),
            num_workers=2,
            **kind.kwargs,
        )
        iterator = iter(loader)
        for _ in range(3):
            next(iterator)
        sizes[n] = len(json.dumps(loader.state_dict()))
        del iterator
    assert sizes[1_000_000] < 30_000
    assert sizes[1_000_000] - sizes[100] < 50  # a few more digits, nothing per sample
