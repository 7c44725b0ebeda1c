"""Exact mid-epoch resume of ferry's DataLoader inside a real Lightning Trainer, against torch.

Lightning 2.x saves ``loader.state_dict()`` of every train loader that has ``state_dict`` /
``load_state_dict`` (torchdata's StatefulDataLoader API, which ferry's DataLoader has) into its
checkpoints, under ``checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]``, and
hands it back to ``load_state_dict`` on ``trainer.fit(..., ckpt_path=...)`` before calling
``iter()`` on the loader. Each test here trains a tiny model on CPU whose ``training_step``
records ``(epoch, batch_idx, sample indices)`` of every batch, for three shuffled epochs:

* once without interruption: the reference sequence;
* once interrupted: a callback saves a checkpoint at ``on_train_batch_end`` of batch ``k`` (so
  batch ``k`` was trained) and raises, as a crash would;
* then resumed by a fresh Trainer with a fresh model and a fresh loader whose generator is
  seeded differently (so only the checkpoint can put the shuffle back).

What was trained before the checkpoint followed by what the resumed run trained must be the
reference sequence exactly, and the final weights must be the reference weights. The same
scenario with torch's DataLoader (no state) shows that the match is not trivial: Lightning
restarts torch's loader, so the resumed epoch repeats some samples and misses others.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.utils.data as tud
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

import ferry
from ecosystem._lightning_programs import quiet, watch_leaks

pytestmark = pytest.mark.usefixtures("guard_global_state")

ROWS = 42  # batch 4: 10 full batches and a partial one of 2 per epoch
BATCH = 4
FEATURES = 3
EPOCHS = 3
BATCHES_PER_EPOCH = 11
SEED = 1234  # the generator of every run that is not resumed
OTHER_SEED = 999  # the generator of every resumed ferry loader: the state must override it
NO_LEAKS = {"processes": [], "threads": []}
NOT_RESUMABLE = "your dataloader is not resumable"

TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "max_epochs": EPOCHS,
}

# name -> DataLoader options for ferry
WORKERS: dict[str, dict[str, Any]] = {
    "0": {},
    "2-thread": {"num_workers": 2, "worker_type": "thread"},
    "2-thread-persistent": {"num_workers": 2, "worker_type": "thread", "persistent_workers": True},
    "2-process": {"num_workers": 2},
}

Step = tuple[int, int, list[int]]  # (epoch, batch_idx, sample indices)


def _features() -> torch.Tensor:
    return torch.randn(ROWS, FEATURES, generator=torch.Generator().manual_seed(0))


def ferry_loader(seed: int, workers: str = "0") -> ferry.DataLoader:
    """Rows ``(index, features)``, shuffled by a generator seeded with ``seed``."""
    dataset = ferry.TensorDataset(torch.arange(ROWS), _features())
    generator = torch.Generator().manual_seed(seed)
    return ferry.DataLoader(
        dataset, batch_size=BATCH, shuffle=True, generator=generator, **WORKERS[workers]
    )


def torch_loader(seed: int) -> tud.DataLoader:
    dataset = tud.TensorDataset(torch.arange(ROWS), _features())
    generator = torch.Generator().manual_seed(seed)
    return tud.DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=generator)


class IndexRecorder(L.LightningModule):
    """A linear layer that records the sample indices of every training batch it receives."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights in every run
        self.layer = nn.Linear(FEATURES, 1)
        self.steps: list[Step] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        index, features = batch
        self.steps.append((self.current_epoch, batch_idx, index.tolist()))
        return self.layer(features).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.state_dict().items()}


class Crash(Exception):
    """What the interrupting callback raises once it saved its checkpoint."""


class CheckpointThenCrash(L.Callback):
    """At ``on_train_batch_end`` of (``epoch``, ``batch_idx``): save ``path``, then raise.

    Batch ``batch_idx`` was trained (and the optimizer stepped) when the hook runs. Records the
    state of ``loader`` as it stood when the checkpoint was written.
    """

    def __init__(self, epoch: int, batch_idx: int, path: Path, loader: Any) -> None:
        self.at = (epoch, batch_idx)
        self.path = path
        self.loader = loader
        self.loader_state: dict[str, Any] | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (trainer.current_epoch, batch_idx) == self.at:
            trainer.save_checkpoint(self.path)
            if hasattr(self.loader, "state_dict"):
                self.loader_state = self.loader.state_dict()
            raise Crash(f"interrupted after epoch {self.at[0]}, batch {self.at[1]}")


def fit(
    loader: Any,
    ckpt_path: Path | None = None,
    callbacks: list[L.Callback] | None = None,
    val_loader: Any = None,
    **options: Any,
) -> dict[str, Any]:
    """Fits a fresh IndexRecorder on ``loader``; a Crash from a callback ends it quietly.

    Returns the steps trained, the final weights, whether it crashed, the warnings raised and
    the worker processes/threads left behind.
    """
    model = IndexRecorder()
    trainer = L.Trainer(callbacks=callbacks or [], **{**TRAINER_DEFAULTS, **options})
    leaks: dict[str, Any] = {}
    crashed = False
    with quiet(), watch_leaks(leaks), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, loader, val_loader, ckpt_path=ckpt_path)
        except Crash:
            crashed = True
    return {
        "steps": model.steps,
        "weights": model.weights(),
        "crashed": crashed,
        "warnings": [str(w.message) for w in caught],
        "leaks": leaks,
    }


def loader_states(path: Path) -> list[dict[str, Any]] | None:
    """The loader states Lightning wrote into the checkpoint at ``path`` (None: none)."""
    checkpoint = torch.load(path, weights_only=False)
    return checkpoint["loops"]["fit_loop"]["state_dict"].get("combined_loader")


def interrupt_and_resume(
    make: Callable[[int], Any], epoch: int, batch_idx: int, path: Path, resume_seed: int
) -> tuple[dict[str, Any], dict[str, Any], CheckpointThenCrash]:
    """Runs until the checkpoint at (epoch, batch_idx) and crashes; resumes on a fresh loader."""
    loader = make(SEED)
    crash = CheckpointThenCrash(epoch, batch_idx, path, loader)
    before = fit(loader, callbacks=[crash])
    assert before["crashed"]
    assert before["steps"][-1][:2] == (epoch, batch_idx)  # batch k was trained, then the crash
    after = fit(make(resume_seed), ckpt_path=path)
    assert not after["crashed"]
    return before, after, crash


def _indices(steps: list[Step]) -> list[list[int]]:
    return [indices for _, _, indices in steps]


def _epoch_orders(steps: list[Step]) -> dict[int, list[int]]:
    orders: dict[int, list[int]] = {}
    for epoch, _, indices in steps:
        orders.setdefault(epoch, []).extend(indices)
    return orders


def _assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def _check_reference(result: dict[str, Any]) -> None:
    """An uninterrupted run worth matching: 3 shuffled epochs, each a different permutation."""
    assert not result["crashed"]
    assert result["leaks"] == NO_LEAKS
    steps = result["steps"]
    labels = [(e, b) for e in range(EPOCHS) for b in range(BATCHES_PER_EPOCH)]
    assert [s[:2] for s in steps] == labels
    orders = _epoch_orders(steps)
    for order in orders.values():
        assert sorted(order) == list(range(ROWS))
        assert order != list(range(ROWS))
    assert len({tuple(order) for order in orders.values()}) == EPOCHS


@pytest.fixture(scope="module")
def references() -> Callable[[str], dict[str, Any]]:
    """``references(workers)``: the uninterrupted run of ``ferry_loader(SEED, workers)``.

    Per worker setting: persistent workers draw fewer numbers from the loader's generator
    (one worker base seed per loader, not per epoch, as in torch), so from epoch 1 on they
    shuffle differently.
    """
    cache: dict[str, dict[str, Any]] = {}

    def get(workers: str) -> dict[str, Any]:
        if workers not in cache:
            result = fit(ferry_loader(SEED, workers))
            _check_reference(result)
            cache[workers] = result
        return cache[workers]

    return get


@pytest.fixture
def reference(references) -> dict[str, Any]:
    return references("0")


def _check_exact_resume(
    before: dict[str, Any], after: dict[str, Any], reference: dict[str, Any], trained: int
) -> None:
    """``before`` trained the first ``trained`` steps; ``after`` trained exactly the rest."""
    want = reference["steps"]
    assert before["steps"] == want[:trained]
    # The boundary first, for a readable failure: the step right after the checkpoint.
    assert after["steps"][:1] == want[trained : trained + 1]
    assert after["steps"] == want[trained:]
    assert before["steps"] + after["steps"] == want
    _assert_same_weights(after["weights"], reference["weights"])
    for run in (before, after):
        assert not [w for w in run["warnings"] if NOT_RESUMABLE in w]
        assert run["leaks"] == NO_LEAKS


# -- mid-epoch ------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", list(WORKERS))
def test_mid_epoch_checkpoint_resumes_exactly(references, tmp_path: Path, workers: str) -> None:
    """Checkpoint after batch 4 of epoch 1, crash, resume: the rest of epoch 1, then epoch 2.

    The checkpoint holds the loader's state (Lightning's ``combined_loader``), Lightning does
    not warn that the loader is not resumable, and the resumed run trains exactly the batches
    the uninterrupted run trained after that point, with the same ``batch_idx`` s, ending with
    the same weights.
    """
    path = tmp_path / "mid.ckpt"
    make = lambda seed: ferry_loader(seed, workers)  # noqa: E731
    before, after, crash = interrupt_and_resume(make, 1, 4, path, OTHER_SEED)

    states = loader_states(path)
    assert states is not None, "Lightning saved no loader state"
    assert len(states) == 1
    assert states[0] == crash.loader_state  # what loader.state_dict() said at the checkpoint
    assert states[0]["format"] == "ferry.DataLoader"
    assert states[0]["loader"]["num_workers"] == WORKERS[workers].get("num_workers", 0)

    _check_exact_resume(before, after, references(workers), BATCHES_PER_EPOCH + 5)
    assert after["steps"][0][:2] == (1, 5)


@pytest.mark.timeout(60)
def test_resume_twice(reference, tmp_path: Path) -> None:
    """A resumed run's own mid-epoch checkpoint resumes exactly too (state of a loaded loader)."""
    first, second = tmp_path / "first.ckpt", tmp_path / "second.ckpt"
    before = fit(ferry_loader(SEED), callbacks=[CheckpointThenCrash(0, 7, first, None)])
    middle = fit(
        ferry_loader(OTHER_SEED),
        ckpt_path=first,
        callbacks=[CheckpointThenCrash(2, 2, second, None)],
    )
    after = fit(ferry_loader(OTHER_SEED + 1), ckpt_path=second)
    assert before["crashed"]
    assert middle["crashed"]
    assert not after["crashed"]
    want = reference["steps"]
    assert before["steps"] == want[:8]
    assert middle["steps"] == want[8 : 2 * BATCHES_PER_EPOCH + 3]
    assert not [w for w in middle["warnings"] if NOT_RESUMABLE in w]
    assert middle["leaks"] == NO_LEAKS
    _check_exact_resume(
        {**before, "steps": before["steps"] + middle["steps"]},
        after,
        reference,
        2 * BATCHES_PER_EPOCH + 3,
    )


@pytest.mark.timeout(60)
def test_model_checkpoint_after_mid_epoch_validation(reference, tmp_path: Path) -> None:
    """``ModelCheckpoint`` saving where validation ends, mid-epoch (``val_check_interval=5``).

    The run stops (``trainer.should_stop``) after the validation at step 16 (batch 4 of epoch
    1); the resumed run continues from that checkpoint with batch 5 of epoch 1.
    """
    validation = ferry.DataLoader(
        ferry.TensorDataset(torch.arange(8), torch.zeros(8, FEATURES)), batch_size=4
    )

    class StopAfterValidation(L.Callback):
        def on_validation_end(self, trainer, pl_module) -> None:
            if trainer.global_step == BATCHES_PER_EPOCH + 5:
                trainer.should_stop = True

    before = fit(
        ferry_loader(SEED),
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_top_k=-1), StopAfterValidation()],
        val_loader=validation,
        enable_checkpointing=True,
        val_check_interval=5,
    )
    path = tmp_path / f"epoch=1-step={BATCHES_PER_EPOCH + 5}.ckpt"
    assert path.exists(), sorted(p.name for p in tmp_path.iterdir())
    assert loader_states(path) is not None
    after = fit(ferry_loader(OTHER_SEED), path, val_loader=validation, val_check_interval=5)
    assert not before["crashed"]
    assert not after["crashed"]
    _check_exact_resume(before, after, reference, BATCHES_PER_EPOCH + 5)


# -- end of epoch ---------------------------------------------------------------------------------


@pytest.mark.timeout(60)
# The reference, torchdata's StatefulDataLoader, calls torch.set_vital, which torch 2.13
# deprecates: torchdata's warning, not ferry's.
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
@pytest.mark.parametrize("workers", ["0", "2-thread"])
def test_checkpoint_at_last_batch_resumes_as_torchdatas_loader(
    references, tmp_path: Path, workers: str
) -> None:
    """Checkpoint at the last batch of epoch 0, inside the loop (StopIteration not seen).

    As with torchdata's StatefulDataLoader (run side by side here), the resumed iterator ends
    epoch 0 without a batch. Lightning 2.6 calls ``iter()`` for epoch 1 at once, so its epoch 1
    trains nothing and its epoch 2 trains what epoch 1 would have: the same steps as
    torchdata's loader gives inside Lightning (a Lightning limit, in the README).
    """
    path = tmp_path / "end.ckpt"
    make = lambda seed: ferry_loader(seed, workers)  # noqa: E731
    before, after, _ = interrupt_and_resume(make, 0, BATCHES_PER_EPOCH - 1, path, OTHER_SEED)
    assert loader_states(path) is not None
    want = references(workers)["steps"]
    assert before["steps"] == want[:BATCHES_PER_EPOCH]
    shifted = [(2, b, indices) for _, b, indices in want[BATCHES_PER_EPOCH : 2 * BATCHES_PER_EPOCH]]
    assert after["steps"] == shifted

    reference_path = tmp_path / "sdl.ckpt"
    _, sdl_after, _ = interrupt_and_resume(
        sdl_loader, 0, BATCHES_PER_EPOCH - 1, reference_path, OTHER_SEED
    )
    assert [s[:2] for s in sdl_after["steps"]] == [s[:2] for s in after["steps"]]


def sdl_loader(seed: int) -> Any:
    """torchdata's StatefulDataLoader over the same rows (its own shuffle order)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    dataset = tud.TensorDataset(torch.arange(ROWS), _features())
    generator = torch.Generator().manual_seed(seed)
    return StatefulDataLoader(dataset, batch_size=BATCH, shuffle=True, generator=generator)


@pytest.mark.timeout(60)
def test_epoch_end_model_checkpoint_is_not_loaded_by_lightning(reference, tmp_path: Path) -> None:
    """``ModelCheckpoint`` at ``on_train_epoch_end`` (its default without validation).

    Lightning 2.6 writes the loader's state into that checkpoint but does not load it back:
    the epoch counts as finished, so the fit loop is not "restarting" and
    ``_load_combined_loader_states`` returns early. The fresh loader then starts from its own
    seed: with the seed of the original run, epoch 1 repeats epoch 0's order. (The state was
    taken after the epoch's last batch, inside the loop: loaded by hand it would end epoch 0,
    as torchdata's does, so Lightning's epoch 1 would train nothing.)
    """
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    before = fit(
        ferry_loader(SEED), callbacks=[checkpoints], enable_checkpointing=True, max_epochs=1
    )
    path = tmp_path / f"epoch=0-step={BATCHES_PER_EPOCH}.ckpt"
    states = loader_states(path)
    assert states is not None
    want = reference["steps"]
    assert before["steps"] == want[:BATCHES_PER_EPOCH]
    plain = fit(ferry_loader(SEED), ckpt_path=path)
    assert _indices(plain["steps"][:BATCHES_PER_EPOCH]) == _indices(want[:BATCHES_PER_EPOCH])


# -- torch's DataLoader: what happens without a loader state --------------------------------------


@pytest.mark.timeout(60)
def test_torch_loader_restarts_the_epoch(reference, tmp_path: Path) -> None:
    """The same mid-epoch crash and resume with ``torch.utils.data.DataLoader``.

    Its uninterrupted run sees what ferry's sees, but the checkpoint holds no loader state,
    Lightning warns that the loader is not resumable, and the resumed run, even with the
    original seed, draws epoch 1's remaining batches from a restarted shuffle: epoch 1 then
    repeats some samples and misses others, and the weights differ.
    """
    uninterrupted = fit(torch_loader(SEED))
    assert uninterrupted["steps"] == reference["steps"]

    path = tmp_path / "torch.ckpt"
    before, after, _ = interrupt_and_resume(torch_loader, 1, 4, path, SEED)
    assert loader_states(path) is None
    assert any(NOT_RESUMABLE in w for w in after["warnings"])

    trained = BATCHES_PER_EPOCH + 5
    want = reference["steps"]
    assert before["steps"] == want[:trained]
    # Lightning resumes its own counters: the same (epoch, batch_idx) labels ...
    assert [s[:2] for s in after["steps"]] == [s[:2] for s in want[trained:]]
    # ... but not the data.
    assert after["steps"] != want[trained:]
    epoch1 = _epoch_orders(before["steps"] + after["steps"])[1]
    assert sorted(epoch1) != list(range(ROWS))
    assert not all(
        torch.equal(after["weights"][k], reference["weights"][k]) for k in reference["weights"]
    )
