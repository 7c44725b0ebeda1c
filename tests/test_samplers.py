"""Samplers: the same keys as torch's samplers for the same arguments and RNG state, epoch
after epoch, and the same generator/global-RNG state left behind; the tensor-chunk fast path
(``index_chunks``/``index_batches``) yields exactly what iterating yields."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from hypothesis import given
from hypothesis import strategies as st

import ferry
from _support.compare import HYPOTHESIS, MODULES, Raised, assert_same_outcome, outcome
from ferry._sampler_keys import index_batches, index_chunks

pytestmark = pytest.mark.usefixtures("guard_global_state")


def _gen(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(seed)


def _epochs(
    make: Callable[[Any, torch.Generator | None], Any], seed: int, gen_seed: int | None, n: int
) -> list[Any]:
    """For each library: build the sampler, iterate it ``n`` times, then record a draw from the
    sampler's generator (if any) and from the global RNG."""
    results = []
    for module in MODULES:
        torch.manual_seed(seed)
        generator = _gen(gen_seed)

        def run(module: Any = module, generator: torch.Generator | None = generator) -> Any:
            sampler = make(module, generator)
            passes = [list(sampler) for _ in range(n)]
            after = None if generator is None else torch.rand(1, generator=generator)
            return passes, len(sampler), after, torch.rand(1)

        results.append(outcome(run))
    return results


def _assert_same_epochs(make: Callable[[Any, Any], Any], seed: int, gen_seed: int | None) -> None:
    expected, got = _epochs(make, seed, gen_seed, 3)
    assert_same_outcome(expected, got, "sampler epochs")


seeds = st.integers(0, 2**32)
gen_seeds = st.none() | st.integers(0, 2**32)


@HYPOTHESIS
@given(n=st.integers(0, 40), seed=seeds)
def test_sequential_sampler_matches_torch(n: int, seed: int) -> None:
    _assert_same_epochs(lambda m, g: m.SequentialSampler(range(n)), seed, None)


@HYPOTHESIS
@given(
    n=st.integers(0, 40),
    replacement=st.booleans(),
    num_samples=st.none() | st.integers(1, 100),
    seed=seeds,
    gen_seed=gen_seeds,
)
def test_random_sampler_matches_torch(
    n: int, replacement: bool, num_samples: int | None, seed: int, gen_seed: int | None
) -> None:
    _assert_same_epochs(
        lambda m, g: m.RandomSampler(range(n), replacement, num_samples, g), seed, gen_seed
    )


@pytest.mark.parametrize("num_samples", [None, 5, 10, 15])
def test_random_sampler_with_generator_reshuffles_like_torch_every_epoch(
    num_samples: int | None,
) -> None:
    """Without replacement and with ``num_samples`` a multiple of the dataset's length (the
    default is exactly the length) torch still draws one more, unused permutation at the end
    of each epoch; the next epoch's order depends on it."""
    _assert_same_epochs(lambda m, g: m.RandomSampler(range(5), False, num_samples, g), 0, 7)


def test_shuffled_loader_with_generator_matches_torch_in_the_second_epoch() -> None:
    passes = []
    for module in MODULES:
        generator = torch.Generator().manual_seed(0)
        loader = module.DataLoader(list(range(7)), batch_size=3, shuffle=True, generator=generator)
        passes.append([[b.tolist() for b in loader] for _ in range(2)])
    assert passes[0] == passes[1]


@HYPOTHESIS
@given(indices=st.lists(st.integers(-50, 50), max_size=30), seed=seeds, gen_seed=gen_seeds)
def test_subset_random_sampler_matches_torch(
    indices: list[int], seed: int, gen_seed: int | None
) -> None:
    _assert_same_epochs(lambda m, g: m.SubsetRandomSampler(indices, g), seed, gen_seed)


def test_subset_random_sampler_yields_the_given_keys() -> None:
    keys = ["a", "b", "c", "d"]
    sampler = ferry.SubsetRandomSampler(keys, generator=torch.Generator().manual_seed(3))
    drawn = list(sampler)
    assert sorted(drawn) == keys
    assert len(sampler) == 4


weights_strategy = st.lists(
    st.floats(0, 10, allow_nan=False) | st.integers(0, 5), min_size=1, max_size=20
)


@HYPOTHESIS
@given(
    weights=weights_strategy,
    num_samples=st.integers(1, 30),
    replacement=st.booleans(),
    as_tensor=st.booleans(),
    seed=seeds,
    gen_seed=gen_seeds,
)
def test_weighted_random_sampler_matches_torch(
    *,
    weights: list[float],
    num_samples: int,
    replacement: bool,
    as_tensor: bool,
    seed: int,
    gen_seed: int | None,
) -> None:
    source: Any = torch.tensor(weights, dtype=torch.float32) if as_tensor else weights
    _assert_same_epochs(
        lambda m, g: m.WeightedRandomSampler(source, num_samples, replacement, g), seed, gen_seed
    )


def _inner_sampler(kind: str, module: Any, n: int, generator: Any) -> Any:
    if kind == "sequential":
        return module.SequentialSampler(range(n))
    if kind == "random":
        return module.RandomSampler(range(n), generator=generator)
    if kind == "random_replacement":
        return module.RandomSampler(range(n), True, 2 * n + 3, generator)
    if kind == "weighted":
        return module.WeightedRandomSampler([1.0] * n, n, True, generator)
    if kind == "subset":
        return module.SubsetRandomSampler(list(range(0, 2 * n, 2)), generator)
    if kind == "range":
        return range(n)
    if kind == "list":
        return [f"k{i}" for i in range(n)]
    if kind == "torch_random":
        return tud.RandomSampler(range(n), generator=generator)
    raise AssertionError(kind)


inner_kinds = st.sampled_from(
    [
        "sequential",
        "random",
        "random_replacement",
        "weighted",
        "subset",
        "range",
        "list",
        "torch_random",
    ]
)


@HYPOTHESIS
@given(
    kind=inner_kinds,
    n=st.integers(1, 40),
    batch_size=st.integers(1, 12),
    drop_last=st.booleans(),
    seed=seeds,
    gen_seed=gen_seeds,
)
def test_batch_sampler_matches_torch(
    *, kind: str, n: int, batch_size: int, drop_last: bool, seed: int, gen_seed: int | None
) -> None:
    _assert_same_epochs(
        lambda m, g: m.BatchSampler(_inner_sampler(kind, m, n, g), batch_size, drop_last),
        seed,
        gen_seed,
    )


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((range(5), 2), {}), ((range(5), 2, False, 3), {}), ((range(5), 2, False), {"foo": 1})],
    ids=["missing", "too-many", "unknown-keyword"],
)
def test_batch_sampler_called_wrongly_fails_in_torchs_words(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    messages = []
    for module in (tud, ferry):
        with pytest.raises(TypeError) as caught:
            module.BatchSampler(*args, **kwargs)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]


def test_batch_sampler_over_a_one_shot_iterator() -> None:
    batches = [list(m.BatchSampler(iter(range(7)), 3, False)) for m in MODULES]
    assert batches[0] == batches[1] == [[0, 1, 2], [3, 4, 5], [6]]


@pytest.mark.parametrize(("drop_last", "expected"), [(False, 4), (True, 3)])
def test_batch_sampler_len(drop_last: bool, expected: int) -> None:
    assert len(ferry.BatchSampler(range(10), 3, drop_last)) == expected
    assert len(tud.BatchSampler(range(10), 3, drop_last)) == expected


def test_batch_sampler_len_needs_a_sized_sampler() -> None:
    for module in MODULES:
        with pytest.raises(TypeError):
            len(module.BatchSampler(iter(range(3)), 2, False))


# -- the tensor-chunk fast path ------------------------------------------------------------------


def _chunked(sampler: Any) -> list[int]:
    chunks = index_chunks(sampler)
    assert chunks is not None
    out = []
    for chunk in chunks:
        assert chunk.dtype == torch.int64
        assert chunk.dim() == 1
        out.extend(chunk.tolist())
    return out


@HYPOTHESIS
@given(
    kind=st.sampled_from(["sequential", "random", "random_replacement", "weighted"]),
    n=st.integers(1, 70),
    batch_size=st.integers(1, 40),
    drop_last=st.booleans(),
    gen_seed=st.integers(0, 2**32),
)
def test_index_batches_equal_iteration(
    kind: str, n: int, batch_size: int, drop_last: bool, gen_seed: int
) -> None:
    plain_gen, fast_gen = _gen(gen_seed), _gen(gen_seed)
    plain = ferry.BatchSampler(_inner_sampler(kind, ferry, n, plain_gen), batch_size, drop_last)
    fast = ferry.BatchSampler(_inner_sampler(kind, ferry, n, fast_gen), batch_size, drop_last)
    batches = index_batches(fast)
    assert batches is not None
    fast_batches = [b.tolist() for b in batches]
    assert fast_batches == list(plain)
    assert_same_outcome(torch.rand(1, generator=plain_gen), torch.rand(1, generator=fast_gen))
    plain_chunks = _inner_sampler(kind, ferry, n, _gen(gen_seed))
    assert _chunked(plain_chunks) == list(_inner_sampler(kind, ferry, n, _gen(gen_seed)))


def test_index_chunks_draw_nothing_until_asked() -> None:
    torch.manual_seed(0)
    chunks = index_chunks(ferry.RandomSampler(range(10)))
    assert chunks is not None
    after_creation = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(after_creation, torch.rand(1))


def test_index_chunks_refuse_unknown_samplers() -> None:
    class Reversed(ferry.SequentialSampler):
        def __iter__(self) -> Any:
            return iter(reversed(range(len(self.data_source))))

    assert index_chunks(Reversed(range(3))) is None
    assert index_chunks(tud.SequentialSampler(range(3))) is None
    assert index_chunks(ferry.SubsetRandomSampler([1, 2])) is None
    assert index_batches(ferry.BatchSampler(Reversed(range(3)), 2, False)) is None
    # torch's exact BatchSampler is a record ferry batches itself, as it batches its own.
    record = tud.BatchSampler(ferry.SequentialSampler(range(3)), 2, False)
    batches = index_batches(record)
    assert batches is not None
    assert [b.tolist() for b in batches] == list(record)
    assert index_batches(tud.BatchSampler(Reversed(range(3)), 2, False)) is None
    assert index_batches(ferry.SequentialSampler(range(3))) is None

    class OwnBatches(ferry.BatchSampler):
        def __iter__(self) -> Any:
            yield [0]

    assert index_batches(OwnBatches(ferry.SequentialSampler(range(3)), 2, False)) is None


# -- the global RNG ------------------------------------------------------------------------------


@pytest.mark.parametrize("take", [0, 1, 5])
def test_random_sampler_draws_its_seed_from_the_global_rng_like_torch(take: int) -> None:
    draws = []
    for module in MODULES:
        torch.manual_seed(11)
        iterator = iter(module.RandomSampler(range(10)))
        head = list(itertools.islice(iterator, take))
        draws.append((head, torch.rand(1)))
    assert_same_outcome(draws[0], draws[1])


# -- validation ----------------------------------------------------------------------------------

INVALID = [
    ("random replacement=1", lambda m: m.RandomSampler(range(3), replacement=1)),
    ("random replacement=None", lambda m: m.RandomSampler(range(3), replacement=None)),
    ("random num_samples=0", lambda m: m.RandomSampler(range(3), num_samples=0)),
    ("random num_samples=-1", lambda m: m.RandomSampler(range(3), num_samples=-1)),
    ("random num_samples=1.5", lambda m: m.RandomSampler(range(3), num_samples=1.5)),
    ("random num_samples='2'", lambda m: m.RandomSampler(range(3), num_samples="2")),
    ("random empty dataset", lambda m: m.RandomSampler(range(0))),
    ("random unsized", lambda m: m.RandomSampler(iter(range(3)))),
    ("weighted num_samples=0", lambda m: m.WeightedRandomSampler([1.0], 0)),
    ("weighted num_samples=True", lambda m: m.WeightedRandomSampler([1.0], True)),
    ("weighted num_samples=2.0", lambda m: m.WeightedRandomSampler([1.0], 2.0)),
    ("weighted replacement=0", lambda m: m.WeightedRandomSampler([1.0], 1, replacement=0)),
    ("weighted 2-d weights", lambda m: m.WeightedRandomSampler([[1.0, 2.0]], 1)),
    ("weighted 0-d weights", lambda m: m.WeightedRandomSampler(torch.tensor(1.0), 1)),
    ("weighted str weights", lambda m: m.WeightedRandomSampler("ab", 1)),
    ("batch batch_size=0", lambda m: m.BatchSampler(range(3), 0, False)),
    ("batch batch_size=-2", lambda m: m.BatchSampler(range(3), -2, False)),
    ("batch batch_size=True", lambda m: m.BatchSampler(range(3), True, False)),
    ("batch batch_size=2.0", lambda m: m.BatchSampler(range(3), 2.0, False)),
    ("batch batch_size=None", lambda m: m.BatchSampler(range(3), None, False)),
    ("batch drop_last=1", lambda m: m.BatchSampler(range(3), 2, 1)),
    ("batch drop_last=None", lambda m: m.BatchSampler(range(3), 2, None)),
]


@pytest.mark.parametrize(("label", "build"), INVALID, ids=[label for label, _ in INVALID])
def test_invalid_arguments_raise_like_torch(label: str, build: Callable[[Any], Any]) -> None:
    expected, got = outcome(lambda: build(tud)), outcome(lambda: build(ferry))
    assert isinstance(expected, Raised), f"torch accepted {label}"
    assert_same_outcome(expected, got, label)


@pytest.mark.parametrize(
    ("build", "option"),
    [
        (lambda: ferry.RandomSampler(range(3), replacement=1), "replacement"),
        (lambda: ferry.RandomSampler(range(3), num_samples=0), "num_samples"),
        (lambda: ferry.RandomSampler([]), "num_samples"),
        (lambda: ferry.WeightedRandomSampler([1.0], -1), "num_samples"),
        (lambda: ferry.WeightedRandomSampler([1.0], 1, replacement="no"), "replacement"),
        (lambda: ferry.WeightedRandomSampler([[1.0]], 1), "weights"),
        (lambda: ferry.BatchSampler(range(3), 0, False), "batch_size"),
        (lambda: ferry.BatchSampler(range(3), 1, "no"), "drop_last"),
    ],
)
def test_error_messages_name_the_option(build: Callable[[], Any], option: str) -> None:
    with pytest.raises((TypeError, ValueError), match=option):
        build()


@pytest.mark.parametrize(
    "build",
    [
        lambda m: list(m.RandomSampler(range(0), num_samples=3)),
        lambda m: list(m.RandomSampler(range(0), replacement=True, num_samples=3)),
        lambda m: list(m.WeightedRandomSampler([1.0, 0.0], 2, replacement=False)),
        lambda m: list(m.WeightedRandomSampler([-1.0, 2.0], 2)),
        lambda m: list(m.WeightedRandomSampler([0.0, 0.0], 2)),
        lambda m: list(m.SubsetRandomSampler([1, 2], generator=3)),
    ],
)
def test_edge_cases_while_iterating_match_torch(build: Callable[[Any], Any]) -> None:
    expected, got = outcome(lambda: build(tud)), outcome(lambda: build(ferry))
    assert_same_outcome(expected, got)


def test_sampler_base_requires_iter() -> None:
    for module in MODULES:
        sampler = module.Sampler()
        with pytest.raises(NotImplementedError):
            iter(sampler)


def test_sampler_base_accepts_and_ignores_data_source_as_the_spec_says() -> None:
    """The spec documents ``Sampler(data_source=None)`` (an unused argument kept for old
    subclasses that call ``super().__init__(data_source)``); ferry warns that it is ignored."""
    with pytest.warns(UserWarning, match="data_source"):
        ferry.Sampler(range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ferry.Sampler()
        ferry.Sampler(None)


def test_sampler_subclass_is_generic_and_usable_in_torch_code() -> None:
    class Evens(ferry.Sampler[int]):
        def __init__(self, n: int) -> None:
            self.n = n

        def __iter__(self) -> Any:
            return iter(range(0, self.n, 2))

        def __len__(self) -> int:
            return (self.n + 1) // 2

    assert list(tud.BatchSampler(Evens(7), 2, False)) == [[0, 2], [4, 6]]
    assert list(ferry.BatchSampler(Evens(7), 3, True)) == [[0, 2, 4]]


def test_sampler_attributes_match_torch() -> None:
    for build in (
        lambda m: m.SequentialSampler(range(4)),
        lambda m: m.RandomSampler(range(4), True, 7),
        lambda m: m.SubsetRandomSampler([3, 1]),
        lambda m: m.WeightedRandomSampler([1, 2], 3, False),
        lambda m: m.BatchSampler(range(4), 3, True),
    ):
        expected, got = build(tud), build(ferry)
        public = [a for a in vars(expected) if not a.startswith("_")]
        public += ["num_samples"] if hasattr(expected, "num_samples") else []
        for attr in public:
            assert_same_outcome(getattr(expected, attr), getattr(got, attr), attr)
        assert len(expected) == len(got)


def test_tensor_chunk_sampler_base_requires_index_chunks() -> None:
    from ferry.samplers import TensorChunkSampler

    class NoChunks(TensorChunkSampler):
        pass

    with pytest.raises(NotImplementedError, match="_index_chunks"):
        list(NoChunks())

    class Evens(TensorChunkSampler):
        def _index_chunks(self) -> Any:
            yield torch.tensor([0, 2], dtype=torch.int64)
            yield torch.tensor([4], dtype=torch.int64)

    assert list(Evens()) == [0, 2, 4]
    assert list(ferry.BatchSampler(Evens(), 2, False)) == [[0, 2], [4]]
    batches = index_batches(ferry.BatchSampler(Evens(), 2, False))
    assert batches is not None
    assert [b.tolist() for b in batches] == [[0, 2], [4]]
