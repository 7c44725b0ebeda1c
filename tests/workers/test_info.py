"""What a worker knows about itself: get_worker_info, seeding, worker_init_fn.

Seeds are compared with torch's workers given the same ``generator``: the base seed is drawn
like torch's, so every worker gets torch's seed, and the RNGs seeded from it (torch's and
Python's ``random``) give torch's numbers.
"""

from __future__ import annotations

import gc
import os
import random
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import ferry
from _support import datasets as ds
from _support.numpy_run import HAS_NUMPY, needs_numpy
from _support.processes import FAST, PROCESSES, Kind, worker_pids
from _support.torch_versions import TORCH, needs_torch
from ferry._core import rng

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

NUM_WORKERS = 2


def probe(module: Any, n: int, generator_seed: int | None, **kwargs: Any) -> list[dict[str, Any]]:
    """Every sample of a :class:`~_support.datasets.Probe` (batching off, in index order)."""
    generator = None if generator_seed is None else torch.Generator().manual_seed(generator_seed)
    loader = module.DataLoader(
        ds.Probe(n, module.get_worker_info),
        batch_size=None,
        num_workers=NUM_WORKERS,
        worker_init_fn=ds.record_init,
        generator=generator,
        **kwargs,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return list(loader)


def without_thread(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in call.items() if k != "thread"} for call in calls]


def torch_probe(n: int, generator_seed: int | None) -> list[dict[str, Any]]:
    return probe(tud, n, generator_seed, multiprocessing_context="fork")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fork", "forkserver", "thread"], indirect=True)
def test_worker_info_fields(kind: Kind) -> None:
    dataset = ds.Probe(6, ferry.get_worker_info)
    loader = ferry.DataLoader(dataset, batch_size=None, num_workers=NUM_WORKERS, **kind.kwargs)
    iterator = iter(loader)
    got = list(iterator)
    assert [s["index"] for s in got] == list(range(6))
    assert [s["id"] for s in got] == [i % NUM_WORKERS for i in range(6)]
    assert {s["num_workers"] for s in got} == {NUM_WORKERS}
    base = got[0]["seed"]
    assert [s["seed"] for s in got] == [base + s["id"] for s in got]
    assert all(s["same_dataset"] for s in got), "info.dataset is not the dataset fetching"
    if kind.threads:
        # Thread workers share the loader's dataset object: what they do to it is seen here.
        assert {s["dataset_id"] for s in got} == {id(dataset)}
        assert {s["pid"] for s in got} == {os.getpid()}
        assert len({s["thread"] for s in got}) == NUM_WORKERS
        assert dataset.calls == 6
    else:
        # Each worker has its own copy: its calls count only its own samples.
        assert [s["calls"] for s in got] == [1, 1, 2, 2, 3, 3]
        assert dataset.calls == 0
        assert [s["pid"] for s in got[:NUM_WORKERS]] == worker_pids(iterator)
        assert os.getpid() not in {s["pid"] for s in got}
    assert ferry.get_worker_info() is None
    process_type = {"thread": "_MainProcess", "fork": "ForkProcess"}
    process_type["forkserver"] = "ForkServerProcess"
    assert {s["process_type"] for s in got} == {process_type[kind.name]}


class _Method(tud.Dataset):  # type: ignore[type-arg]
    """Each sample: what torch's get_worker_info() says of torch 2.13's newer fields."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> Any:
        info = tud.get_worker_info()
        return (info.rng, info.worker_method)


@needs_torch("2.13", "WorkerInfo.rng and WorkerInfo.worker_method")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_worker_info_has_torchs_newer_fields(kind: Kind) -> None:
    """``rng`` and ``worker_method`` (torch 2.13), read by code written for torch: a thread
    worker says "thread", as torch's thread workers do."""
    got = list(ferry.DataLoader(_Method(), batch_size=None, num_workers=1, **kind.kwargs))
    method = "thread" if kind.threads else "multiprocessing"
    assert got == [[None, method], [None, method]]  # (default_convert: tuples to lists)
    if not kind.threads:
        torch_loader = tud.DataLoader(_Method(), batch_size=None, num_workers=1, **kind.kwargs)
        assert list(torch_loader) == got


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_main_thread_sees_no_worker_info_while_workers_run(kind: Kind) -> None:
    loader = ferry.DataLoader(
        ds.Probe(4, ferry.get_worker_info), batch_size=None, num_workers=2, **kind.kwargs
    )
    for sample in loader:
        assert sample["id"] in (0, 1)
        assert ferry.get_worker_info() is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", PROCESSES, indirect=True)
def test_seeds_and_rngs_match_torch(kind: Kind) -> None:
    """Same generator: the same worker seeds as torch's workers, torch.initial_seed() is the
    seed, and torch's and Python's RNGs give torch's numbers; worker_init_fn runs once per
    worker, with its id, after seeding."""
    expected = torch_probe(6, 99)
    got = probe(ferry, 6, 99, **kind.kwargs)
    fields = ("index", "id", "num_workers", "seed", "initial_seed", "random", "torch")
    for want, have in zip(expected, got, strict=True):
        assert {f: have[f] for f in fields} == {f: want[f] for f in fields}
        assert without_thread(have["init"]) == without_thread(want["init"])
    types = {"fork": "ForkProcess", "spawn": "SpawnProcess", "forkserver": "ForkServerProcess"}
    assert {s["process_type"] for s in got} == {types[kind.name]}
    for sample in got:
        assert sample["initial_seed"] == sample["seed"]
        (init,) = sample["init"]
        assert init["worker_id"] == init["info_id"] == sample["id"]
        assert init["initial_seed"] == sample["seed"]
        assert init["random"] == random.Random(sample["seed"]).random()


@pytest.mark.timeout(60)
@needs_numpy
def test_numpy_rng_matches_torch() -> None:
    """numpy's global RNG in a worker is seeded as torch seeds it, so augmentations drawn from
    np.random give torch's samples for the same generator."""
    expected = torch_probe(4, 5)
    got = probe(ferry, 4, 5, multiprocessing_context="fork")
    assert [s["numpy"] for s in got] == [s["numpy"] for s in expected]


def test_seed_torch_is_torch_manual_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's torch seeding gives torch.manual_seed's state; where torch was built with an
    accelerator backend, it is torch.manual_seed itself (which also seeds that backend)."""
    saved = torch.get_rng_state()
    try:
        torch.manual_seed(77)
        expected = torch.get_rng_state()
        torch.manual_seed(1)
        rng.seed_torch(77)
        assert torch.equal(torch.get_rng_state(), expected)
        assert torch.initial_seed() == 77
        cpu_only = not torch.backends.cuda.is_built() and not torch.backends.mps.is_built()
        assert rng._cpu_only_torch() is (cpu_only and not torch.xpu._is_compiled())
        calls: list[int] = []
        monkeypatch.setattr(rng, "_CPU_ONLY", [False])
        monkeypatch.setattr(torch, "manual_seed", calls.append)
        rng.seed_torch(5)
        assert calls == [5]
    finally:
        torch.set_rng_state(saved)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fork"], indirect=True)
def test_base_seed_drawn_from_global_rng_like_torch(kind: Kind) -> None:
    torch.manual_seed(2024)
    expected = torch_probe(2, None)
    after_torch = torch.rand(1)
    torch.manual_seed(2024)
    got = probe(ferry, 2, None, **kind.kwargs)
    assert torch.equal(torch.rand(1), after_torch)
    assert [s["seed"] for s in got] == [s["seed"] for s in expected]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fork"], indirect=True)
def test_random_streams_differ_between_workers_and_epochs(kind: Kind) -> None:
    loader = ferry.DataLoader(
        ds.Probe(6, ferry.get_worker_info), batch_size=None, num_workers=3, **kind.kwargs
    )
    epochs = [list(loader) for _ in range(2)]
    for source in ("random", "numpy", "torch") if HAS_NUMPY else ("random", "torch"):
        first = [s[source] for s in epochs[0]]
        second = [s[source] for s in epochs[1]]
        # The first draw of each of the three workers: all different.
        assert len(set(first[:3])) == 3, (source, first)
        assert set(first).isdisjoint(second), (source, first, second)
    assert len({s["seed"] for s in epochs[0]} | {s["seed"] for s in epochs[1]}) == 6


@pytest.mark.timeout(60)
def test_worker_init_fn_once_per_thread_worker() -> None:
    got = probe(ferry, 6, 3, worker_type="thread")
    calls = list(ds.INIT_CALLS)
    assert sorted(c["worker_id"] for c in calls) == list(range(NUM_WORKERS))
    for call in calls:
        assert call["info_id"] == call["worker_id"]
        assert call["thread"] != threading.get_ident()
    thread_of = {c["worker_id"]: c["thread"] for c in calls}
    assert all(s["thread"] == thread_of[s["id"]] for s in got)
    expected = torch_probe(6, 3)
    assert [s["seed"] for s in got] == [s["seed"] for s in expected]


def two_epochs(module: Any, **kwargs: Any) -> list[list[dict[str, Any]]]:
    loader = module.DataLoader(
        ds.Probe(4, module.get_worker_info),
        batch_size=None,
        num_workers=2,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(8),
        **kwargs,
    )
    return [list(loader), list(loader)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FAST, indirect=True)
def test_persistent_workers_keep_their_rng_between_epochs(kind: Kind) -> None:
    """As in torch, persistent workers are seeded once: the second epoch continues the
    streams with the same seeds, in the same workers."""
    first, second = two_epochs(ferry, **kind.kwargs)
    assert [s["seed"] for s in first] == [s["seed"] for s in second]
    assert [s["pid"] for s in first] == [s["pid"] for s in second]
    assert [s["thread"] for s in first] == [s["thread"] for s in second]
    if kind.threads:
        return
    assert [s["calls"] for s in second] == [3, 3, 4, 4]
    expected = two_epochs(tud, multiprocessing_context="fork")
    fields = ("seed", "random", "torch", "calls")
    for want, have in zip(expected[0] + expected[1], first + second, strict=True):
        assert {f: have[f] for f in fields} == {f: want[f] for f in fields}


def _finalized_in_workers(module: Any, kind: Kind, persistent: bool, log: Path) -> list[str]:
    """Epochs of a :class:`~_support.datasets.Finalized` through ``module``'s loader with 2
    workers (persistent ones: two, which they live through; else one, whose workers end with
    it), then the loader dropped: the lines its copies wrote outside this process."""
    loader = module.DataLoader(
        ds.Finalized(8, str(log)),
        batch_size=2,
        num_workers=NUM_WORKERS,
        persistent_workers=persistent,
        **kind.kwargs,
    )
    for _ in range(2 if persistent else 1):
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    del loader
    gc.collect()
    lines = log.read_text().split("\n") if log.exists() else []
    return [line.split()[1] for line in lines if line and int(line.split()[0]) != os.getpid()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
@pytest.mark.parametrize("kind", PROCESSES, indirect=True)
def test_a_worker_lets_go_of_its_dataset_when_its_loop_ends(
    kind: Kind, persistent: bool, tmp_path: Path
) -> None:
    """As torch's workers since 2.14: when a worker's loop ends, ``get_worker_info()`` says
    None and the worker holds its dataset no more, so a spawned or forkserver worker, whose
    copy nothing else holds, finalizes it then (closing what ``__del__`` closes) while its
    interpreter is whole. A forked worker's copy is also held by the main process's objects
    it inherited: not finalized there, in either loader."""
    finalized = _finalized_in_workers(ferry, kind, persistent, tmp_path / "ferry")
    expected = [] if kind.name == "fork" else ["True"] * NUM_WORKERS  # (one epoch's workers)
    assert finalized == expected
    if TORCH >= (2, 14):  # torch's own workers do the same from 2.14
        assert _finalized_in_workers(tud, kind, persistent, tmp_path / "torch") == expected
