"""ferry inside real Lightning (Trainer, LightningDataModule, Fabric, DDP), against torch.

Lightning treats loaders specially when they are ``torch.utils.data.DataLoader`` s: it rebuilds
them from their constructor arguments to inject samplers (a sequential one for
``overfit_batches``, a DistributedSampler under DDP, an index-tracking batch sampler for
predict), resets them between stages (``loader._iterator = None``), adds a ``worker_init_fn``,
and runs checks that warn about suspicious setups. A drop-in replacement must go through all of
that and come out with the same training.

So every program in ``_lightning_programs.py`` runs twice, once with ``torch.utils.data``'s
classes and once with ferry's, seeded alike, and the tests compare exactly: the batches every
train/val/test/predict step saw, the final weights, the predictions, the batch indices
Lightning hands prediction writers and the warnings Lightning raised. Each program also checks
that it left no worker process or ferry worker thread behind. The torch run of each program is
checked for what makes the comparison meaningful (epochs are shuffled differently, every row
seen once per epoch, ...), so a program that stops exercising anything fails on torch too.

Each program runs once per module (``runs`` caches them); DDP starts its two rank processes
once for both implementations (``_lightning_ddp_main.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ferry
from _support.ranks import PYTHON, run_ranks
from ecosystem._lightning_programs import (
    BATCH,
    EVAL_ROWS,
    PROGRAMS,
    TRAIN_ROWS,
    seen_indices,
)

pytestmark = pytest.mark.usefixtures("guard_global_state")

DDP_MAIN = Path(__file__).with_name("_lightning_ddp_main.py")
DDP_DEADLINE_S = 150.0  # generous: the machine may be shared with other test runs
NO_LEAKS = {"processes": [], "threads": []}
IMPLS = ["torch", "ferry"]
FULL_PROGRAMS = ["hooks-0", "hooks-2", "hooks-2-persistent", "direct", "datamodule"]


@pytest.fixture(scope="module")
def runs() -> Callable[[str, str], dict[str, Any]]:
    """``runs(program, impl)``: the program's result, computed on first use; errors re-raise."""
    cache: dict[tuple[str, str], tuple[bool, Any]] = {}

    def get(name: str, impl: str) -> dict[str, Any]:
        key = (name, impl)
        if key not in cache:
            try:
                cache[key] = (True, PROGRAMS[name](impl))
            except Exception as error:
                cache[key] = (False, error)
        ok, value = cache[key]
        if not ok:
            raise value
        return value

    return get


# -- comparisons ----------------------------------------------------------------------------------


def _assert_same_seen(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Same steps, same batches: the index lists first (readable), then every tensor."""
    assert seen_indices(got) == seen_indices(want)
    for key, batches in want.items():
        for number, (g, w) in enumerate(zip(got[key], batches, strict=True)):
            assert len(g) == len(w), (key, number)
            for column, (gt, wt) in enumerate(zip(g, w, strict=True)):
                assert gt.dtype == wt.dtype, (key, number, column)
                assert torch.equal(gt, wt), (key, number, column)


def _assert_same_tensors(got: Any, want: Any) -> None:
    if isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            _assert_same_tensors(got[key], want[key])
    elif isinstance(want, list):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _assert_same_tensors(g, w)
    else:
        assert torch.equal(got, want)


def _assert_same_run(got: dict[str, Any], want: dict[str, Any]) -> None:
    _assert_same_seen(got["seen"], want["seen"])
    _assert_same_tensors(got["weights"], want["weights"])
    if "predictions" in want:
        _assert_same_tensors(got["predictions"], want["predictions"])
        assert got["batch_indices"] == want["batch_indices"]
        assert got["epoch_batch_indices"] == want["epoch_batch_indices"]


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def _check_shuffled_epochs(indices: dict[str, list[list[int]]], rows: int) -> None:
    """Both training epochs saw every row once, in two different non-sequential orders."""
    epochs = [_flat(indices[f"train/epoch{e}"]) for e in (0, 1)]
    for order in epochs:
        assert sorted(order) == list(range(rows))
        assert order != list(range(rows))
    assert epochs[0] != epochs[1]


def _sequential(rows: int, batch: int = BATCH) -> list[list[int]]:
    return [list(range(i, min(i + batch, rows))) for i in range(0, rows, batch)]


def _check_torch_full(result: dict[str, Any]) -> None:
    """What the torch run of a fit/validate/test/predict program must have seen."""
    indices = seen_indices(result["seen"])
    assert set(indices) == {
        "sanity",
        "train/epoch0",
        "val/epoch0",
        "train/epoch1",
        "val/epoch1",
        "validate",
        "test",
        "predict",
    }
    _check_shuffled_epochs(indices, TRAIN_ROWS)
    in_order = _sequential(EVAL_ROWS)
    assert indices["sanity"] == in_order[:2]
    for key in ("val/epoch0", "val/epoch1", "validate", "test", "predict"):
        assert indices[key] == in_order, key
    assert result["batch_indices"] == indices["predict"]
    assert result["epoch_batch_indices"] == [[indices["predict"]]]
    assert len(result["predictions"]) == len(in_order)


# -- Trainer: hooks, loaders passed to fit, LightningDataModule -----------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", FULL_PROGRAMS)
def test_fit_validate_test_predict(runs, name: str, impl: str) -> None:
    """fit (2 shuffled epochs + val), validate, test, predict: same batches, weights, predictions.

    ``hooks-*``: loaders from the LightningModule's hooks, 0 workers, 2 workers, 2 persistent
    workers. ``direct``: loaders passed to fit/validate/test/predict, one persistent evaluation
    loader for all stages. ``datamodule``: a LightningDataModule, rows carrying noise drawn in
    the workers Lightning seeds (``seed_everything(workers=True)``). Predict checks the
    ``batch_indices`` Lightning's index-tracking batch sampler gives a prediction writer.
    """
    result = runs(name, impl)
    assert result["leaks"] == NO_LEAKS
    if impl == "torch":
        _check_torch_full(result)
    else:
        _assert_same_run(result, runs(name, "torch"))


@pytest.mark.timeout(90)
def test_thread_workers_match_torch_worker_processes(runs) -> None:
    """ferry's ``worker_type="thread"`` under Lightning sees what torch's 2 processes see."""
    result = runs("hooks-2-thread", "ferry")
    assert result["leaks"] == NO_LEAKS
    _assert_same_run(result, runs("hooks-2", "torch"))


# -- overfit_batches, Fabric, Lightning's warnings ------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", IMPLS)
def test_overfit_batches(runs, impl: str) -> None:
    """``Trainer(overfit_batches=2)`` turns shuffling off: the first 2 batches, every epoch."""
    result = runs("overfit", impl)
    assert result["leaks"] == NO_LEAKS
    if impl == "torch":
        indices = seen_indices(result["seen"])
        for epoch in (0, 1):
            assert indices[f"train/epoch{epoch}"] == _sequential(TRAIN_ROWS)[:2]
            assert indices[f"val/epoch{epoch}"] == _sequential(EVAL_ROWS)[:2]
        assert any("requested to overfit" in w for w in result["warnings"])
    else:
        want = runs("overfit", "torch")
        _assert_same_run(result, want)
        assert result["warnings"] == want["warnings"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", IMPLS)
def test_fabric_setup_dataloaders(runs, impl: str) -> None:
    """``fabric.setup_dataloaders(loader)``: 2 shuffled epochs with workers, same batches."""
    result = runs("fabric", impl)
    assert result["leaks"] == NO_LEAKS
    assert result["wrapped_type"] == "_FabricDataLoader"
    assert result["len"] == len(_sequential(TRAIN_ROWS))
    if impl == "torch":
        batches = [b[2].tolist() for b in result["seen"]]
        half = len(batches) // 2
        _check_shuffled_epochs(
            {"train/epoch0": batches[:half], "train/epoch1": batches[half:]}, TRAIN_ROWS
        )
    else:
        want = runs("fabric", "torch")
        assert [b[2].tolist() for b in result["seen"]] == [b[2].tolist() for b in want["seen"]]
        _assert_same_tensors(result["seen"], want["seen"])
        _assert_same_tensors(result["weights"], want["weights"])


EXPECTED_WARNINGS = [
    "Your `val_dataloader`'s sampler has shuffling enabled",
    "The 'train_dataloader' does not have many workers",
    "The 'val_dataloader' does not have many workers",
    "Your `IterableDataset` has `__len__` defined.",
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", IMPLS)
def test_lightning_checks_warn_alike(runs, impl: str) -> None:
    """A shuffled val loader, loaders without workers, an IterableDataset with ``__len__``.

    The warnings are recorded inside the program (``catch_warnings(record=True)`` with the
    "always" filter) and compared whole: same messages, same number of times.
    """
    result = runs("warnings", impl)
    assert result["leaks"] == NO_LEAKS
    if impl == "torch":
        for expected in EXPECTED_WARNINGS:
            assert any(expected in w for w in result["warnings"]), expected
        indices = seen_indices(result["seen"])
        for epoch in (0, 1):
            assert indices[f"train/epoch{epoch}"] == _sequential(TRAIN_ROWS)
        assert result["num_training_batches"] == len(_sequential(TRAIN_ROWS))
    else:
        want = runs("warnings", "torch")
        assert result["warnings"] == want["warnings"]
        assert result["num_training_batches"] == want["num_training_batches"]
        _assert_same_run(result, want)


# -- DDP on two CPU processes ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, tuple[str, Any]]]:
    """Both rank processes, run once: each rank's ``{impl: (status, result)}``."""
    out_dir = tmp_path_factory.mktemp("lightning-ddp")
    return run_ranks(
        lambda rank, port: [PYTHON, str(DDP_MAIN), str(out_dir)],
        2,
        out_dir,
        DDP_DEADLINE_S,
        "Lightning DDP ranks",
    )


def _ddp_result(ddp: list[dict[str, tuple[str, Any]]], impl: str) -> list[dict[str, Any]]:
    per_rank = []
    for rank, results in enumerate(ddp):
        assert impl in results, f"rank {rank} did not get to run {impl} (an earlier run failed)"
        status, value = results[impl]
        assert status == "ok", f"rank {rank}, {impl}:\n{value}"
        per_rank.append(value)
    return per_rank


@pytest.mark.timeout(200)
@pytest.mark.parametrize("impl", IMPLS)
def test_ddp_two_cpu_ranks(ddp, impl: str) -> None:
    """``strategy="ddp"``, 2 gloo ranks: Lightning shards every loader by rank.

    The ranks' training samples are disjoint and together cover the dataset, each epoch; val
    and predict are split alike; every rank sees with ferry exactly what it sees with torch.
    """
    per_rank = _ddp_result(ddp, impl)
    for rank, result in enumerate(per_rank):
        assert result["rank"] == (rank, 2)
        assert result["leaks"] == NO_LEAKS, rank
    indices = [seen_indices(result["seen"]) for result in per_rank]
    if impl == "torch":
        for key, rows in [
            ("train/epoch0", TRAIN_ROWS),
            ("train/epoch1", TRAIN_ROWS),
            ("val/epoch0", EVAL_ROWS),
            ("val/epoch1", EVAL_ROWS),
            ("predict", EVAL_ROWS),
        ]:
            parts = [_flat(ix[key]) for ix in indices]
            assert not set(parts[0]) & set(parts[1]), key
            assert sorted(parts[0] + parts[1]) == list(range(rows)), key
        for ix in indices:
            assert _flat(ix["train/epoch0"]) != _flat(ix["train/epoch1"])
        for result, ix in zip(per_rank, indices, strict=True):
            assert result["batch_indices"] == ix["predict"]
        # DDP averages the gradients: every rank ends with the same weights.
        _assert_same_tensors(per_rank[1]["weights"], per_rank[0]["weights"])
        for result in per_rank:  # the standard injection: the loader's own sampler is replaced
            assert result["loaders"]["train"]["sampler"] == "DistributedSampler"
            assert result["loaders"]["train"]["batch_size"] == BATCH
    else:
        for got, want in zip(per_rank, _ddp_result(ddp, "torch"), strict=True):
            _assert_same_run(got, want)
            assert got["loaders"] == want["loaders"]


@pytest.mark.timeout(60)
def test_a_loader_rebuilt_from_its_attributes_keeps_ferrys_options() -> None:
    """Lightning injects samplers by calling the loader's class with its __init__ arguments,
    read back from the instance's attributes (lightning.pytorch.utilities.data)."""
    from lightning.pytorch.utilities.data import _update_dataloader

    data = ferry.TensorDataset(torch.arange(10.0))
    loader = ferry.DataLoader(data, batch_size=4, num_workers=2, worker_type="thread")
    sampler = ferry.DistributedSampler(data, num_replicas=2, rank=1, shuffle=False)
    rebuilt = _update_dataloader(loader, sampler)
    assert type(rebuilt) is ferry.DataLoader
    assert rebuilt.worker_type == "thread"
    # The loader's batch sampler is a record of torch's exact class, so Lightning takes its
    # standard path: the new sampler replaces the loader's, batch_size is kept.
    assert rebuilt.sampler is sampler
    assert rebuilt.batch_size == 4
    assert rebuilt.batch_sampler.sampler is sampler
    assert [b[0].tolist() for b in rebuilt] == [[1.0, 3.0, 5.0, 7.0], [9.0]]
