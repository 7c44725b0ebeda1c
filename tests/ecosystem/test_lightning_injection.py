"""Lightning's and Fabric's sampler injection treat a ferry loader exactly as torch's.

Under DDP (and for ``overfit_batches``, shuffled evaluation loaders, ``use_distributed_sampler``)
Lightning rebuilds a user's loader around a ``DistributedSampler``. It takes its standard path
only when ``type(loader.batch_sampler) is torch.utils.data.BatchSampler``; for any other class
it keeps the old sampler and wraps the new one in a rebuilt batch sampler. ferry's
``BatchSampler(...)`` and the loader's automatic one are therefore records of torch's exact class
(see ``ferry.BatchSampler``), and every loader a user may build comes out of the set-up as
torch's does: same types, ``batch_size``, ``drop_last``, sampler ``epoch``/``shuffle`` and batches
per rank; a second set-up changes nothing more than it does with torch.

In process, with Lightning's own functions (the Trainer's ``_update_dataloader`` for training,
validation and prediction, and Fabric's), for every loader of ``_injection.VARIANTS`` and both
ranks of 2; then the real thing: ``Fabric.setup_dataloaders`` on 2 launched gloo ranks
(``_injection_fabric_main.py``). The Trainer under real DDP is checked in ``test_lightning.py``
(``test_ddp_two_cpu_ranks`` compares the loaders Lightning built on each rank).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from lightning.fabric.utilities.data import _replace_dunder_methods
from lightning.fabric.utilities.data import _update_dataloader as fabric_update
from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _is_dataloader_shuffled, _update_dataloader

import ferry
from _support.ranks import PYTHON, run_ranks
from ecosystem._injection import VARIANTS, describe

pytestmark = [
    pytest.mark.usefixtures("guard_global_state"),
    # _outcome seeds torch's global RNG alike before each set-up, so a loader without a
    # generator begins its second set-up's epochs as its first: ferry says so (torch does not).
    pytest.mark.filterwarnings("ignore:.*repeats that epoch's shuffle:UserWarning"),
]

FABRIC_MAIN = Path(__file__).with_name("_injection_fabric_main.py")
WORLD = 2


def _build(impl: str, variant: str) -> Any:
    """The loader, built as inside a Lightning hook or ``Fabric.launch``: with its constructor
    arguments recorded (Lightning rebuilds a loader from them)."""
    with (
        _replace_dunder_methods(tud.DataLoader, "dataset"),
        _replace_dunder_methods(tud.BatchSampler),
    ):
        return VARIANTS[variant](impl)


def _trainer_setup(loader: Any, rank: int, mode: RunningStage) -> Any:
    """What the Trainer's data connector does to a loader on ``rank`` under DDP."""
    if isinstance(loader.sampler, tud.DistributedSampler):
        return loader  # _requires_distributed_sampler: nothing to do
    shuffle = _is_dataloader_shuffled(loader)
    sampler = _get_distributed_sampler(
        loader, shuffle=shuffle, overfit_batches=0, mode=mode, num_replicas=WORLD, rank=rank
    )
    return _update_dataloader(loader, sampler, mode=mode)


def _fabric_setup(loader: Any, rank: int) -> Any:
    """What ``Fabric.setup_dataloaders`` does to a loader on ``rank`` under DDP."""
    if isinstance(loader.sampler, tud.DistributedSampler):
        return loader
    sampler = tud.DistributedSampler(
        loader.dataset, num_replicas=WORLD, rank=rank, shuffle=_is_dataloader_shuffled(loader)
    )
    return fabric_update(loader, sampler)


def _outcome(setup: Any) -> dict[str, Any]:
    """Each rank's loader after one set-up (``setup(rank, None)``) and after a second one
    (``setup(rank, loader)``); a failure is part of the outcome (both must fail alike)."""
    out: dict[str, Any] = {}
    for rank in range(WORLD):
        loader = None
        for name, previous in (("once", None), ("again", True)):
            key = f"rank{rank}/{name}"
            if previous is not None and loader is None:
                break
            torch.manual_seed(0)  # random samplers without a generator draw from it
            try:
                made = setup(rank, loader)
            except Exception as error:
                out[key] = f"{type(error).__name__}: {error}"
                continue
            out[key] = describe(made)
            loader = made
    return out


def _check_torch(variant: str, outcome: dict[str, Any], predicting: bool = False) -> None:
    """What makes the comparison meaningful: torch's loader did get a DistributedSampler (in
    its batch sampler for a custom one and for prediction), and the ranks split the dataset."""
    once = [outcome[f"rank{rank}/once"] for rank in range(WORLD)]
    if predicting and variant == "derived_subclass":
        # Prediction rebuilds the batch sampler and passes batch_size and drop_last, which
        # this subclass does not take: Lightning refuses it, with torch's loader too.
        assert all("MisconfigurationException" in str(d) for d in once), once
        return
    for described in once:
        assert isinstance(described, dict), described
        if variant == "custom_batch_sampler" or predicting:
            assert "Distributed" in str(described["batch_sampler.sampler"]), described
        else:
            assert described["is_distributed"], described
    if not predicting:  # (prediction wraps the loader's own sampler, random ones included)
        seen = [{i for batch in d["epochs"][0] for i in batch} for d in once]
        assert not seen[0] & seen[1]


MODES = [RunningStage.TRAINING, RunningStage.VALIDATING, RunningStage.PREDICTING]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_trainer_injects_as_into_torchs_loader(variant: str, mode: RunningStage) -> None:
    def run(impl: str) -> dict[str, Any]:
        def setup(rank: int, loader: Any) -> Any:
            return _trainer_setup(loader or _build(impl, variant), rank, mode)

        return _outcome(setup)

    want = run("torch")
    _check_torch(variant, want, predicting=mode is RunningStage.PREDICTING)
    assert run("ferry") == want


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fabric_injects_as_into_torchs_loader(variant: str) -> None:
    def run(impl: str) -> dict[str, Any]:
        def setup(rank: int, loader: Any) -> Any:
            return _fabric_setup(loader or _build(impl, variant), rank)

        return _outcome(setup)

    want = run("torch")
    _check_torch(variant, want)
    assert run("ferry") == want


def test_the_standard_path_keeps_ferrys_loader_and_options() -> None:
    """The rebuilt loader is ferry's, with ferry's own options carried over."""
    with _replace_dunder_methods(tud.DataLoader, "dataset"):
        loader = ferry.DataLoader(
            ferry.TensorDataset(torch.arange(10)),
            batch_size=4,
            num_workers=2,
            worker_type="thread",
            on_error="skip",
            balance_workers=True,
            move_workers=False,
        )
    rebuilt = _trainer_setup(loader, 1, RunningStage.TRAINING)
    assert type(rebuilt) is ferry.DataLoader
    assert (rebuilt.worker_type, rebuilt.on_error, rebuilt.batch_size) == ("thread", "skip", 4)
    assert (rebuilt.balance_workers, rebuilt.move_workers) == (True, False)
    assert isinstance(rebuilt.sampler, tud.DistributedSampler)


# -- Fabric.setup_dataloaders on two launched ranks ----------------------------------------------


@pytest.fixture(scope="module")
def fabric_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("fabric-injection")
    return run_ranks(
        lambda rank, port: [PYTHON, str(FABRIC_MAIN), str(out_dir)],
        WORLD,
        out_dir,
        150.0,
        "Fabric set-up ranks",
    )


@pytest.mark.timeout(200)
def test_fabric_setup_dataloaders_on_two_ranks(fabric_ranks: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(fabric_ranks):
        assert set(results) == set(VARIANTS), rank
        for variant, by_impl in results.items():
            assert by_impl["torch"][0] == "ok", by_impl["torch"][1]
            assert by_impl["ferry"] == by_impl["torch"], (rank, variant)
            want = by_impl["torch"][1]
            if variant != "custom_batch_sampler":
                assert want["once"]["is_distributed"], (rank, variant)
