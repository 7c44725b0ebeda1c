"""ferry inside ``transformers.Trainer`` (CPU, a tiny torch model, no downloads).

``Trainer`` builds its training loader in ``get_train_dataloader`` (a torch ``DataLoader`` over a
``RandomSampler``, the collator wrapped to drop the columns the model does not take) and passes
it through ``accelerator.prepare``. ``FerryTrainer`` below is the recipe for training on ferry's
engine: the same loader built with ferry, prepared inside ``ferry.accelerate.installed()`` so that
accelerate's rebuild of it stays a ferry loader. Simpler still, the stock ``Trainer`` run while
``ferry.accelerate`` is installed: accelerate then rebuilds the Trainer's own torch loader as a
ferry loader. With default ``TrainingArguments`` (seedable sampler included) every trainer must
log exactly the same loss at every step and end with exactly the same weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from accelerate.state import AcceleratorState, GradientState
from torch import nn
from transformers import Trainer, TrainingArguments

import ferry
import ferry.accelerate

pytestmark = pytest.mark.usefixtures("guard_global_state")


class FerryTrainer(Trainer):
    """A ``Trainer`` whose training batches come from ferry's engine."""

    def get_train_dataloader(self) -> Any:
        dataset = self.train_dataset
        loader = ferry.DataLoader(
            dataset,
            batch_size=self._train_batch_size,
            sampler=ferry.RandomSampler(dataset),
            collate_fn=self._get_collator_with_removed_columns(self.data_collator, "training"),
            drop_last=self.args.dataloader_drop_last,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers,
            prefetch_factor=self.args.dataloader_prefetch_factor,
        )
        with ferry.accelerate.installed():
            return self.accelerator.prepare(loader)


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.mse_loss(self.linear(x).squeeze(-1), labels)}


class Points(ferry.Dataset[dict[str, torch.Tensor]]):
    """20 samples: with the default batch size of 8, each epoch ends on a short batch."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(20, 4, generator=g)
        self.y = torch.randn(20, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


EPOCHS = 2
STEPS = 3 * EPOCHS


def _train(trainer_cls: type[Trainer], out: Path, install: bool = False) -> dict[str, Any]:
    if install:
        with ferry.accelerate.installed():
            return _train(trainer_cls, out)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    torch.manual_seed(0)
    model = Regressor()
    args = TrainingArguments(
        output_dir=str(out),
        num_train_epochs=EPOCHS,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
    )
    trainer = trainer_cls(model=model, args=args, train_dataset=Points())
    trainer.train()
    return {
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "steps": trainer.state.global_step,
        "weights": [p.detach().clone() for p in model.parameters()],
        "base": type(trainer.get_train_dataloader().base_dataloader),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    rng = torch.get_rng_state()
    try:
        yield {
            name: _train(cls, tmp_path_factory.mktemp(name), install)
            for name, cls, install in (
                ("stock", Trainer, False),
                ("ferry", FerryTrainer, False),
                # The one-line recipe: the stock Trainer, with accelerate building ferry loaders.
                ("installed", Trainer, True),
            )
        }
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        torch.set_rng_state(rng)


@pytest.mark.timeout(90)
def test_ferry_trainer_logs_the_stock_losses(runs: dict[str, dict[str, Any]]) -> None:
    stock = runs["stock"]
    assert len(stock["losses"]) == STEPS
    for name in ("ferry", "installed"):
        ours = runs[name]
        assert stock["steps"] == ours["steps"] == STEPS
        assert ours["losses"] == stock["losses"]
        for a, b in zip(ours["weights"], stock["weights"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.timeout(90)
def test_ferry_trainer_trains_on_ferrys_engine(runs: dict[str, dict[str, Any]]) -> None:
    assert runs["ferry"]["base"] is ferry.DataLoader
    assert runs["installed"]["base"] is ferry.DataLoader
    assert runs["stock"]["base"] is torch.utils.data.DataLoader
    assert not ferry.accelerate.is_installed()
