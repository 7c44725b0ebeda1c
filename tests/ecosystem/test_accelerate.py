"""ferry under Hugging Face accelerate (real accelerate, CPU), against torch's loader.

``Accelerator.prepare`` and ``skip_first_batches`` rebuild a loader from its options; every
program here runs with torch's loader, with ferry's, and with ferry's after
``ferry.accelerate.install()`` (which makes the rebuild use ferry's engine and keep
``worker_type``), and must give exactly torch's result:

* gradient accumulation over an epoch that is not a multiple of the accumulation steps: the
  same optimizer steps (the end-of-epoch sync included) and the same final weights;
* ``skip_first_batches`` on prepared and unprepared loaders, map-style and iterable-style;
* DDP on two gloo processes (``_accelerate_ddp.py``, one launch for all variants): each rank
  sees torch's batches and ``gather_for_metrics`` returns every sample exactly once;
* thread workers surviving ``prepare``, and ``install``/``uninstall`` restoring accelerate.

Single-process programs run in this process, on a fresh accelerate state each time.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import accelerate
import accelerate.data_loader as acc_dl
import pytest
import torch
import torch.nn.functional as F
import torch.utils.data as tud
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

import ferry
import ferry.accelerate
from _support.ranks import PYTHON, run_ranks

pytestmark = pytest.mark.usefixtures("guard_global_state")

VARIANTS = ["ferry", "ferry_install"]
DDP_MAIN = Path(__file__).with_name("_accelerate_ddp.py")
DDP_DEADLINE_S = 150.0  # generous: the machine may be shared with other test runs


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Each test builds its Accelerators on a clean state, and leaves none behind."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    rng = torch.get_rng_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    torch.set_rng_state(rng)
    ferry.accelerate.uninstall()


def _accelerator(**kwargs: Any) -> Accelerator:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(cpu=True, **kwargs)


def _lib(variant: str) -> Any:
    return tud if variant == "torch" else ferry


def _patch(variant: str) -> AbstractContextManager[None]:
    return ferry.accelerate.installed() if variant == "ferry_install" else nullcontext()


def _stream_class(base: type) -> type:
    class Stream(base):
        """Yields 0..n-1 as 0-d tensors."""

        def __init__(self, n: int) -> None:
            self.n = n

        def __iter__(self) -> Iterator[torch.Tensor]:
            return iter(torch.arange(self.n))

    return Stream


STREAMS = {
    "torch": _stream_class(tud.IterableDataset),
    "ferry": _stream_class(ferry.IterableDataset),
}


def _flat(batches: Any) -> list[list[int]]:
    return [(b[0] if isinstance(b, (list, tuple)) else b).tolist() for b in batches]


# -- 1. gradient accumulation -------------------------------------------------------------------

ACCUMULATE = 4
N_TRAIN, TRAIN_BATCH = 40, 4  # 10 batches: 3 optimizer steps, the last at the end of the epoch


def _train(variant: str) -> dict[str, Any]:
    lib = _lib(variant)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N_TRAIN, 3, generator=g), torch.randn(N_TRAIN, 1, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = lib.DataLoader(lib.TensorDataset(x, y), batch_size=TRAIN_BATCH, shuffle=True)
    with _patch(variant):
        accelerator = _accelerator(gradient_accumulation_steps=ACCUMULATE)
        model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    steps, seen = 0, []
    for xb, yb in prepared:
        seen.append(xb)
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            steps += accelerator.sync_gradients
    return {
        "steps": steps,
        "seen": seen,
        "weights": [p.detach().clone() for p in model.parameters()],
        "base": type(prepared.base_dataloader),
    }


@pytest.fixture(scope="module")
def torch_training() -> dict[str, Any]:
    return _train("torch")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant", VARIANTS)
def test_gradient_accumulation_steps_and_weights_match_torch(
    variant: str, torch_training: dict[str, Any]
) -> None:
    assert torch_training["steps"] == 3  # the end of the epoch syncs the last 2 batches
    got = _train(variant)
    assert got["steps"] == torch_training["steps"]
    assert len(got["seen"]) == len(torch_training["seen"]) == N_TRAIN // TRAIN_BATCH
    for ours, theirs in zip(got["seen"], torch_training["seen"], strict=True):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(got["weights"], torch_training["weights"], strict=True):
        assert torch.equal(ours, theirs)
    # Without install() accelerate rebuilds the loader with torch's DataLoader.
    expected = ferry.DataLoader if variant == "ferry_install" else tud.DataLoader
    assert got["base"] is expected


# -- 2. skip_first_batches ----------------------------------------------------------------------

N_SKIP, SKIP_BATCH, SKIP = 22, 4, 3  # 6 batches, the last one short; 3 skipped


def _skip(variant: str, style: str) -> dict[str, Any]:
    lib_name = "torch" if variant == "torch" else "ferry"
    lib = _lib(variant)
    if style == "map":
        dataset = lib.TensorDataset(torch.arange(N_SKIP))
    else:
        dataset = STREAMS[lib_name](N_SKIP)
    with _patch(variant):
        accelerator = _accelerator()
        loader = lib.DataLoader(dataset, batch_size=SKIP_BATCH)
        prepared = accelerator.prepare(loader)
        skipped = accelerator.skip_first_batches(prepared, SKIP)
        unprepared = accelerator.skip_first_batches(loader, SKIP)
    return {
        "prepared": _flat(skipped),
        "unprepared": _flat(unprepared),
        "prepared_base": type(skipped.base_dataloader),
        # A plain DataLoader for a map-style dataset, a SkipDataLoader adapter otherwise.
        "unprepared_base": type(getattr(unprepared, "base_dataloader", unprepared)),
    }


@pytest.fixture(scope="module")
def torch_skips() -> dict[str, dict[str, Any]]:
    return {style: _skip("torch", style) for style in ("map", "stream")}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("style", ["map", "stream"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_skip_first_batches_matches_torch(
    variant: str, style: str, torch_skips: dict[str, dict[str, Any]]
) -> None:
    expected = torch_skips[style]
    all_batches = [list(range(i, min(i + SKIP_BATCH, N_SKIP))) for i in range(0, N_SKIP, 4)]
    assert expected["prepared"] == expected["unprepared"] == all_batches[SKIP:]
    got = _skip(variant, style)
    assert got["prepared"] == expected["prepared"]
    assert got["unprepared"] == expected["unprepared"]
    if variant == "ferry_install":
        assert got["prepared_base"] is ferry.DataLoader
        assert got["unprepared_base"] is ferry.DataLoader


# -- 3. DDP on two processes --------------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[tuple[str, str], Any]]:
    """Runs ``_accelerate_ddp.py`` on two ranks; returns each rank's results."""
    out_dir = tmp_path_factory.mktemp("accelerate_ddp")
    return run_ranks(
        lambda rank, port: [PYTHON, str(DDP_MAIN), str(out_dir)],
        2,
        out_dir,
        DDP_DEADLINE_S,
        "accelerate DDP ranks",
    )


def _ddp_ok(ddp: list[dict[tuple[str, str], Any]], variant: str, case: str) -> list[Any]:
    values = []
    for rank, per_rank in enumerate(ddp):
        status, value = per_rank[variant, case]
        assert status == "ok", f"rank {rank}, {variant}, {case}:\n{value}"
        values.append(value)
    return values


DDP_CASES = [
    ("ferry", "map"),
    ("ferry", "stream"),
    ("ferry_install", "map"),
    ("ferry_install", "stream"),
    ("ferry_install_threads", "map"),
]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("variant", "case"), DDP_CASES, ids=["-".join(c) for c in DDP_CASES])
def test_ddp_ranks_see_torchs_batches_and_gather_each_sample_once(
    ddp: list[dict[tuple[str, str], Any]], variant: str, case: str
) -> None:
    n, epochs = 100, 2 if case == "map" else 1
    expected = _ddp_ok(ddp, "torch", case)
    got = _ddp_ok(ddp, variant, case)
    for rank in range(2):
        assert got[rank]["seen"] == expected[rank]["seen"], rank
    assert got[0]["seen"] != got[1]["seen"]
    for rank in range(2):
        gathered = [i for batch in got[rank]["gathered"] for i in batch]
        assert len(gathered) == n * epochs
        per_epoch = len(gathered) // epochs
        for epoch in range(epochs):
            assert sorted(gathered[epoch * per_epoch : (epoch + 1) * per_epoch]) == list(range(n))
        assert got[rank]["gathered"] == expected[rank]["gathered"]
    if variant.startswith("ferry_install"):
        assert {r["base"] for r in got} == {"ferry.loader.DataLoader"}
    if variant == "ferry_install_threads":
        assert {r["worker_type"] for r in got} == {"thread"}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["map", "stream", "split"])
def test_ddp_stateful_ferry_loader_resumes_after_the_last_step_handed_out(
    ddp: list[dict[tuple[str, str], Any]], case: str
) -> None:
    """Two ranks, ``use_stateful_dataloader=True``: ``map`` runs in ``DataLoaderShard``,
    ``stream`` and ``split`` (``split_batches=True``) in ``DataLoaderDispatcher``, whose main
    process fetches a step ahead. Each rank gets torchdata's batches, and a ferry state taken
    after two steps resumes at the third. (torchdata's state, under ``split_batches``, resumes
    a batch early: accelerate lowers its counters by ``num_processes - 1`` there as well.)"""
    expected = _ddp_ok(ddp, "stateful_torch", case)
    got = _ddp_ok(ddp, "stateful_ferry", case)
    for rank in range(2):
        assert got[rank]["base"] == "ferry.loader"
        assert expected[rank]["base"].startswith("torchdata")
        assert got[rank]["first"] + got[rank]["rest"] == (
            expected[rank]["first"] + expected[rank]["rest"]
        )
        assert got[rank]["rest"]
        assert got[rank]["resumed"] == got[rank]["rest"], rank
    if case == "stream":
        assert all(e["resumed"] == e["rest"] for e in expected)
    if case == "split":
        assert all(e["resumed"] != e["rest"] for e in expected)


# -- 4. thread workers and install/uninstall ----------------------------------------------------


@pytest.mark.timeout(60)
def test_thread_workers_survive_prepare_and_skip() -> None:
    x = torch.arange(30.0).view(15, 2)

    def run(lib: Any, **options: Any) -> tuple[list[list[list[float]]], Any, Any]:
        torch.manual_seed(7)
        accelerator = _accelerator()
        prepared = accelerator.prepare(
            lib.DataLoader(lib.TensorDataset(x), batch_size=4, shuffle=True, **options)
        )
        epochs = [_flat(prepared) for _ in range(2)]
        return epochs, prepared, accelerator.skip_first_batches(prepared, 2)

    expected, _, torch_skipped = run(tud)
    with ferry.accelerate.installed():
        got, prepared, skipped = run(
            ferry,
            num_workers=2,
            worker_type="thread",
            on_error="skip",
            max_errors=3,
            balance_workers=True,
            move_workers=False,
        )
    assert got == expected
    assert expected[0] != expected[1]  # reshuffled between epochs
    for loader in (prepared.base_dataloader, skipped.base_dataloader):
        assert type(loader) is ferry.DataLoader
        assert loader.worker_type == "thread"
        assert loader.num_workers == 2
        assert (loader.on_error, loader.max_errors) == ("skip", 3)
        assert loader.balance_workers is True
        assert loader.move_workers is False
    torch.manual_seed(8)
    skipped_batches = _flat(skipped)
    torch.manual_seed(8)
    assert skipped_batches == _flat(torch_skipped)


def test_install_uninstall_restore_accelerate() -> None:
    options = list(acc_dl._PYTORCH_DATALOADER_KWARGS.items())
    adapter = {
        name: vars(acc_dl.DataLoaderAdapter)[name]
        for name in ("__init__", "adjust_state_dict_for_prefetch")
    }
    assert acc_dl.DataLoader is tud.DataLoader
    assert not ferry.accelerate.is_installed()
    ferry.accelerate.install()
    ferry.accelerate.install()  # idempotent
    assert ferry.accelerate.is_installed()
    assert acc_dl.DataLoader is ferry.DataLoader
    assert {name: vars(acc_dl.DataLoaderAdapter)[name] for name in adapter} != adapter
    assert list(acc_dl._PYTORCH_DATALOADER_KWARGS.items()) == [
        *options,
        ("worker_type", "process"),
        ("snapshot_every_n_steps", 1),
        ("on_error", "raise"),
        ("max_errors", None),
        ("max_worker_restarts", 0),
        ("stall_warning", 300.0),
        ("balance_workers", False),
        ("move_workers", None),
    ]
    with ferry.accelerate.installed():  # nested: leaves the outer install in place
        pass
    assert acc_dl.DataLoader is ferry.DataLoader
    ferry.accelerate.uninstall()
    assert acc_dl.DataLoader is tud.DataLoader
    assert list(acc_dl._PYTORCH_DATALOADER_KWARGS.items()) == options
    assert {name: vars(acc_dl.DataLoaderAdapter)[name] for name in adapter} == adapter
    ferry.accelerate.uninstall()  # a no-op when not installed
    assert list(acc_dl._PYTORCH_DATALOADER_KWARGS.items()) == options

    def failing_block() -> None:
        with ferry.accelerate.installed():
            assert acc_dl.DataLoader is ferry.DataLoader
            raise KeyError("the block fails")

    with pytest.raises(KeyError):
        failing_block()
    assert acc_dl.DataLoader is tud.DataLoader
    assert list(acc_dl._PYTORCH_DATALOADER_KWARGS.items()) == options


def test_ferry_only_options_are_the_signature_difference() -> None:
    import inspect

    torch_names = set(inspect.signature(tud.DataLoader).parameters)
    extra = set(inspect.signature(ferry.DataLoader).parameters) - torch_names
    with ferry.accelerate.installed():
        added = set(acc_dl._PYTORCH_DATALOADER_KWARGS) - set(torch_names)
    assert (
        added
        == extra
        == {
            "worker_type",
            "snapshot_every_n_steps",
            "on_error",
            "max_errors",
            "max_worker_restarts",
            "stall_warning",
            "balance_workers",
            "move_workers",
        }
    )


def test_install_warns_on_an_unchecked_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accelerate, "__version__", "0.0.1")
    with pytest.warns(UserWarning, match=r"checked against accelerate 1\.15\.0"):
        ferry.accelerate.install()
    assert acc_dl.DataLoader is ferry.DataLoader
    ferry.accelerate.uninstall()
    monkeypatch.setattr(accelerate, "__version__", ferry.accelerate.CHECKED_VERSIONS[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ferry.accelerate.install()
        ferry.accelerate.uninstall()


def test_install_refuses_a_foreign_data_loader_global(monkeypatch: pytest.MonkeyPatch) -> None:
    class Other:
        pass

    monkeypatch.setattr(acc_dl, "DataLoader", Other)
    with pytest.raises(RuntimeError, match=r"1\.15\.0"):
        ferry.accelerate.install()
    assert acc_dl.DataLoader is Other
    assert not ferry.accelerate.is_installed()


def test_install_refuses_an_adapter_without_the_methods_it_wraps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(acc_dl.DataLoaderAdapter, "adjust_state_dict_for_prefetch")
    with pytest.raises(RuntimeError, match="DataLoaderAdapter lacks"):
        ferry.accelerate.install()
    assert acc_dl.DataLoader is tud.DataLoader
    assert not ferry.accelerate.is_installed()


@pytest.mark.timeout(60)
def test_import_ferry_does_not_import_accelerate() -> None:
    code = "import sys, ferry; print('accelerate' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "False"


@pytest.mark.timeout(120)
def test_a_ferry_loader_registered_for_checkpointing_resumes_exactly(tmp_path: Path) -> None:
    """A ferry loader has ``state_dict``/``load_state_dict``: accelerate takes it in
    ``register_for_checkpointing`` (a torch loader is refused), and ``load_state`` puts a new
    loader where the saved one stood."""

    def loader(module: Any) -> Any:
        return module.DataLoader(
            module.TensorDataset(torch.arange(10)),
            batch_size=3,
            shuffle=True,
            generator=torch.Generator().manual_seed(0),
        )

    with pytest.raises(ValueError, match="state_dict"):
        Accelerator(cpu=True).register_for_checkpointing(loader(tud))
    accelerator = Accelerator(cpu=True)
    first = loader(ferry)
    accelerator.register_for_checkpointing(first)
    iterator = iter(first)
    next(iterator)
    accelerator.save_state(str(tmp_path))
    rest = [b[0].tolist() for b in iterator]
    second = loader(ferry)
    accelerator._custom_objects[0] = second  # the new run's loader, registered in its place
    accelerator.load_state(str(tmp_path))
    assert [b[0].tolist() for b in second] == rest


# -- 5. use_stateful_dataloader=True: accelerate saves and loads the loader's state ------------


def _stateful_accelerator() -> Accelerator:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    config = accelerate.DataLoaderConfiguration(use_stateful_dataloader=True)
    return Accelerator(cpu=True, dataloader_config=config)


def _stateful_loader(lib: Any, case: str, num_workers: int) -> Any:
    if case == "map":
        dataset = lib.TensorDataset(torch.arange(50))
        return lib.DataLoader(dataset, batch_size=4, shuffle=True, num_workers=num_workers)
    stream = STREAMS["torch" if lib is tud else "ferry"](50)
    return lib.DataLoader(stream, batch_size=4, num_workers=num_workers)


def _save_mid_epoch_and_resume(lib: Any, case: str, num_workers: int, path: Path) -> Any:
    torch.manual_seed(3)
    accelerator = _stateful_accelerator()
    prepared = accelerator.prepare(_stateful_loader(lib, case, num_workers))
    iterator = iter(prepared)
    first = [next(iterator) for _ in range(3)]
    accelerator.save_state(str(path))
    rest = list(iterator)
    again = _stateful_accelerator()
    resumed_loader = again.prepare(_stateful_loader(lib, case, num_workers))
    again.load_state(str(path))
    return {
        "first": _flat(first),
        "rest": _flat(rest),
        "resumed": _flat(resumed_loader),
        "base": type(prepared.base_dataloader),
        "saved": (path / "dl_state_dict.bin").exists(),
    }


STATEFUL_CASES = [("map", 0), ("map", 2), ("stream", 0)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("case", "num_workers"), STATEFUL_CASES)
def test_use_stateful_dataloader_saves_and_resumes_a_ferry_loader(
    tmp_path: Path, case: str, num_workers: int
) -> None:
    """``use_stateful_dataloader=True`` made accelerate build torchdata's loader, and preparing
    a ferry loader failed (``TypeError`` on ``worker_type``). Installed, accelerate builds
    ferry's loader, ``save_state`` writes its state and ``load_state`` resumes it after the
    last batch handed out; the batches are the ones torchdata's loader gives."""
    with ferry.accelerate.installed():
        got = _save_mid_epoch_and_resume(ferry, case, num_workers, tmp_path / "ferry")
    assert got["base"] is ferry.DataLoader
    assert got["saved"]
    assert got["resumed"] == got["rest"]
    assert len(got["first"]) + len(got["rest"]) == 13
    oracle = _save_mid_epoch_and_resume(tud, case, num_workers, tmp_path / "torchdata")
    assert oracle["base"].__module__.startswith("torchdata")
    assert got["first"] + got["rest"] == oracle["first"] + oracle["rest"]
    if case == "map" and num_workers:
        # torchdata's state, saved this way, resumes another permutation: ferry's is the fix
        assert oracle["resumed"] != oracle["rest"]


@pytest.mark.timeout(60)
def test_use_stateful_dataloader_needs_no_torchdata_when_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(acc_dl, "is_torchdata_stateful_dataloader_available", lambda: False)
    loader = _stateful_loader(ferry, "map", 0)
    with pytest.raises(ImportError, match="StatefulDataLoader is not available"):
        _stateful_accelerator().prepare(loader)
    with ferry.accelerate.installed():
        prepared = _stateful_accelerator().prepare(loader)
    assert type(prepared.base_dataloader) is ferry.DataLoader
    assert prepared.use_stateful_dataloader
    assert len(_flat(prepared)) == 13
