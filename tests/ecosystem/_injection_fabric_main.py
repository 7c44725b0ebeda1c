"""One rank of a 2-process ``Fabric(strategy="ddp")``, started by ``test_lightning_injection.py``.

Usage: ``python _injection_fabric_main.py OUT_DIR`` with the rank's environment set (as
torchrun sets it): ``fabric.launch()`` joins the gloo group. Inside the launched function (where
Fabric records loaders' constructor arguments), every loader of ``_injection.VARIANTS`` is
built with torch's classes and with ferry's, passed through ``fabric.setup_dataloaders``, and
described; then the loader it gave is set up again and described. Writes
``OUT_DIR/rank{RANK}.pkl``: ``{variant: {impl: ("ok", {"once": ..., "again": ...}) or
("error", text)}}``.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `ecosystem`

import lightning as L
from lightning.fabric.strategies import DDPStrategy

from ecosystem._injection import IMPLS, VARIANTS, describe


def run(fabric: L.Fabric) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for variant, build in VARIANTS.items():
        results[variant] = {}
        for impl in IMPLS:
            try:
                once = fabric.setup_dataloaders(build(impl), move_to_device=False)
                inner = once._dataloader
                again = fabric.setup_dataloaders(inner, move_to_device=False)
                value = {"once": describe(once), "again": describe(again)}
                results[variant][impl] = ("ok", value)
            except Exception:
                results[variant][impl] = ("error", traceback.format_exc())
    return results


def main() -> None:
    out = Path(sys.argv[1]) / f"rank{os.environ['RANK']}.pkl"
    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=30))
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    results = fabric.launch(run)
    with out.open("wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main()
