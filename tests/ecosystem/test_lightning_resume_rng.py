"""Resume inside Lightning when the loader has no generator: torch's global RNG decides.

With ``generator=None`` a loader draws each epoch's shuffle and its workers' base seed from
torch's global RNG, as torch's loader does. Lightning does not restore that RNG from a
checkpoint; a user who calls ``seed_everything(0)`` in the new process puts it back where the
first process began. Two promises are checked here with a real Trainer:

* never a silent replay: the resumed run either trains exactly what the uninterrupted run
  trained (ids and random augmentations alike), or says, with
  :class:`ferry.errors.EpochReplayWarning`, that an epoch repeats an earlier one;
* restart parity: the resumed Trainer ends with the same ``fit_loop.state_dict()`` (the loader's
  state included) as the uninterrupted one.

Each "process" here is a fresh Trainer, model and loader after ``seed_everything(0)``, which
leaves the global generators exactly as a new process that seeds them does.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

import ferry
from ecosystem._lightning_programs import quiet
from ferry.errors import EpochReplayWarning

pytestmark = pytest.mark.usefixtures("guard_global_state")

ROWS = 24
BATCH = 4  # 6 batches an epoch
EPOCHS = 3


class AugmentedRows(ferry.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Row ``i`` as ``(code, features)``: ``code`` is ``1000 * i`` plus a random augmentation
    drawn from the worker's global torch RNG, so a recorded code shows both."""

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = int(torch.randint(0, 1000, ()).item())
        return torch.tensor(1000 * index + noise), torch.full((2,), float(index))


class Recorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.steps: list[tuple[int, int, list[int]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        code, features = batch
        self.steps.append((self.current_epoch, batch_idx, code.tolist()))
        return self.layer(features).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Crash(Exception):
    pass


class SaveThenCrash(L.Callback):
    def __init__(self, at: tuple[int, int], path: Path) -> None:
        self.at, self.path = at, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (trainer.current_epoch, batch_idx) == self.at:
            trainer.save_checkpoint(self.path)
            raise Crash


def run(
    loader_options: dict[str, Any], crash: SaveThenCrash | None = None, ckpt: Path | None = None
) -> dict[str, Any]:
    """One "process": seed_everything(0), a fresh model, loader and Trainer, then fit."""
    L.seed_everything(0, verbose=False)
    model = Recorder()
    loader = ferry.DataLoader(AugmentedRows(), batch_size=BATCH, shuffle=True, **loader_options)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        max_epochs=EPOCHS,
        callbacks=[crash] if crash is not None else [],
    )
    crashed = False
    with quiet(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, loader, ckpt_path=ckpt)
        except Crash:
            crashed = True
    return {
        "steps": model.steps,
        "crashed": crashed,
        "replay_warnings": [w for w in caught if issubclass(w.category, EpochReplayWarning)],
        "fit_loop": trainer.fit_loop.state_dict(),
    }


LOADERS = {
    "2-process": {"num_workers": 2, "multiprocessing_context": "fork"},
    "2-thread": {"num_workers": 2, "worker_type": "thread"},
    "0": {},
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", list(LOADERS))
def test_fresh_process_resume_without_generator_never_replays_silently(
    tmp_path: Path, workers: str
) -> None:
    """seed_everything(0), shuffle, no generator, resumed at step 3 of a 6-batch epoch."""
    options = LOADERS[workers]
    reference = run(options)
    assert not reference["crashed"]
    orders = [[s[2] for s in reference["steps"] if s[0] == e] for e in range(EPOCHS)]
    assert len({str(o) for o in orders}) == EPOCHS  # every epoch its own shuffle

    path = tmp_path / "mid.ckpt"
    before = run(options, SaveThenCrash((0, 2), path))
    assert before["crashed"]
    after = run(options, ckpt=path)
    assert not after["crashed"]
    if after["replay_warnings"]:
        return  # said, not silent
    trained = before["steps"] + after["steps"]
    if workers == "2-process":
        # Process workers restore their generators, and the resumed epoch draws from the
        # global RNG what the first one drew: ids and augmentations resume exactly.
        assert trained == reference["steps"]
    else:
        # Threads and the main process draw the augmentations from torch's global RNG, which
        # the user owns (Lightning does not restore it), so later epochs' shuffles draw from
        # another point of it: the resumed epoch's ids are exact, and nothing repeats.
        epoch_0 = [project(s, False) for s in trained if s[0] == 0]
        assert epoch_0 == [project(s, False) for s in reference["steps"] if s[0] == 0]
    # No epoch of the resumed run repeats an earlier one.
    ids = [[project(s, False)[2] for s in reference["steps"] if s[0] == e] for e in range(EPOCHS)]
    resumed = [[project(s, False)[2] for s in after["steps"] if s[0] == e] for e in (1, 2)]
    assert all(order not in ids[:number] for number, order in enumerate(resumed, 1))


def project(step: tuple[int, int, list[int]], exact: bool) -> tuple[int, int, list[int]]:
    """A recorded step, with (exact) or without the augmentation part of its codes."""
    epoch, batch_idx, codes = step
    return epoch, batch_idx, codes if exact else [code // 1000 for code in codes]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", ["2-process", "0"])
def test_resumed_trainer_ends_with_the_uninterrupted_fit_loop_state(
    tmp_path: Path, workers: str
) -> None:
    """The loader's state holds what affects the rest of the run, and nothing else: a
    resumed Trainer ends with the same fit_loop.state_dict() as the uninterrupted one."""
    options = {**LOADERS[workers], "generator": torch.Generator().manual_seed(5)}
    reference = run(options)
    path = tmp_path / "mid.ckpt"
    run({**options, "generator": torch.Generator().manual_seed(5)}, SaveThenCrash((1, 3), path))
    after = run({**options, "generator": torch.Generator().manual_seed(77)}, ckpt=path)
    exact = workers == "2-process"  # (inline, augmentations come from the user's global RNG)
    tail = reference["steps"][len(reference["steps"]) - len(after["steps"]) :]
    assert [project(s, exact) for s in after["steps"]] == [project(s, exact) for s in tail]
    assert after["fit_loop"] == reference["fit_loop"]


@pytest.mark.timeout(120)
def test_replay_is_said_when_the_global_rng_is_put_back(tmp_path: Path) -> None:
    """A loop that puts torch's global RNG back where it stood when an epoch began (here by
    hand, as a resumed run that reseeds and draws differently would) is told, not silent."""
    loader = ferry.DataLoader(AugmentedRows(), batch_size=BATCH, shuffle=True)
    torch.manual_seed(3)
    first = [batch[0].tolist() for batch in loader]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(3)
        again = [batch[0].tolist() for batch in loader]
    assert [b[0] // 1000 for b in again] == [b[0] // 1000 for b in first]
    assert [w for w in caught if issubclass(w.category, EpochReplayWarning)]
    # With a generator, later epochs are the loader's own: nothing to say.
    owned = ferry.DataLoader(
        AugmentedRows(), batch_size=BATCH, shuffle=True, generator=torch.Generator()
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            torch.manual_seed(3)
            list(owned)
    assert not [w for w in caught if issubclass(w.category, EpochReplayWarning)]
