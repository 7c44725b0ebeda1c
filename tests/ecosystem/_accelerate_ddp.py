"""One rank of the accelerate DDP check in test_accelerate.py (run twice, gloo, loopback).

Usage: ``python _accelerate_ddp.py OUT_DIR`` with MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK and
LOCAL_RANK set; accelerate's PartialState reads them. For every loader variant (torch, ferry,
ferry after ``ferry.accelerate.install()``, and the latter with thread workers) and every case
(a shuffled map-style dataset over two epochs, a sized iterable dataset), the rank records the
batches it sees and what ``gather_for_metrics`` returns, and writes them to ``OUT_DIR/rankR.pkl``.
A variant that raises is recorded as an error (with its traceback) and the next one runs.

Then, with ``DataLoaderConfiguration(use_stateful_dataloader=True)``, torchdata's loader and
ferry's (installed) on the map case (``DataLoaderShard``) and the stream case
(``DataLoaderDispatcher``, with and without ``split_batches``): ``save_state`` after
``STATEFUL_AT`` steps, then ``load_state`` into a new prepared loader, which records what it
yields. Each rank saves into a folder of its own: in one folder every rank writes the same
``dl_state_dict.bin``, and under the dispatcher only the main process's state has moved, so the
file would hold whichever rank wrote last (for torchdata's loader as for ferry's).
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.utils.data as tud
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import InitProcessGroupKwargs

import ferry
import ferry.accelerate

N = 100  # samples
BATCH = 8  # 13 batches of 8 and one of 4 in all: ranks get uneven work and padding
EPOCHS = 2
SEED = 1234


def _stream_class(base: type) -> type:
    class Stream(base):
        """Yields 0..n-1; sized, so that gather_for_metrics can drop the padding."""

        def __init__(self, n: int) -> None:
            self.n = n

        def __iter__(self) -> Iterator[torch.Tensor]:
            return iter(torch.arange(self.n))

        def __len__(self) -> int:
            return self.n

    return Stream


STREAMS = {
    "torch": _stream_class(tud.IterableDataset),
    "ferry": _stream_class(ferry.IterableDataset),
}


def _loader(lib: str, case: str, **options: Any) -> Any:
    if lib == "torch":
        loader_cls: Any = tud.DataLoader
        tensors: Any = tud.TensorDataset
    else:
        loader_cls, tensors = ferry.DataLoader, ferry.TensorDataset
    if case == "map":
        return loader_cls(tensors(torch.arange(N)), batch_size=BATCH, shuffle=True, **options)
    return loader_cls(STREAMS[lib](N), batch_size=BATCH, **options)


def _run(accelerator: Accelerator, make: Callable[[], Any], epochs: int) -> dict[str, Any]:
    torch.manual_seed(SEED)
    prepared = accelerator.prepare(make())
    seen, gathered = [], []
    for _ in range(epochs):
        for batch in prepared:
            index = batch[0] if isinstance(batch, (list, tuple)) else batch
            seen.append(index.tolist())
            gathered.append(accelerator.gather_for_metrics(index).tolist())
    base = prepared.base_dataloader
    return {
        "seen": seen,
        "gathered": gathered,
        "base": f"{type(base).__module__}.{type(base).__qualname__}",
        "worker_type": getattr(base, "worker_type", None),
    }


VARIANTS: dict[str, tuple[str, bool, dict[str, Any]]] = {
    "torch": ("torch", False, {}),
    "ferry": ("ferry", False, {}),
    "ferry_install": ("ferry", True, {}),
    "ferry_install_threads": ("ferry", True, {"num_workers": 2, "worker_type": "thread"}),
}
CASES = {"map": EPOCHS, "stream": 1}


STATEFUL_AT = 2  # steps taken before the state is read
STATEFUL_CASES = {"map": ("map", False), "stream": ("stream", False), "split": ("stream", True)}


def _stateful_run(lib: str, case: str, split_batches: bool, folder: Path) -> dict[str, Any]:
    def accelerator() -> Accelerator:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        config = DataLoaderConfiguration(use_stateful_dataloader=True, split_batches=split_batches)
        return Accelerator(
            cpu=True,
            dataloader_config=config,
            kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=30))],
        )

    def flat(batches: list[Any]) -> list[list[int]]:
        return [(b[0] if isinstance(b, (list, tuple)) else b).tolist() for b in batches]

    torch.manual_seed(SEED)
    saving = accelerator()
    prepared = saving.prepare(_loader(lib, case))
    iterator = iter(prepared)
    first = [next(iterator) for _ in range(STATEFUL_AT)]
    saving.save_state(str(folder))
    rest = list(iterator)
    torch.manual_seed(SEED)
    loading = accelerator()
    again = loading.prepare(_loader(lib, case))
    loading.load_state(str(folder))
    return {
        "first": flat(first),
        "rest": flat(rest),
        "resumed": flat(list(again)),
        "base": type(prepared.base_dataloader).__module__,
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    accelerator = Accelerator(
        cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=30))]
    )
    assert accelerator.num_processes == 2, accelerator.state
    results: dict[tuple[str, str], tuple[str, Any]] = {}
    for variant, (lib, install, options) in VARIANTS.items():
        for case, epochs in CASES.items():
            if case == "stream" and options:
                continue  # stream workers would each yield the whole stream, in torch as well
            try:
                if install:
                    with ferry.accelerate.installed():
                        value = _run(accelerator, lambda: _loader(lib, case, **options), epochs)
                else:
                    value = _run(accelerator, lambda: _loader(lib, case, **options), epochs)
                results[variant, case] = ("ok", value)
            except Exception:
                results[variant, case] = ("error", traceback.format_exc())
            accelerator.wait_for_everyone()
    for lib in ("torch", "ferry"):
        for name, (case, split_batches) in STATEFUL_CASES.items():
            folder = out_dir / f"state-{lib}-{name}-rank{rank}"
            try:
                if lib == "ferry":
                    with ferry.accelerate.installed():
                        value = _stateful_run(lib, case, split_batches, folder)
                else:
                    value = _stateful_run(lib, case, split_batches, folder)
                results[f"stateful_{lib}", name] = ("ok", value)
            except Exception:
                results[f"stateful_{lib}", name] = ("error", traceback.format_exc())
            accelerator.wait_for_everyone()
    with (out_dir / f"rank{rank}.pkl").open("wb") as f:
        pickle.dump(results, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
