"""The DataLoader against torch's, single-process: generated configurations (dataset kinds,
sizes, batching, samplers, seeds, collate functions, epochs, partial epochs) must yield exactly
the same batches, raise the same exception types, and leave torch's global RNG (and the
loader's generator) in the same state."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from hypothesis import given
from hypothesis import strategies as st

import ferry
from _support.compare import (
    HYPOTHESIS,
    MODULES,
    DuckGetitems,
    DuckMap,
    DuckStream,
    assert_same_outcome,
    differential,
    map_dataset,
    outcome,
    run_epochs,
    stream_dataset,
)
from _support.torch_versions import needs_torch

pytestmark = pytest.mark.usefixtures("guard_global_state")

X = torch.arange(60, dtype=torch.float32).view(30, 2)
Y = torch.arange(30) % 3

MAP_KINDS = [
    "list",
    "range",
    "tensor",
    "tensor_three",
    "subclass",
    "torch_base",
    "torch_tensor",
    "duck",
    "getitems",
    "subset_tensor",
    "concat",
    "stack",
    "stack_dict",
]

SAMPLER_KINDS = [
    "sequential",
    "random",
    "random_replacement",
    "random_num_samples",
    "subset",
    "weighted",
    "weighted_no_replacement",
    "torch_random",
    "list",
]


def map_dataset_of(kind: str, module: Any, n: int) -> Any:
    x, y = X[:n], Y[:n]
    if kind == "list":
        return [(float(i), f"s{i}") for i in range(n)]
    if kind == "range":
        return range(n)
    if kind == "tensor":
        return module.TensorDataset(x, y)
    if kind == "tensor_three":
        return module.TensorDataset(x, y, x[:, 0] > 10)
    if kind == "subclass":
        return map_dataset(module, [{"i": i, "x": x[i]} for i in range(n)])
    if kind == "torch_base":
        return map_dataset(tud, [[i, -i] for i in range(n)])
    if kind == "torch_tensor":
        return tud.TensorDataset(x, y)
    if kind == "duck":
        return DuckMap([x[i] for i in range(n)])
    if kind == "getitems":
        return DuckGetitems(list(range(n)))
    if kind == "subset_tensor":
        full = module.TensorDataset(X, Y)
        return module.Subset(full, list(range(29, 29 - n, -1)))
    if kind == "concat":
        half = n // 2
        return module.ConcatDataset([module.TensorDataset(x[:half], y[:half]), DuckMap(x[half:])])
    if kind == "stack":
        return module.StackDataset(module.TensorDataset(x), DuckGetitems(list(range(n))))
    if kind == "stack_dict":
        return module.StackDataset(a=range(n), b=module.TensorDataset(y))
    raise AssertionError(kind)


def sampler_of(kind: str, module: Any, dataset: Any, n: int, generator: Any) -> Any:
    if kind == "sequential":
        return module.SequentialSampler(dataset)
    if kind == "random":
        return module.RandomSampler(dataset, generator=generator)
    if kind == "random_replacement":
        return module.RandomSampler(dataset, replacement=True, generator=generator)
    if kind == "random_num_samples":
        return module.RandomSampler(dataset, num_samples=2 * n + 1, generator=generator)
    if kind == "subset":
        return module.SubsetRandomSampler(list(range(0, n, 2)), generator=generator)
    if kind == "weighted":
        return module.WeightedRandomSampler([1.0 + i for i in range(n)], n + 3, True, generator)
    if kind == "weighted_no_replacement":
        return module.WeightedRandomSampler([1.0] * n, n, False, generator)
    if kind == "torch_random":
        return tud.RandomSampler(dataset, generator=generator)
    if kind == "list":
        return list(reversed(range(n)))
    raise AssertionError(kind)


def _tag_batch(batch: Any) -> Any:
    """A collate_fn that returns exactly what it was given, with its type."""
    return ("collated", type(batch), batch)


@dataclass(frozen=True)
class MapConfig:
    kind: str
    n: int
    mode: str
    batch_size: int | None
    shuffle: bool
    drop_last: bool
    sampler: str
    use_generator: bool
    custom_collate: bool
    epochs: int
    take: int | None
    seed: int

    def build(self, module: Any) -> Any:
        generator = torch.Generator().manual_seed(self.seed + 1) if self.use_generator else None
        dataset = map_dataset_of(self.kind, module, self.n)
        kwargs: dict[str, Any] = {}
        if self.custom_collate:
            kwargs["collate_fn"] = _tag_batch
        if generator is not None:
            kwargs["generator"] = generator
        if self.mode == "batch_size":
            kwargs.update(batch_size=self.batch_size, shuffle=self.shuffle)
            if self.batch_size is not None:
                kwargs["drop_last"] = self.drop_last
        elif self.mode == "sampler":
            kwargs.update(
                batch_size=self.batch_size,
                sampler=sampler_of(self.sampler, module, dataset, self.n, generator),
            )
            if self.batch_size is not None:
                kwargs["drop_last"] = self.drop_last
        elif self.mode == "batch_sampler":
            inner = sampler_of(self.sampler, module, dataset, self.n, generator)
            kwargs["batch_sampler"] = module.BatchSampler(
                inner, self.batch_size or 2, self.drop_last
            )
        elif self.mode == "batch_sampler_lists":
            size = self.batch_size or 2
            keys = list(range(self.n))
            kwargs["batch_sampler"] = [keys[i : i + size] for i in range(0, self.n, size)]
        return module.DataLoader(dataset, **kwargs)


@st.composite
def map_configs(draw: st.DrawFn) -> MapConfig:
    return MapConfig(
        kind=draw(st.sampled_from(MAP_KINDS)),
        n=draw(st.integers(0, 30)),
        mode=draw(
            st.sampled_from(["batch_size", "sampler", "batch_sampler", "batch_sampler_lists"])
        ),
        batch_size=draw(st.none() | st.integers(1, 8)),
        shuffle=draw(st.booleans()),
        drop_last=draw(st.booleans()),
        sampler=draw(st.sampled_from(SAMPLER_KINDS)),
        use_generator=draw(st.booleans()),
        custom_collate=draw(st.booleans()),
        epochs=draw(st.integers(1, 2)),
        take=draw(st.none() | st.integers(0, 3)),
        seed=draw(st.integers(0, 2**31)),
    )


@HYPOTHESIS
@given(config=map_configs())
def test_map_style_loader_matches_torch(config: MapConfig) -> None:
    differential(config.build, seed=config.seed, epochs=config.epochs, take=config.take)


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(
            kind,
            marks=[needs_torch("2.5", "StackDataset.__getitems__")] if kind == "stack" else [],
        )
        for kind in MAP_KINDS
    ],
)
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_map_kind_matches_torch(kind: str, shuffle: bool) -> None:
    """A fixed configuration per dataset kind, so no kind depends on what hypothesis draws."""
    config = MapConfig(
        kind, 11, "batch_size", 3, shuffle, False, "random", False, False, 2, None, 4
    )
    differential(config.build, seed=config.seed, epochs=config.epochs)
    tagged = MapConfig(kind, 7, "batch_size", 4, shuffle, True, "random", True, True, 1, None, 5)
    differential(tagged.build, seed=tagged.seed)
    unbatched = MapConfig(
        kind, 5, "batch_size", None, shuffle, False, "random", False, False, 1, None, 6
    )
    differential(unbatched.build, seed=unbatched.seed)


@pytest.mark.parametrize("sampler", SAMPLER_KINDS)
@pytest.mark.parametrize("mode", ["sampler", "batch_sampler"])
@pytest.mark.parametrize("use_generator", [False, True])
def test_every_sampler_in_a_loader_matches_torch(
    sampler: str, mode: str, use_generator: bool
) -> None:
    config = MapConfig(
        "tensor", 13, mode, 4, False, False, sampler, use_generator, False, 2, None, 8
    )
    differential(config.build, seed=config.seed, epochs=config.epochs)


def test_custom_collate_gets_a_real_list_of_tuples_from_tensor_datasets() -> None:
    for module in MODULES:
        received = []

        def collate(batch: Any, received: list[Any] = received) -> int:
            received.append(batch)
            return len(batch)

        for dataset in (
            module.TensorDataset(X[:5], Y[:5]),
            module.Subset(module.TensorDataset(X, Y), [3, 1, 4, 1]),
            module.ConcatDataset([module.TensorDataset(X[:2]), module.TensorDataset(X[:2])]),
        ):
            received.clear()
            list(module.DataLoader(dataset, batch_size=3, collate_fn=collate))
            for batch in received:
                assert type(batch) is list, module.__name__
                assert all(type(sample) is tuple for sample in batch)


# -- iterable-style ------------------------------------------------------------------------------

STREAM_KINDS = ["stream", "sized_stream", "torch_stream", "chain", "tuples", "dicts"]


def stream_of(kind: str, module: Any, n: int, length: int) -> Any:
    if kind == "stream":
        return stream_dataset(module, list(range(n)))
    if kind == "sized_stream":
        return stream_dataset(module, [X[i % 30] for i in range(n)], length)
    if kind == "torch_stream":
        return stream_dataset(tud, list(range(n)), length)
    if kind == "chain":
        half = n // 2
        return module.ChainDataset(
            [stream_dataset(module, list(range(half))), stream_dataset(tud, list(range(half, n)))]
        )
    if kind == "tuples":
        return stream_dataset(module, [(i, float(i), f"s{i}") for i in range(n)], length)
    if kind == "dicts":
        return stream_dataset(module, [{"i": i, "x": X[i % 30]} for i in range(n)], length)
    raise AssertionError(kind)


@HYPOTHESIS
@given(
    kind=st.sampled_from(STREAM_KINDS),
    n=st.integers(0, 25),
    length=st.integers(0, 25),
    batch_size=st.none() | st.integers(1, 7),
    drop_last=st.booleans(),
    custom_collate=st.booleans(),
    call_len=st.booleans(),
    epochs=st.integers(1, 2),
    take=st.none() | st.integers(0, 3),
    seed=st.integers(0, 2**31),
)
def test_iterable_style_loader_matches_torch(
    *,
    kind: str,
    n: int,
    length: int,
    batch_size: int | None,
    drop_last: bool,
    custom_collate: bool,
    call_len: bool,
    epochs: int,
    take: int | None,
    seed: int,
) -> None:
    def build(module: Any) -> Any:
        kwargs: dict[str, Any] = {"batch_size": batch_size}
        if batch_size is not None:
            kwargs["drop_last"] = drop_last
        if custom_collate:
            kwargs["collate_fn"] = _tag_batch
        loader = module.DataLoader(stream_of(kind, module, n, length), **kwargs)
        if call_len:
            outcome(lambda: len(loader))
        return loader

    differential(build, seed=seed, epochs=epochs, take=take)


def test_duck_typed_stream_is_read_like_an_iterable_dataset() -> None:
    """ferry reads an object that has only ``__iter__`` as a stream (torch would need it to
    subclass IterableDataset): it yields what torch yields for the IterableDataset."""
    items = [(i, X[i]) for i in range(7)]
    torch.manual_seed(0)
    expected = run_epochs(tud.DataLoader(stream_dataset(tud, items), batch_size=3), epochs=2)
    torch.manual_seed(0)
    got = run_epochs(ferry.DataLoader(DuckStream(items), batch_size=3), epochs=2)
    assert_same_outcome(expected, got)


def test_duck_typed_map_with_getitems_and_iter_is_map_style_like_torch() -> None:
    """An object with ``__getitems__``/``__len__`` (and an ``__iter__``) but no base class is
    map-style for torch, which reads it by key through ``__getitems__``."""

    class Keyed:
        def __len__(self) -> int:
            return 5

        def __getitems__(self, indices: list[int]) -> list[int]:
            return [10 * i for i in indices]

        def __iter__(self) -> Any:
            return iter(range(100))

    differential(lambda m: m.DataLoader(Keyed(), batch_size=2), epochs=2)
    differential(lambda m: m.DataLoader(Keyed(), batch_size=2, shuffle=True), seed=3)


# -- the global RNG when an iterator is only created ---------------------------------------------


class _EagerRandomStream(tud.IterableDataset):
    """A stream whose ``__iter__`` (not a generator) draws from the global RNG at once."""

    def __iter__(self) -> Any:
        return iter(torch.randperm(6).tolist())


class _EagerRandomSampler(ferry.Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(torch.randperm(self.n).tolist())

    def __len__(self) -> int:
        return self.n


ITER_ONLY = {
    "sequential": lambda m: m.DataLoader(range(5)),
    "shuffle": lambda m: m.DataLoader(range(5), shuffle=True),
    "shuffle generator": lambda m: m.DataLoader(
        range(5), shuffle=True, generator=torch.Generator().manual_seed(1)
    ),
    "tensor shuffle": lambda m: m.DataLoader(m.TensorDataset(X), batch_size=4, shuffle=True),
    "unbatched shuffle": lambda m: m.DataLoader(range(5), batch_size=None, shuffle=True),
    "eager sampler": lambda m: m.DataLoader(range(5), sampler=_EagerRandomSampler(5)),
    "eager sampler unbatched": lambda m: m.DataLoader(
        range(5), batch_size=None, sampler=_EagerRandomSampler(5)
    ),
    "stream": lambda m: m.DataLoader(stream_dataset(m, [1, 2])),
    "eager stream": lambda m: m.DataLoader(_EagerRandomStream()),
}


@pytest.mark.parametrize("build", ITER_ONLY.values(), ids=ITER_ONLY.keys())
@pytest.mark.parametrize("take", [0, 1, 2])
def test_global_rng_after_creating_an_iterator_matches_torch(build: Any, take: int) -> None:
    draws = []
    for module in MODULES:
        torch.manual_seed(21)
        iterator = iter(build(module))
        head = outcome(lambda iterator=iterator: list(itertools.islice(iterator, take)))
        draws.append((head, torch.rand(1)))
    assert_same_outcome(draws[0], draws[1])


def test_stream_is_opened_when_the_iterator_is_created_like_torch() -> None:
    """torch calls ``iter(dataset)`` when ``iter(loader)`` is called, so an error in the
    dataset's ``__iter__`` surfaces there, before the first batch is asked for."""

    def build(module: Any) -> Any:
        class Broken(module.IterableDataset):
            def __iter__(self) -> Any:
                raise OSError("cannot open the stream")

        return iter(module.DataLoader(Broken()))

    expected, got = outcome(lambda: build(tud)), outcome(lambda: build(ferry))
    assert_same_outcome(expected, got)


@pytest.mark.parametrize("epochs", [1, 3])
def test_generator_state_after_epochs_matches_torch(epochs: int) -> None:
    states = []
    for module in MODULES:
        generator = torch.Generator().manual_seed(5)
        loader = module.DataLoader(
            module.TensorDataset(X), batch_size=7, shuffle=True, generator=generator
        )
        run_epochs(loader, epochs=epochs)
        states.append(torch.rand(2, generator=generator))
    assert_same_outcome(states[0], states[1])


def test_torch_samplers_and_batch_samplers_drive_a_ferry_loader() -> None:
    def build(module: Any) -> Any:
        dataset = module.TensorDataset(X, Y)
        generator = torch.Generator().manual_seed(3)
        batches = tud.BatchSampler(tud.RandomSampler(dataset, generator=generator), 4, True)
        return module.DataLoader(dataset, batch_sampler=batches)

    differential(build, epochs=2)
    differential(
        lambda m: m.DataLoader(m.TensorDataset(X), batch_size=5, sampler=tud.RandomSampler(X)),
        seed=9,
        epochs=2,
    )


def test_sequential_order_does_not_materialize_every_index() -> None:
    """torch walks a sequential epoch lazily (``range``); the batched fast path must too, or a
    large memory-mapped TensorDataset costs 8 bytes per row before the first batch. Here rows
    are empty, so only an eager index tensor (8 PB) could fail."""
    rows = torch.empty(10**15, 0)
    differential(lambda m: m.DataLoader(m.TensorDataset(rows), batch_size=2), take=2)
    differential(
        lambda m: m.DataLoader(
            m.TensorDataset(rows), batch_sampler=m.BatchSampler(range(10**15), 3, True)
        ),
        take=1,
    )
