"""The programs behind test_streaming.py, each run in a fresh interpreter.

Every run starts with the torchvision stand-in first on ``sys.path`` (see
tests/ecosystem/__init__.py): a spawned worker gets the same ``sys.path``, so it imports the
stand-in too. Usage (the tests build these command lines)::

    python _streaming_programs.py write DIR
    python _streaming_programs.py orders LIBRARY DIR [LIBRARY DIR ...]
    python _streaming_programs.py save PLAN
    python _streaming_programs.py load PLAN

``write`` writes both libraries' datasets, into DIR/mosaic and DIR/litdata. LIBRARY is
``mosaic`` (MosaicML Streaming), ``litdata``, or ``litdata-told`` (the dataset
told the batch size, as litdata's own loader tells it). RUNS: comma-separated
``LOADER-WORKERS`` or ``ferry-WORKERS-thread``, LOADER ``ferry`` or ``library`` (the library's
own StreamingDataLoader). PLAN: a JSON file, a list of ``[LIBRARY, DIR, RUNS, STATES]``, run in
order in the one interpreter (each start imports torch and both libraries: seconds).
``save`` runs an epoch, part of the next, saves the loader's state to STATES/RUN.json, then
finishes that epoch and runs one more: the uninterrupted run. ``load`` builds everything
afresh, loads the state and runs the rest of the epoch and one more. Each prints one JSON
line: what the training loop saw (for ``save`` and ``load``, by LIBRARY).
"""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "_vision_standin"))

SAMPLES = 200
BATCH = 16  # 13 batches an epoch, the last of 8
SEED = 7
BATCHES_BEFORE_SAVE = 7  # odd: the next batch is the second worker's turn


def key(i: int) -> dict[str, int]:
    return {"id": i}


def write(library: str, where: str) -> None:
    if library == "mosaic":
        from streaming import MDSWriter

        # (small shards, so that a worker reads several)
        with MDSWriter(out=where, columns={"id": "int"}, size_limit=1 << 10) as writer:
            for i in range(SAMPLES):
                writer.write(key(i))
        return
    from litdata.streaming.writer import BinaryWriter

    # (the writer litdata's optimize() runs in each of its processes; optimize() itself would
    # start one, and set the process's start method to spawn for good)
    writer = BinaryWriter(where, chunk_size=24)
    for i in range(SAMPLES):
        writer[i] = key(i)
    writer.done()
    writer.merge()


def dataset(library: str, where: str) -> Any:
    if library == "mosaic":
        from streaming import StreamingDataset

        return StreamingDataset(local=where, shuffle=True, batch_size=BATCH, shuffle_seed=SEED)
    from litdata import StreamingDataset as LitDataset

    data = LitDataset(where, shuffle=True, seed=SEED)
    if library == "litdata-told":  # told the batch size, as litdata's own loader tells it
        data.set_batch_size(BATCH)
    return data


def loader(library: str, kind: str, data: Any, **options: Any) -> Any:
    """A loader of ``kind``: ``torch``, ``ferry`` or ``library``."""
    if kind == "torch":
        import torch.utils.data as tud

        return tud.DataLoader(data, batch_size=BATCH, **options)
    if kind == "ferry":
        import ferry

        return ferry.DataLoader(data, batch_size=BATCH, **options)
    if library == "mosaic":
        from streaming import StreamingDataLoader

        return StreamingDataLoader(data, batch_size=BATCH, **options)
    from litdata import StreamingDataLoader as LitLoader

    return LitLoader(data, batch_size=BATCH, **options)


def ids(batch: Any) -> list[int]:
    return [int(i) for i in batch["id"]]


def epoch(batches: Any, limit: int | None = None) -> list[int]:
    seen: list[int] = []
    for number, batch in enumerate(batches):
        seen += ids(batch)
        if limit is not None and number + 1 == limit:
            break
    return seen


def clean(library: str) -> None:
    if library == "mosaic":
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()


# (name, loader kind, options)
ORDERS = (
    ("torch-0", "torch", {}),
    ("torch-2", "torch", {"num_workers": 2}),
    ("ferry-0", "ferry", {}),
    ("ferry-2-process", "ferry", {"num_workers": 2}),
    ("ferry-2-thread", "ferry", {"num_workers": 2, "worker_type": "thread"}),
)
# MosaicML imports torchvision at import: a spawned worker must find the stand-in too
SPAWN = ("ferry-2-spawn", "ferry", {"num_workers": 2, "multiprocessing_context": "spawn"})


def orders(library: str, where: str) -> dict[str, Any]:
    """Two epochs through each loader (a dataset of its own each), or the error it raised."""
    out: dict[str, Any] = {}
    for name, kind, options in (*ORDERS, SPAWN) if library == "mosaic" else ORDERS:
        data = dataset(library, where)
        try:
            batches = loader(library, kind, data, **options)
            out[name] = [epoch(batches), epoch(batches)]
            if name in ("ferry-0", "ferry-2-process"):  # a state mid-epoch
                it = iter(batches)
                next(it)
                out[name + " state"] = json.loads(json.dumps(batches.state_dict()))
                del it
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        del data
        clean(library)
    return out


def run_loader(library: str, name: str, data: Any) -> Any:
    """The loader a run's name describes: ``LOADER-WORKERS[-thread]``."""
    kind, workers, *thread = name.split("-")
    options: dict[str, Any] = {"num_workers": int(workers)}
    if thread:
        options["worker_type"] = "thread"
    return loader(library, kind, data, **options)


def save(library: str, where: str, runs: list[str], states: str) -> dict[str, Any]:
    """Each run (see :func:`run_loader`): one whole epoch, BATCHES_BEFORE_SAVE batches of the next,
    the state saved to ``states``/RUN.json, the rest of that epoch, one more epoch."""
    out: dict[str, Any] = {}
    for name in runs:
        data = dataset(library, where)
        run = run_loader(library, name, data)
        first = epoch(run)
        it = iter(run)
        seen = epoch(it, BATCHES_BEFORE_SAVE)
        (Path(states) / f"{name}.json").write_text(json.dumps(run.state_dict()))
        rest = epoch(it)
        del it
        out[name] = {"first": first, "seen": seen, "rest": rest, "next": epoch(run)}
        del run, data
        clean(library)
    return out


def load(library: str, where: str, runs: list[str], states: str) -> dict[str, Any]:
    """Each run built afresh, its state loaded: the rest of the epoch, and one more."""
    out: dict[str, Any] = {}
    for name in runs:
        data = dataset(library, where)
        run = run_loader(library, name, data)
        run.load_state_dict(json.loads((Path(states) / f"{name}.json").read_text()))
        out[name] = {"rest": epoch(run), "next": epoch(run)}
        del run, data
        clean(library)
    return out


def main(argv: list[str]) -> None:
    if argv[0] == "write":
        for library in ("mosaic", "litdata"):
            write(library, str(Path(argv[1]) / library))
        print('RESULT "written"', flush=True)
        return
    if argv[0] == "orders":  # by LIBRARY
        result: Any = {}
        for library, where in zip(argv[1::2], argv[2::2], strict=True):
            try:
                result[library] = orders(library, where)
            finally:
                clean(library)
        print("RESULT " + json.dumps(result), flush=True)
        return
    mode, plan = argv
    step = save if mode == "save" else load
    result = {}
    for library, where, runs, states in json.loads(Path(plan).read_text()):
        try:
            result[library] = step(library, where, runs.split(","), states)
        finally:
            clean(library)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    multiprocessing.freeze_support()
    main(sys.argv[1:])
