"""The Lightning programs that ``test_lightning.py`` (and ``_lightning_ddp_main.py``) run.

Each program takes ``impl`` (``"torch"`` or ``"ferry"``): the module its loaders and datasets
come from. It does everything else the same way, so the two runs must see the same batches.
Programs return plain data (tensors, lists, strings) that the tests compare.

Rows are ``(x, y, index)``: the index column tells which samples a step saw.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import numpy as np
import psutil
import torch
import torch.nn.functional as F
import torch.utils.data as tud
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import nn

import ferry
from ecosystem._injection import describe

IMPLS: dict[str, Any] = {"torch": tud, "ferry": ferry}
SEED = 1234
FEATURES = 4
TRAIN_ROWS = 150  # batch 16: 9 full batches and a partial one per epoch
EVAL_ROWS = 40  # batch 16: 2 full batches and a partial one
BATCH = 16

TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "cpu",
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "max_epochs": 2,
}

# multiprocessing's process-wide helpers: started once, not per loader, so never a "leak".
_MP_HELPERS = (
    "multiprocessing.forkserver import main",
    "multiprocessing.resource_tracker import main",
)


def rows(impl: str, n: int, seed: int) -> Any:
    """A TensorDataset of ``n`` rows ``(x, y, index)`` built from its own generator."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)
    return IMPLS[impl].TensorDataset(x, y, torch.arange(n))


def loader(impl: str, dataset: Any, workers: str = "0", **kwargs: Any) -> Any:
    """``impl``'s DataLoader; ``workers`` is ``"0"``, ``"2"``, ``"2-persistent"``, ``"2-thread"``.

    ``"2-thread"`` runs ferry's thread workers (``worker_type="thread"``); torch has none, so
    its torch run uses two worker processes, which must yield the same batches.
    """
    options: dict[str, Any] = {"batch_size": BATCH, **kwargs}
    if workers != "0":
        options["num_workers"] = 2
    if workers == "2-persistent":
        options["persistent_workers"] = True
    if workers == "2-thread" and impl == "ferry":
        options["worker_type"] = "thread"
    return IMPLS[impl].DataLoader(dataset, **options)


# -- datasets whose class must come from impl ---------------------------------------------------


class _NoisyRows:
    """Rows plus noise drawn from torch, ``random`` and numpy in the process that loads them."""

    def __init__(self, base: Any) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        x, y, index = self.base[i]
        noise = torch.tensor([torch.rand(()).item(), random.random(), float(np.random.rand())])
        return x, y, index, noise


class NoisyTorch(_NoisyRows, tud.Dataset):
    pass


class NoisyFerry(_NoisyRows, ferry.Dataset):
    pass


class _SizedStream:
    """An iterable-style dataset with ``__len__``: rows in order, split between workers."""

    def __init__(self, base: Any, get_worker_info: Callable[[], Any]) -> None:
        self.base = base
        self.get_worker_info = get_worker_info

    def __len__(self) -> int:
        return len(self.base)

    def __iter__(self) -> Iterator[Any]:
        info = self.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, len(self.base), step):
            yield self.base[i]


class SizedStreamTorch(_SizedStream, tud.IterableDataset):
    def __init__(self, base: Any) -> None:
        super().__init__(base, tud.get_worker_info)


class SizedStreamFerry(_SizedStream, ferry.IterableDataset):
    def __init__(self, base: Any) -> None:
        super().__init__(base, ferry.get_worker_info)


NOISY = {"torch": NoisyTorch, "ferry": NoisyFerry}
SIZED_STREAM = {"torch": SizedStreamTorch, "ferry": SizedStreamFerry}


# -- the LightningModules -------------------------------------------------------------------------


class Recorder(L.LightningModule):
    """Linear regression that records every batch each step saw, keyed by where it saw it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(FEATURES, 1)
        self.seen: dict[str, list[list[torch.Tensor]]] = defaultdict(list)

    def _record(self, key: str, batch: Any) -> None:
        self.seen[key].append([t.detach().clone() for t in batch])

    def _loss(self, batch: Any) -> torch.Tensor:
        return F.mse_loss(self.layer(batch[0]), batch[1])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._record(f"train/epoch{self.current_epoch}", batch)
        return self._loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.sanity_checking:
            key = "sanity"
        elif self.trainer.state.fn == "fit":
            key = f"val/epoch{self.current_epoch}"
        else:
            key = "validate"
        self._record(key, batch)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._record("test", batch)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._record("predict", batch)
        return self.layer(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.state_dict().items()}


class LoaderHooks:
    """The four ``*_dataloader`` hooks, each asking ``self.make(stage)`` for its loader."""

    make: Callable[[str], Any]

    def train_dataloader(self) -> Any:
        return self.make("train")

    def val_dataloader(self) -> Any:
        return self.make("val")

    def test_dataloader(self) -> Any:
        return self.make("test")

    def predict_dataloader(self) -> Any:
        return self.make("predict")


class HookRecorder(LoaderHooks, Recorder):
    """A Recorder whose loaders come from its ``*_dataloader`` hooks."""

    def __init__(self, make: Callable[[str], Any]) -> None:
        super().__init__()
        self.make = make


class DataModule(LoaderHooks, L.LightningDataModule):
    def __init__(self, make: Callable[[str], Any]) -> None:
        super().__init__()
        self.make = make


class IndexWriter(BasePredictionWriter):
    """Records the ``batch_indices`` Lightning hands a prediction writer."""

    def __init__(self) -> None:
        super().__init__(write_interval="batch_and_epoch")
        self.batch_indices: list[list[int]] = []
        self.epoch_batch_indices: list[Any] = []

    def write_on_batch_end(  # noqa: PLR0917 - Lightning calls it with positional arguments
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx
    ):
        self.batch_indices.append(list(batch_indices) if batch_indices is not None else None)

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        self.epoch_batch_indices.append(batch_indices)


# -- leak checks ----------------------------------------------------------------------------------


def _children() -> dict[int, str]:
    """Every live process below this one but multiprocessing's helpers: pid -> command line."""
    found = {}
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                cmd = "<zombie>"
            else:
                cmd = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        if not any(helper in cmd for helper in _MP_HELPERS):
            found[child.pid] = cmd
    return found


def _ferry_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("ferry-worker-"))


@contextlib.contextmanager
def watch_leaks(leaks: dict[str, Any], grace_s: float = 5.0) -> Iterator[None]:
    """Fills ``leaks`` with the processes and ferry threads the block left behind.

    Polls for ``grace_s`` before giving up: workers may take a moment to exit.
    """
    before = set(_children())
    try:
        yield
    finally:
        deadline = time.monotonic() + grace_s
        while True:
            procs = {pid: cmd for pid, cmd in _children().items() if pid not in before}
            threads = _ferry_threads()
            if (not procs and not threads) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        leaks["processes"] = sorted(procs.values())
        leaks["threads"] = threads


@contextlib.contextmanager
def isolated_seed() -> Iterator[None]:
    """Lets a program seed everything, then puts back the RNGs and the variables it set."""
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    env = {k: os.environ.get(k) for k in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def quiet() -> contextlib.AbstractContextManager[Any]:
    """Keeps Lightning's info logs (GPU available, ...) off the output."""
    import logging

    class _Quiet(contextlib.ContextDecorator):
        def __enter__(self) -> None:
            self.loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
            self.levels = [lg.level for lg in self.loggers]
            for lg in self.loggers:
                lg.setLevel(logging.WARNING)

        def __exit__(self, *exc: object) -> None:
            for lg, level in zip(self.loggers, self.levels, strict=True):
                lg.setLevel(level)

    return _Quiet()


def seen_indices(seen: dict[str, list[list[torch.Tensor]]]) -> dict[str, list[list[int]]]:
    """The index column of every recorded batch."""
    return {key: [batch[2].tolist() for batch in batches] for key, batches in seen.items()}


# -- the programs ---------------------------------------------------------------------------------


@contextlib.contextmanager
def program(result: dict[str, Any], workers_seed: bool = False) -> Iterator[None]:
    """Seeds as a user would and records the warnings and the leftovers of the block."""
    leaks: dict[str, Any] = {}
    with (
        isolated_seed(),
        quiet(),
        warnings.catch_warnings(record=True) as caught,
        watch_leaks(leaks),
    ):
        warnings.simplefilter("always")
        L.seed_everything(SEED, workers=workers_seed, verbose=False)
        yield
    result["leaks"] = leaks
    result["warnings"] = sorted(f"{w.category.__name__}: {w.message}" for w in caught)


def _evaluate_all(trainer: L.Trainer, model: Recorder, **source: Any) -> Any:
    """validate, test and predict (returning predictions) after a fit, on the same source."""
    trainer.validate(model, **source)
    trainer.test(model, **source)
    return trainer.predict(model, return_predictions=True, **source)


def _finish(result: dict[str, Any], model: Recorder, writer: IndexWriter, predictions: Any) -> None:
    result["seen"] = dict(model.seen)
    result["weights"] = model.weights()
    result["predictions"] = predictions
    result["batch_indices"] = writer.batch_indices
    result["epoch_batch_indices"] = writer.epoch_batch_indices


def run_hooks(impl: str, workers: str) -> dict[str, Any]:
    """fit (train + val), validate, test, predict with loaders from the module's hooks."""
    train, evals = rows(impl, TRAIN_ROWS, 1), rows(impl, EVAL_ROWS, 2)

    def make(stage: str) -> Any:
        if stage == "train":
            return loader(impl, train, workers, shuffle=True)
        return loader(impl, evals, workers)

    result: dict[str, Any] = {}
    with program(result):
        model = HookRecorder(make)
        writer = IndexWriter()
        trainer = L.Trainer(callbacks=[writer], **TRAINER_DEFAULTS)
        trainer.fit(model)
        predictions = _evaluate_all(trainer, model)
    _finish(result, model, writer, predictions)
    return result


def run_direct(impl: str) -> dict[str, Any]:
    """Loaders built by the user and passed to fit/validate/test/predict.

    The evaluation loader keeps its workers (persistent) and serves every stage; Lightning
    resets it (``loader._iterator = None``) after each one and rebuilds it for predict.
    """
    train = loader(impl, rows(impl, TRAIN_ROWS, 1), "2", shuffle=True)
    evals = loader(impl, rows(impl, EVAL_ROWS, 2), "2-persistent")
    result: dict[str, Any] = {}
    with program(result):
        model = Recorder()
        writer = IndexWriter()
        trainer = L.Trainer(callbacks=[writer], **TRAINER_DEFAULTS)
        trainer.fit(model, train_dataloaders=train, val_dataloaders=evals)
        predictions = _evaluate_all(trainer, model, dataloaders=evals)
    _finish(result, model, writer, predictions)
    return result


def run_datamodule(impl: str) -> dict[str, Any]:
    """Loaders from a LightningDataModule, rows with random noise drawn where they are loaded.

    ``seed_everything(workers=True)`` makes Lightning add its ``worker_init_fn``, which seeds
    torch, ``random`` and numpy in each worker from the worker's torch seed: the noise matches
    torch's only if ferry seeds its workers and spreads the batches over them as torch does.
    """
    train = NOISY[impl](rows(impl, TRAIN_ROWS, 1))
    evals = NOISY[impl](rows(impl, EVAL_ROWS, 2))

    def make(stage: str) -> Any:
        if stage == "train":
            return loader(impl, train, "2", shuffle=True)
        return loader(impl, evals, "2")

    result: dict[str, Any] = {}
    with program(result, workers_seed=True):
        model = Recorder()
        datamodule = DataModule(make)
        writer = IndexWriter()
        trainer = L.Trainer(callbacks=[writer], **TRAINER_DEFAULTS)
        trainer.fit(model, datamodule=datamodule)
        predictions = _evaluate_all(trainer, model, datamodule=datamodule)
    _finish(result, model, writer, predictions)
    return result


def run_overfit(impl: str) -> dict[str, Any]:
    """``Trainer(overfit_batches=2)``: Lightning swaps the shuffled sampler for a sequential one."""
    train, evals = rows(impl, TRAIN_ROWS, 1), rows(impl, EVAL_ROWS, 2)

    def make(stage: str) -> Any:
        if stage == "train":
            return loader(impl, train, "0", shuffle=True)
        return loader(impl, evals, "0")

    result: dict[str, Any] = {}
    with program(result):
        model = HookRecorder(make)
        trainer = L.Trainer(overfit_batches=2, **TRAINER_DEFAULTS)
        trainer.fit(model)
    result["seen"] = dict(model.seen)
    result["weights"] = model.weights()
    return result


def run_warnings(impl: str) -> dict[str, Any]:
    """A fit whose loaders trip Lightning's checks: every one must fire for ferry as for torch.

    The train set is an IterableDataset with ``__len__``, the val loader shuffles, both load
    in the main process. Lightning warns about too few workers only where it could suggest
    more (``_num_cpus_available() > 2``): the probe is pinned to 8 CPUs so that the check runs
    on any machine, whatever its core count.
    """
    from lightning.fabric.utilities import data as fabric_data

    train = SIZED_STREAM[impl](rows(impl, TRAIN_ROWS, 1))
    evals = rows(impl, EVAL_ROWS, 2)

    def make(stage: str) -> Any:
        if stage == "train":
            return loader(impl, train, "0")
        return loader(impl, evals, "0", shuffle=True)

    result: dict[str, Any] = {}
    probe = fabric_data._num_cpus_available
    fabric_data._num_cpus_available = lambda: 8
    try:
        with program(result):
            model = HookRecorder(make)
            trainer = L.Trainer(**TRAINER_DEFAULTS)
            trainer.fit(model)
    finally:
        fabric_data._num_cpus_available = probe
    result["seen"] = dict(model.seen)
    result["weights"] = model.weights()
    result["num_training_batches"] = trainer.num_training_batches
    return result


def run_fabric(impl: str) -> dict[str, Any]:
    """A Fabric training loop over ``fabric.setup_dataloaders(loader)``, 2 epochs."""
    result: dict[str, Any] = {}
    seen: list[list[torch.Tensor]] = []
    with program(result):
        fabric = L.Fabric(accelerator="cpu", devices=1)
        model = nn.Linear(FEATURES, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, optimizer = fabric.setup(model, optimizer)
        source = loader(impl, rows(impl, TRAIN_ROWS, 1), "2", shuffle=True)
        wrapped = fabric.setup_dataloaders(source)
        result["wrapped_type"] = type(wrapped).__name__
        result["len"] = len(wrapped)
        for _epoch in range(2):
            for batch in wrapped:
                seen.append([t.detach().clone() for t in batch])
                loss = F.mse_loss(model(batch[0]), batch[1])
                fabric.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    result["seen"] = seen
    result["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return result


PROGRAMS: dict[str, Callable[[str], dict[str, Any]]] = {
    "hooks-0": lambda impl: run_hooks(impl, "0"),
    "hooks-2": lambda impl: run_hooks(impl, "2"),
    "hooks-2-persistent": lambda impl: run_hooks(impl, "2-persistent"),
    "hooks-2-thread": lambda impl: run_hooks(impl, "2-thread"),
    "direct": run_direct,
    "datamodule": run_datamodule,
    "overfit": run_overfit,
    "warnings": run_warnings,
    "fabric": run_fabric,
}


def run_ddp(impl: str) -> dict[str, Any]:
    """fit (train + val) and predict under ``strategy="ddp"`` in a rank started from outside.

    Lightning sees the rank's environment (``LOCAL_RANK`` etc.), joins the gloo group instead
    of spawning, and swaps each loader's sampler for a DistributedSampler (an unrepeated one
    for predict) by rebuilding the loader from the arguments its hook gave it.
    """
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    train, evals = rows(impl, TRAIN_ROWS, 1), rows(impl, EVAL_ROWS, 2)

    def make(stage: str) -> Any:
        if stage == "train":
            return loader(impl, train, "2", shuffle=True)
        return loader(impl, evals, "0")

    result: dict[str, Any] = {}
    with program(result):
        model = HookRecorder(make)
        writer = IndexWriter()
        strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=30))
        trainer = L.Trainer(
            callbacks=[writer], devices=2, num_nodes=1, strategy=strategy, **TRAINER_DEFAULTS
        )
        trainer.fit(model)
        # What Lightning made of each loader when it injected a DistributedSampler.
        result["loaders"] = {
            "train": describe(trainer.train_dataloader, epochs=0),
            "val": describe(trainer.val_dataloaders, epochs=0),
        }
        predictions = trainer.predict(model, return_predictions=True)
        result["loaders"]["predict"] = describe(trainer.predict_dataloaders, epochs=0)
        result["rank"] = (trainer.global_rank, trainer.world_size)
    _finish(result, model, writer, predictions)
    return result
