"""Samplers are Stateful, as torchdata's are: ``state_dict()``/``load_state_dict()`` on the
sampler object describe and resume the iterations ``iter(sampler)`` makes.

For every random sampler, a state saved at any position (before iterating, mid-way, after the
end) and loaded into a fresh sampler built the same way gives the rest of the saved iteration
and then the same next iteration as an uninterrupted run; states survive ``torch.save`` and
``torch.load(weights_only=True)``; torchdata's formats resume as torchdata's samplers do; bad
states raise ``ValueError("Invalid state_dict ...")``; and a DataLoader over these samplers
still resumes exactly through its own state, treating them as built-in samplers.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler as TorchdataRandomSampler
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

import ferry
from _support.torch_versions import needs_torch
from ferry._engine.position.keys import builtin_source
from ferry.distributed import DistributedSampler

pytestmark = pytest.mark.usefixtures("guard_global_state")

SEED = 1234  # torch's global RNG, before every run
END = object()


def _gen(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(seed)


# Each case builds a sampler the same way every time it is called; ``setup`` runs on every
# sampler built (before iterating or loading), ``between`` before the iteration after the
# resumed one.
Make = Callable[[], Any]
Step = Callable[[Any], None]


def _nothing(sampler: Any) -> None:
    del sampler


def _epoch(epoch: int) -> Step:
    def set_epoch(sampler: Any) -> None:
        sampler.set_epoch(epoch)

    return set_epoch


def _cases() -> list[Any]:
    cases: list[Any] = []
    for gen in (7, None):
        tag = "gen" if gen is not None else "nogen"
        cases += [
            pytest.param(lambda g=gen: ferry.RandomSampler(range(7), generator=_gen(g)), id=tag),
            pytest.param(
                lambda g=gen: ferry.RandomSampler(range(5), num_samples=12, generator=_gen(g)),
                id=f"more-than-len-{tag}",
            ),
            pytest.param(
                lambda g=gen: ferry.RandomSampler(
                    range(5), replacement=True, num_samples=40, generator=_gen(g)
                ),
                id=f"replacement-{tag}",
            ),
            pytest.param(
                lambda g=gen: ferry.WeightedRandomSampler(
                    [0.5, 1.0, 2.0, 0.0, 3.0], 9, replacement=True, generator=_gen(g)
                ),
                id=f"weighted-replacement-{tag}",
            ),
            pytest.param(
                lambda g=gen: ferry.WeightedRandomSampler(
                    [0.5, 1.0, 2.0, 0.0, 3.0, 1.0], 4, replacement=False, generator=_gen(g)
                ),
                id=f"weighted-{tag}",
            ),
            pytest.param(
                lambda g=gen: ferry.SubsetRandomSampler([3, 9, 4, 12, 0, 8], generator=_gen(g)),
                id=f"subset-{tag}",
            ),
        ]
    return cases


def _distributed_cases() -> list[Any]:
    cases = []
    for shuffle in (True, False):
        for drop_last in (False, True):
            for rank in (0, 2):
                cases.append(
                    pytest.param(
                        lambda s=shuffle, d=drop_last, r=rank: DistributedSampler(
                            range(11), num_replicas=3, rank=r, shuffle=s, seed=5, drop_last=d
                        ),
                        id=f"shuffle={shuffle}-drop_last={drop_last}-rank={rank}",
                    )
                )
    cases.append(
        pytest.param(
            lambda: DistributedSampler(range(11), num_replicas=3, rank=2, pad=False), id="no-pad"
        )
    )
    return cases


def _build(make: Make, *steps: Step) -> Any:
    sampler = make()
    for step in steps:
        step(sampler)
    return sampler


def _iterations(make: Make, setup: Step, between: Step, count: int) -> list[list[Any]]:
    """``count`` uninterrupted iterations, ``between`` before each after the first."""
    torch.manual_seed(SEED)
    sampler = _build(make, setup)
    runs = []
    for i in range(count):
        if i:
            between(sampler)
        runs.append(list(sampler))
    return runs


def _saved_at(
    make: Make, setup: Step, between: Step, iteration: int, k: int | None
) -> tuple[dict[str, Any], torch.Tensor]:
    """The state after ``k`` indices of iteration ``iteration`` (None: before any ``iter()``),
    and torch's global RNG state when that iteration began."""
    torch.manual_seed(SEED)
    sampler = _build(make, setup)
    for _ in range(iteration):
        list(sampler)
        between(sampler)
    rng = torch.get_rng_state()
    if k is None:
        return sampler.state_dict(), rng
    it = iter(sampler)
    for _ in range(k):
        next(it)
    if k == len(sampler):
        assert next(it, END) is END  # exhausted: the state is taken after the end
    state = sampler.state_dict()
    assert state["yielded"] == k
    return state, rng


def _resumed(
    make: Make, steps: tuple[Step, ...], between: Step, state: Any, rng: torch.Tensor
) -> tuple[list[Any], list[Any]]:
    """A fresh sampler built with ``steps`` (as in a new process whose global RNG is where
    it was when the saved iteration began) that loads ``state`` (then runs the last step):
    the rest of the saved iteration, then the next one."""
    torch.set_rng_state(rng)
    sampler = _build(make, *steps[:-1])
    sampler.load_state_dict(state)
    steps[-1](sampler)
    rest = list(sampler)
    between(sampler)
    return rest, list(sampler)


def _check_every_position(
    make: Make,
    setup: Step = _nothing,
    between: Step = _nothing,
    resume_setup: Step | None = None,
    after_load: Step = _nothing,
) -> None:
    """Save at every position of the first iteration (and before it) and of the second,
    resume a fresh sampler and compare with an uninterrupted run.

    In the first iteration the fresh sampler is built with ``resume_setup`` (by default as
    the saved one was) and ``after_load`` runs once the state is loaded; in the second it is
    set up as the saved one was when that iteration began.
    """
    first, second, third = _iterations(make, setup, between, 3)
    n = len(first)
    assert n == len(make())
    built = setup if resume_setup is None else resume_setup
    for k in [None, *range(n + 1)]:
        state, rng = _saved_at(make, setup, between, 0, k)
        rest, following = _resumed(make, (built, after_load), between, state, rng)
        assert rest == first[k or 0 :], k
        assert following == second, k
    for k in range(n + 1):
        state, rng = _saved_at(make, setup, between, 1, k)
        rest, following = _resumed(make, (setup, between, _nothing), between, state, rng)
        assert rest == second[k:], k
        assert following == third, k


@pytest.mark.parametrize("make", _cases())
def test_resume_at_every_position(make: Make) -> None:
    _check_every_position(make)


@pytest.mark.parametrize("make", _distributed_cases())
@pytest.mark.parametrize(
    ("setup", "between", "resume_setup", "after_load"),
    [
        pytest.param(_nothing, _nothing, _nothing, _nothing, id="epoch-0"),
        pytest.param(_epoch(2), _nothing, _epoch(2), _nothing, id="epoch-2-again"),
        # Built without set_epoch: the state's epoch is the sampler's from then on.
        pytest.param(_epoch(2), _nothing, _nothing, _nothing, id="epoch-2-again-from-state"),
        pytest.param(_epoch(2), _epoch(3), _epoch(2), _nothing, id="epoch-2-then-3"),
        pytest.param(_epoch(2), _epoch(3), _nothing, _nothing, id="epoch-2-then-3-from-state"),
        # The loop sets the epoch it resumes after loading the state: still that epoch.
        pytest.param(_epoch(2), _epoch(3), _nothing, _epoch(2), id="set-epoch-after-load"),
    ],
)
def test_distributed_resume_at_every_position(
    make: Make, setup: Step, between: Step, resume_setup: Step, after_load: Step
) -> None:
    _check_every_position(make, setup, between, resume_setup, after_load)


def test_formats() -> None:
    torch.manual_seed(SEED)
    with_gen = ferry.RandomSampler(range(4), generator=_gen(0))
    before = with_gen.state_dict()
    assert set(before) == {"yielded", "generator"}
    assert before["yielded"] == 0
    assert before["generator"].dtype == torch.uint8
    assert torch.equal(before["generator"], torch.Generator().manual_seed(0).get_state())
    no_gen = ferry.RandomSampler(range(4))
    assert no_gen.state_dict() == {"yielded": 0}
    it = iter(no_gen)
    assert no_gen.state_dict() == {"yielded": 0}  # nothing drawn yet
    next(it)
    assert set(no_gen.state_dict()) == {"yielded", "seed"}
    assert isinstance(no_gen.state_dict()["seed"], int)
    subset = ferry.SubsetRandomSampler([1, 2, 3])
    next(iter(subset))
    assert set(subset.state_dict()) == {"yielded", "generator"}  # the global RNG's state
    dist = DistributedSampler(range(10), num_replicas=2, rank=1)
    dist.set_epoch(4)
    assert dist.state_dict() == {"yielded": 0, "epoch": 4, "num_replicas": 2, "done": 0}


def test_state_after_load_is_the_loaded_state_until_iter() -> None:
    sampler = ferry.RandomSampler(range(6), generator=_gen(1))
    it = iter(sampler)
    next(it), next(it)
    state = sampler.state_dict()
    fresh = ferry.RandomSampler(range(6), generator=_gen(1))
    fresh.load_state_dict(state)
    loaded = fresh.state_dict()
    assert loaded["yielded"] == 2
    assert torch.equal(loaded["generator"], state["generator"])
    # The iteration in progress is not disturbed: the state waits for the next iter().
    assert len(list(it)) == 4
    assert sampler.state_dict()["yielded"] == 6
    sampler.load_state_dict(state)
    assert sampler.state_dict()["yielded"] == 2
    assert list(sampler) == list(fresh)


def test_torch_save_weights_only_round_trip() -> None:
    for make in (
        lambda: ferry.RandomSampler(range(9), generator=_gen(3)),
        lambda: ferry.WeightedRandomSampler([1.0, 2.0, 3.0], 7, generator=_gen(3)),
        lambda: ferry.SubsetRandomSampler([5, 6, 7, 8], generator=_gen(3)),
        lambda: DistributedSampler(range(9), num_replicas=2, rank=1),
    ):
        torch.manual_seed(SEED)
        expected = list(make())
        torch.manual_seed(SEED)
        sampler = make()
        it = iter(sampler)
        next(it), next(it)
        buffer = io.BytesIO()
        torch.save(sampler.state_dict(), buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)
        fresh = make()
        fresh.load_state_dict(state)
        assert list(fresh) == expected[2:]


@needs_torch("2.5", "pickling a torch.Generator")
def test_pickle_and_deepcopy_mid_iteration() -> None:
    sampler = ferry.RandomSampler(range(50), generator=_gen(2))
    it = iter(sampler)
    for _ in range(7):
        next(it)
    for copied in (pickle.loads(pickle.dumps(sampler)), copy.deepcopy(sampler)):
        assert copied.state_dict()["yielded"] == 7
        assert torch.equal(copied.state_dict()["generator"], sampler.state_dict()["generator"])


def test_dropped_iteration_keeps_its_count() -> None:
    sampler = ferry.RandomSampler(range(100), generator=_gen(2))
    it = iter(sampler)
    for _ in range(5):
        next(it)
    del it  # the iteration is dropped: its count stays, its chunk is let go
    assert sampler.state_dict()["yielded"] == 5
    assert sampler._latest is not None
    assert sampler._latest.size == 0


# -- torchdata's formats, side by side with torchdata -------------------------------------------


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("epoch", [0, 3])
def test_distributed_matches_torchdata(shuffle: bool, drop_last: bool, epoch: int) -> None:
    def both() -> tuple[Any, Any]:
        args: dict[str, Any] = {"shuffle": shuffle, "seed": 9, "drop_last": drop_last}
        ours = DistributedSampler(range(10), 3, 1, **args)
        theirs = StatefulDistributedSampler(range(10), 3, 1, **args)
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        return ours, theirs

    ours, theirs = both()
    n = len(list(theirs))
    assert list(ours) == list(theirs)
    for k in range(n + 1):
        ours, theirs = both()
        ours_it, theirs_it = iter(ours), iter(theirs)
        for _ in range(k):
            assert next(ours_it) == next(theirs_it)
        assert ours.state_dict()["yielded"] == theirs.state_dict()["yielded"] == k
        theirs_state, our_state = theirs.state_dict(), ours.state_dict()
        ours, theirs = both()
        ours.load_state_dict(theirs_state)  # torchdata's {"yielded": k}
        theirs.load_state_dict(our_state)  # ours holds "yielded" too
        assert list(ours) == list(theirs)
        assert list(ours) == list(theirs)  # the next iteration: the whole epoch again


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"num_samples": 12}, {"replacement": True, "num_samples": 40}],
    ids=["permutation", "more-than-len", "replacement"],
)
def test_random_sampler_loads_torchdata_iterator_state(kwargs: dict[str, Any]) -> None:
    """torchdata's RandomSampler keeps its state in the iterator; with a generator given, it
    draws the same sequence, so its iterator's state resumes ours the same way."""
    theirs = TorchdataRandomSampler(range(5), generator=_gen(4), **kwargs)
    n = len(list(theirs))
    for k in range(n + 1):
        theirs = TorchdataRandomSampler(range(5), generator=_gen(4), **kwargs)
        ours = ferry.RandomSampler(range(5), generator=_gen(4), **kwargs)
        theirs_it, ours_it = iter(theirs), iter(ours)
        for _ in range(k):
            assert next(theirs_it) == next(ours_it)
        theirs_state = theirs_it.state_dict()
        our_state = ours.state_dict()
        assert our_state["yielded"] == theirs_state["yielded"] == k
        assert torch.equal(our_state["generator"], theirs_state["generator"])
        resumed = TorchdataRandomSampler(range(5), generator=_gen(4), **kwargs)
        resumed_it = iter(resumed)
        resumed_it.load_state_dict(theirs_state)
        ours = ferry.RandomSampler(range(5), generator=_gen(4), **kwargs)
        ours.load_state_dict(theirs_state)
        assert list(ours) == list(resumed_it)


def test_yielded_alone_skips_into_a_fresh_iteration() -> None:
    torch.manual_seed(SEED)
    expected = list(ferry.RandomSampler(range(8)))
    torch.manual_seed(SEED)
    sampler = ferry.RandomSampler(range(8))
    sampler.load_state_dict({"yielded": 3})
    assert list(sampler) == expected[3:]
    with_gen = ferry.RandomSampler(range(8), generator=_gen(5))
    with_gen.load_state_dict({"yielded": 3})
    assert list(with_gen) == list(ferry.RandomSampler(range(8), generator=_gen(5)))[3:]


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_torchdata_stateful_dataloader_resumes_over_our_samplers() -> None:
    """Code written for torchdata's stateful samplers: StatefulDataLoader checkpoints the
    sampler's own state (``sampler_state``) and resumes it."""
    data = list(range(20))
    for make in (
        lambda: ferry.RandomSampler(data, generator=_gen(3)),
        lambda: DistributedSampler(data, num_replicas=2, rank=1, seed=3),
    ):
        full = StatefulDataLoader(data, sampler=make(), batch_size=3)
        first, second = [b.tolist() for b in full], [b.tolist() for b in full]
        loader = StatefulDataLoader(data, sampler=make(), batch_size=3)
        it = iter(loader)
        head = [next(it).tolist() for _ in range(2)]
        state = loader.state_dict()
        resumed = StatefulDataLoader(data, sampler=make(), batch_size=3)
        resumed.load_state_dict(state)
        assert head + [b.tolist() for b in resumed] == first
        assert [b.tolist() for b in resumed] == second


# -- bad states ---------------------------------------------------------------------------------


def _bad_states() -> list[Any]:
    random = lambda: ferry.RandomSampler(range(5), generator=_gen(0))  # noqa: E731
    subset = lambda: ferry.SubsetRandomSampler([1, 2])  # noqa: E731
    dist = lambda: DistributedSampler(range(10), num_replicas=2, rank=0)  # noqa: E731
    good = torch.Generator().get_state()
    return [
        pytest.param(random, {}, "'yielded'", id="missing-yielded"),
        pytest.param(random, {"generator": good}, "'yielded'", id="only-generator"),
        pytest.param(random, {"yielded": -1}, "'yielded'", id="negative"),
        pytest.param(random, {"yielded": "3"}, "'yielded'", id="str"),
        pytest.param(random, {"yielded": 1.0}, "'yielded'", id="float"),
        pytest.param(random, {"yielded": True}, "'yielded'", id="bool"),
        pytest.param(random, {"yielded": 6}, "'yielded' is 6", id="past-the-end"),
        pytest.param(random, {"yielded": 1, "extra": 0}, "'extra'", id="unknown-key"),
        pytest.param(random, [("yielded", 1)], "dict", id="not-a-dict"),
        pytest.param(random, {"yielded": 1, "generator": b"x"}, "'generator'", id="bytes"),
        pytest.param(
            random, {"yielded": 1, "generator": good.float()}, "'generator'", id="float-tensor"
        ),
        pytest.param(random, {"yielded": 1, "generator": good[:10]}, "'generator'", id="short"),
        pytest.param(
            random, {"yielded": 1, "generator": good, "seed": 1}, "'seed'", id="seed-and-gen"
        ),
        pytest.param(random, {"yielded": 1, "seed": "1"}, "'seed'", id="str-seed"),
        pytest.param(subset, {"yielded": 1, "seed": 1}, "'seed'", id="seed-on-subset"),
        pytest.param(dist, {"yielded": 1, "num_replicas": 2}, "'epoch'", id="no-epoch"),
        pytest.param(dist, {"yielded": 1, "epoch": 0, "num_replicas": 0}, "'num_replicas'"),
        pytest.param(dist, {"yielded": 1, "epoch": 0, "done": -2}, "'done'", id="neg-done"),
        pytest.param(dist, {"yielded": 6}, "'yielded' is 6", id="dist-past-the-end"),
        pytest.param(dist, {"yielded": 1, "generator": good}, "'generator'", id="dist-gen"),
    ]


@pytest.mark.parametrize(("make", "state", "names"), _bad_states())
def test_bad_states_raise_value_error(make: Make, state: Any, names: str) -> None:
    sampler = make()
    with pytest.raises(ValueError, match="Invalid state_dict") as raised:
        sampler.load_state_dict(state)
    assert names in str(raised.value)
    assert sampler.state_dict()["yielded"] == 0  # nothing was loaded


def test_missing_yielded_raises_as_torchdata_does() -> None:
    with pytest.raises(ValueError, match="Invalid state_dict"):
        StatefulDistributedSampler(range(4), num_replicas=1, rank=0).load_state_dict({})
    with pytest.raises(ValueError, match="Invalid state_dict"):
        DistributedSampler(range(4), num_replicas=1, rank=0).load_state_dict({})


# -- DistributedSampler specifics ---------------------------------------------------------------


def test_distributed_state_sets_the_epoch_and_set_epoch_moves_on() -> None:
    sampler = DistributedSampler(range(12), num_replicas=2, rank=0)
    sampler.set_epoch(5)
    it = iter(sampler)
    next(it), next(it)
    state = sampler.state_dict()
    resumed = DistributedSampler(range(12), num_replicas=2, rank=0)
    resumed.load_state_dict(state)
    assert resumed.epoch == 5
    resumed.set_epoch(6)  # the loop moved on: epoch 6 starts afresh
    fresh = DistributedSampler(range(12), num_replicas=2, rank=0)
    fresh.set_epoch(6)
    assert list(resumed) == list(fresh)


def test_distributed_state_loads_with_another_world_size() -> None:
    """Every old rank saved after 3 indices; the new ranks share the unseen rest exactly once."""
    old = [DistributedSampler(range(20), num_replicas=2, rank=r, seed=1) for r in range(2)]
    seen = []
    for sampler in old:
        sampler.set_epoch(1)
        it = iter(sampler)
        seen += [next(it) for _ in range(3)]
    states = [sampler.state_dict() for sampler in old]
    rest = []
    for rank in range(3):
        new = DistributedSampler(range(20), num_replicas=3, rank=rank, seed=1)
        new.load_state_dict(states[rank % 2])
        rest += list(new)
    assert sorted(seen + rest) == list(range(20))


# -- inside a DataLoader -------------------------------------------------------------------------


def _loader_cases() -> list[Any]:
    data = list(range(23))
    return [
        pytest.param(lambda: ferry.RandomSampler(data, generator=_gen(1)), id="random"),
        pytest.param(lambda: ferry.RandomSampler(data), id="random-nogen"),
        pytest.param(
            lambda: ferry.RandomSampler(data, replacement=True, num_samples=40, generator=_gen(1)),
            id="random-replacement",
        ),
        pytest.param(
            lambda: ferry.WeightedRandomSampler(torch.rand(23, generator=_gen(0)), 17, False),
            id="weighted-nogen",
        ),
        pytest.param(
            lambda: ferry.WeightedRandomSampler([1.0] * 23, 30, generator=_gen(1)), id="weighted"
        ),
        pytest.param(
            lambda: ferry.SubsetRandomSampler(list(range(3, 23)), generator=_gen(1)), id="subset"
        ),
        pytest.param(lambda: ferry.SubsetRandomSampler(list(range(3, 23))), id="subset-nogen"),
        pytest.param(lambda: DistributedSampler(data, num_replicas=2, rank=1), id="distributed"),
    ]


@pytest.mark.parametrize("make", _loader_cases())
def test_dataloader_resumes_through_its_own_state(make: Make) -> None:
    data = list(range(23))

    def loader(sampler: Any) -> ferry.DataLoader[Any]:
        return ferry.DataLoader(data, sampler=sampler, batch_size=3)

    torch.manual_seed(SEED)
    sampler = make()
    uninterrupted = loader(sampler)
    assert builtin_source(uninterrupted.sampler, uninterrupted.batch_sampler) is sampler
    first = [b.tolist() for b in uninterrupted]
    second = [b.tolist() for b in uninterrupted]
    # The loader drives the sampler itself: iter(sampler) was never called.
    assert sampler.state_dict()["yielded"] == 0
    for stop in (1, len(first) // 2):
        torch.manual_seed(SEED)
        interrupted = loader(make())
        it = iter(interrupted)
        head = [next(it).tolist() for _ in range(stop)]
        state = interrupted.state_dict()
        torch.manual_seed(SEED)
        resumed = loader(make())
        resumed.load_state_dict(state)
        assert head + [b.tolist() for b in resumed] == first
        assert [b.tolist() for b in resumed] == second


class _Reversed(DistributedSampler):
    """A user's subclass that iterates its own way (as many DistributedSampler subclasses do)."""

    def __iter__(self) -> Any:
        return iter(range(len(self.dataset) - 1 - self.rank, -1, -self.num_replicas))


class _ReversedWithState(_Reversed):
    def state_dict(self) -> dict[str, Any]:
        return {"mine": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


def test_subclass_overriding_iter_has_no_state_of_ours() -> None:
    """ferry's state describes ferry's iterations: a subclass with its own ``__iter__`` has
    none (unless it defines one), so the loader still fast-forwards it as before."""
    sampler = _Reversed(range(10), num_replicas=2, rank=0)
    assert not hasattr(sampler, "state_dict")
    assert not hasattr(sampler, "load_state_dict")
    with pytest.raises(AttributeError, match="_Reversed has no state_dict: it overrides __iter__"):
        sampler.state_dict()
    own = _ReversedWithState(range(10), num_replicas=2, rank=0)
    assert own.state_dict() == {"mine": 1}
    assert hasattr(ferry.RandomSampler(range(3)), "state_dict")  # ferry's own are untouched

    def loader() -> ferry.DataLoader[Any]:
        return ferry.DataLoader(list(range(10)), sampler=_Reversed(range(10), 2, 0), batch_size=2)

    assert [b.tolist() for b in loader()] == [[9, 7], [5, 3], [1]]
    interrupted = loader()
    it = iter(interrupted)
    next(it), next(it)
    resumed = loader()
    resumed.load_state_dict(interrupted.state_dict())
    assert [b.tolist() for b in resumed] == [[1]]
