"""Lightning's batch-size tuner with ferry's DataLoader, against torch's.

Lightning's own test ``tests/tuner/test_scale_batch_size.py::test_trainer_reset_correctly[fit]``
passes with torch's DataLoader and fails with ferry's: it expects ``trainer.fit_loop.state_dict()``
after ``Tuner(trainer).scale_batch_size(model)`` to equal the one before, and with ferry's loader
the later one holds the loader's state (``{"combined_loader": [...]}`` under ``"state_dict"``)
where torch's has ``{}``. Lightning saves the state of every train loader that has
``state_dict``/``load_state_dict`` (a class-level protocol check, torchdata's
``StatefulDataLoader`` passes it too), and the tuner ends by building a fresh loader and calling
``iter()`` on it. ferry keeps the methods on purpose: they are what lets Lightning resume a ferry
loader mid-epoch (``test_lightning_resume.py``). docs/design/ecosystem.md, "Lightning sees a
resumable loader", has the reasoning.

The test here runs that scenario on CPU with both loaders and shows the difference is the loader
state alone, and harmless: the state describes a loader that has handed out nothing, loading it
into a fresh loader changes none of its batches, and the fit after tuning trains on torch's
batches.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.utils.data as tud
from lightning.pytorch.tuner import Tuner
from torch import nn

import ferry
from ecosystem._lightning_programs import quiet

pytestmark = pytest.mark.usefixtures("guard_global_state")

IMPLS: dict[str, Any] = {"torch": tud, "ferry": ferry}
ROWS = 32
FEATURES = 3
SEED = 7  # every loader's generator
INIT_BATCH = 2  # the tuner tries 2, then 4 (max_trials=2), and keeps 4
TUNED_BATCH = 4
MAX_STEPS = 3

TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "max_steps": MAX_STEPS,
}

Step = tuple[int, int, list[int]]  # (epoch, batch_idx, sample indices)


def make_loader(impl: str, batch_size: int) -> Any:
    """Rows ``(index, features)`` of ``impl``'s TensorDataset, shuffled by a seeded generator."""
    features = torch.randn(ROWS, FEATURES, generator=torch.Generator().manual_seed(0))
    dataset = IMPLS[impl].TensorDataset(torch.arange(ROWS), features)
    generator = torch.Generator().manual_seed(SEED)
    return IMPLS[impl].DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=generator)


class TunedModel(L.LightningModule):
    """A linear layer with a ``batch_size`` for the tuner and a ``train_dataloader`` hook."""

    def __init__(self, impl: str) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights for both loaders
        self.layer = nn.Linear(FEATURES, 1)
        self.impl = impl
        self.batch_size = INIT_BATCH
        self.steps: list[Step] = []

    def train_dataloader(self) -> Any:
        return make_loader(self.impl, self.batch_size)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        index, features = batch
        self.steps.append((self.current_epoch, batch_idx, index.tolist()))
        return self.layer(features).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def tune_then_fit(impl: str, root: Path) -> dict[str, Any]:
    """Tunes the batch size on ``impl``'s loader (``method="fit"``), then fits.

    Returns ``fit_loop.state_dict()`` before and after tuning, the batch size found, the steps
    trained by the tuner's trials and by the fit after it, the final weights and the warnings.
    """
    root.mkdir()
    model = TunedModel(impl)
    trainer = L.Trainer(default_root_dir=root, **TRAINER_DEFAULTS)
    result: dict[str, Any] = {"before": trainer.fit_loop.state_dict()}
    with quiet(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = Tuner(trainer).scale_batch_size(
            model, method="fit", mode="power", init_val=INIT_BATCH, max_trials=2, steps_per_trial=1
        )
        result["after"] = trainer.fit_loop.state_dict()
        result["found"], result["batch_size"] = found, model.batch_size
        result["trials"], model.steps = model.steps, []
        trainer.fit(model)
    result["fit"] = model.steps
    result["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    result["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    assert not list(root.glob(".scale_batch_size_*.ckpt"))  # the tuner removed its checkpoint
    return result


def without_loader_state(loop_state: dict[str, Any]) -> dict[str, Any]:
    """``fit_loop.state_dict()`` less its ``combined_loader`` entry."""
    own = {k: v for k, v in loop_state["state_dict"].items() if k != "combined_loader"}
    return {**loop_state, "state_dict": own}


def batches(loader: Any, epochs: int = 2) -> list[list[list[int]]]:
    """The sample indices of every batch of ``epochs`` epochs."""
    return [[index.tolist() for index, _ in loader] for _ in range(epochs)]


@pytest.mark.timeout(120)
def test_tuner_leaves_an_untouched_loader_state(tmp_path: Path) -> None:
    runs = {impl: tune_then_fit(impl, tmp_path / impl) for impl in IMPLS}
    torch_run, ferry_run = runs["torch"], runs["ferry"]

    # The tuner did the same thing with both loaders.
    for run in runs.values():
        assert run["found"] == run["batch_size"] == TUNED_BATCH
    assert ferry_run["trials"] == torch_run["trials"]
    assert len(torch_run["trials"]) == 2  # one step at batch size 2, one at 4
    assert ferry_run["warnings"] == torch_run["warnings"]

    # Lightning's test_trainer_reset_correctly[fit]: the loop's state is as before tuning. With
    # torch's loader it is, with no loader state; with ferry's, it is apart from that state.
    assert torch_run["before"] == ferry_run["before"]
    assert torch_run["after"]["state_dict"] == {}
    assert torch_run["after"] == torch_run["before"]
    assert set(ferry_run["after"]["state_dict"]) == {"combined_loader"}
    assert ferry_run["after"] != ferry_run["before"]
    assert without_loader_state(ferry_run["after"]) == ferry_run["before"]
    # Everything else in the loop's state is the same for both loaders.
    assert without_loader_state(ferry_run["after"]) == torch_run["after"]

    # The state is that of the tuned batch size's loader, built and iter()'d by the tuner's
    # last set-up, before its first batch: what a fresh loader says then, not what it says
    # after one batch.
    states = ferry_run["after"]["state_dict"]["combined_loader"]
    assert len(states) == 1
    state = states[0]
    assert state["format"] == "ferry.DataLoader"
    assert state["loader"]["batch_size"] == TUNED_BATCH
    fresh = make_loader("ferry", TUNED_BATCH)
    iterator = iter(fresh)
    assert fresh.state_dict() == state
    next(iterator)
    assert fresh.state_dict() != state

    # Harmless: a fresh loader that loads it gives, over two epochs, exactly the batches of a
    # fresh loader with the same generator seed that loads nothing, which are torch's batches.
    untouched = batches(make_loader("ferry", TUNED_BATCH))
    resumed = make_loader("ferry", TUNED_BATCH)
    resumed.load_state_dict(state)
    assert batches(resumed) == untouched
    assert batches(make_loader("torch", TUNED_BATCH)) == untouched

    # The fit after tuning trains on exactly the batches it trains on with torch's loader (the
    # first MAX_STEPS of a fresh loader at the tuned size), to the same weights.
    assert ferry_run["fit"] == torch_run["fit"]
    assert [indices for _, _, indices in torch_run["fit"]] == untouched[0][:MAX_STEPS]
    assert list(ferry_run["weights"]) == list(torch_run["weights"])
    for key, value in torch_run["weights"].items():
        assert torch.equal(ferry_run["weights"][key], value), key
