"""One rank of a 2-process Lightning DDP run, started by ``test_lightning.py``.

Usage: ``python _lightning_ddp_main.py OUT_DIR`` with ``MASTER_ADDR``, ``MASTER_PORT``,
``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK`` and ``NODE_RANK`` set: Lightning finds them and joins
this rank to the group instead of starting processes itself. The rank runs the program of
``_lightning_programs.run_ddp`` with torch's classes, then with ferry's, and writes
``OUT_DIR/rank{RANK}.pkl``: a dict from ``"torch"``/``"ferry"`` to ``("ok", result)`` or
``("error", traceback)``, rewritten after each run so a crash keeps what came before. After an
error it stops: the group may be broken.

Run as a script so that it does not depend on how pytest imports test modules.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `ecosystem`

from ecosystem._lightning_programs import run_ddp


def main() -> None:
    out = Path(sys.argv[1]) / f"rank{os.environ['RANK']}.pkl"
    results: dict[str, tuple[str, Any]] = {}
    for impl in ("torch", "ferry"):
        try:
            results[impl] = ("ok", run_ddp(impl))
        except BaseException:
            results[impl] = ("error", traceback.format_exc())
        with out.open("wb") as f:
            pickle.dump(results, f)
        if results[impl][0] == "error":
            break


if __name__ == "__main__":
    main()
