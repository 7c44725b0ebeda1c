"""The ``doctor`` subcommand: load the user's loader, measure it, advise, try the advice.

Exit codes: 0 the report was printed, 1 the loader failed while it was measured (its error is
shown), 2 bad arguments (a bad MODULE:FUNCTION, an import that fails, a function that does not
return a loader) or matplotlib missing for ``--plot``, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from ferry._cli import (
    MissingExtra,
    non_negative,
    positive_int,
    prepare_output,
    require_matplotlib,
    seconds,
)
from ferry._torch_types import TorchDataLoader, is_ferry_instance
from ferry._validate import available_cpus
from ferry.doctor.advice import Findings, advise, worth_probing_threads
from ferry.doctor.measure import EmptyLoader, cuda_transfer, measure, probe_threads
from ferry.doctor.options import build_loader, loader_options
from ferry.doctor.progress import Bound, Console
from ferry.doctor.report import Report, format_report, to_json, write_plot
from ferry.doctor.tries import run_tries
from ferry.loader import DataLoader

__all__ = ["SpecError", "configure", "diagnose", "load_loader", "run"]

DESCRIPTION = """\
Calls FUNCTION (no arguments) from MODULE, which returns a DataLoader (ferry's or torch's) over
your dataset; iterates it for a bounded number of batches or seconds; prints where the time
goes, the bottleneck, and advice with the measured reason for each. A torch loader is measured
as it is, then as the equivalent ferry.DataLoader, whose statistics are shown.

MODULE is an importable module (the current directory is searched first) or the path of a .py
file. Example:

  python -m ferry doctor examples/doctor_demo.py:make_loader --try"""


class SpecError(Exception):
    """MODULE:FUNCTION cannot give a loader: the message says why."""


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``doctor`` options to ``parser``."""
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "exit status: 0 report printed, 1 the loader failed, 2 usage (bad MODULE:FUNCTION, "
        "matplotlib missing for --plot), 130 interrupted"
    )
    add = parser.add_argument
    add("spec", metavar="MODULE:FUNCTION", help="a function that returns your DataLoader")
    add(
        "--batches",
        type=positive_int,
        default=200,
        metavar="N",
        help="at most N batches a run (default 200)",
    )
    add(
        "--seconds",
        type=seconds,
        default=30.0,
        metavar="S",
        help="at most S seconds a run (default 30; 0: no limit)",
    )
    add(
        "--step-ms",
        type=non_negative,
        default=0.0,
        metavar="MS",
        help="sleep MS milliseconds after each batch, standing for your training step",
    )
    add(
        "--try",
        dest="try_advice",
        action="store_true",
        help="measure each advised setting (and all together) and print the speed-ups",
    )
    add("--json", type=Path, metavar="PATH", help="write the report as JSON")
    add("--plot", type=Path, metavar="PATH", help="write a PNG chart (needs matplotlib)")
    add("--quiet", action="store_true", help="no progress bar or status lines on stderr")


def _import(module_name: str) -> ModuleType:
    """The module named or, for a ``.py`` path, the file's module, imported by its name with
    its directory first on ``sys.path`` (so spawned workers can import it too)."""
    if module_name.endswith(".py") or os.sep in module_name:
        path = Path(module_name).resolve()
        if not path.is_file():
            raise SpecError(f"no such file: {module_name!r}")
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        module = importlib.import_module(path.stem)
        found = Path(module.__file__ or "").resolve()
        if found != path:
            raise SpecError(
                f"{module_name!r} cannot be imported as {path.stem!r}: a module of that name is "
                f"already imported from {str(found)!r}; rename the file"
            )
        return module
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: the current directory first
    return importlib.import_module(module_name)


def _traceback() -> str:
    """The traceback of the exception being handled, as text."""
    return traceback.format_exc().rstrip()


def load_loader(spec: str) -> Any:
    """Call the function ``spec`` (``MODULE:FUNCTION``) names; the loader it returns.

    Raises :class:`SpecError` with a message for each way this can fail.
    """
    module_name, colon, function_name = spec.rpartition(":")
    if not colon or not module_name or not function_name.isidentifier():
        raise SpecError(
            f"expected MODULE:FUNCTION (a module name or a .py path, then the name of a function "
            f"that returns a DataLoader), got {spec!r}"
        )
    try:
        module = _import(module_name)
    except SpecError:
        raise
    except ModuleNotFoundError as exc:
        if exc.name != module_name:  # the module was found, one it imports was not
            raise SpecError(f"cannot import {module_name!r}:\n{_traceback()}") from None
        raise SpecError(f"cannot import {module_name!r}: no module of that name") from None
    except Exception:
        raise SpecError(f"cannot import {module_name!r}:\n{_traceback()}") from None
    function: Callable[[], Any] | None = getattr(module, function_name, None)
    if not callable(function):
        what = "has no" if function is None else f"has a {type(function).__name__}, not a"
        raise SpecError(f"module {module_name!r} {what} function {function_name!r}")
    try:
        loader = function()
    except Exception:
        raise SpecError(f"{spec}() failed:\n{_traceback()}") from None
    if not isinstance(loader, TorchDataLoader):  # ferry's DataLoader is a subclass
        raise SpecError(
            f"{spec}() returned {type(loader).__name__}, not a DataLoader (ferry's or "
            "torch.utils.data's)"
        )
    return loader


def _check_outputs(args: argparse.Namespace) -> str | None:
    """What makes the run pointless before it starts (``--plot`` without matplotlib, an output
    path that cannot be written), or None."""
    try:
        if args.plot is not None:
            require_matplotlib()
    except MissingExtra as exc:
        return str(exc)
    for path, option in ((args.json, "--json"), (args.plot, "--plot")):
        problem = prepare_output(path, option)
        if problem:
            return problem
    return None


def diagnose(loader: Any, spec: str, args: argparse.Namespace, console: Console) -> Report:
    """Measure ``loader`` as the parsed ``args`` say, advise, and try the advice if asked."""
    bound = Bound(args.batches, args.seconds)
    step_s = args.step_ms / 1e3
    transfer = cuda_transfer()
    options = loader_options(loader)
    torch_run, label = None, "measuring the loader"
    if not is_ferry_instance(loader, DataLoader):
        torch_run = measure(
            loader, "measuring the torch loader", bound, console, step_s=step_s, transfer=transfer
        )
        loader, label = build_loader(options), "measuring the equivalent ferry loader"
    run = measure(loader, label, bound, console, step_s=step_s, transfer=transfer)
    cpus, _ = available_cpus()
    findings = Findings(
        run=run,
        options=options,
        cpus=cpus or 1,
        accelerator="cuda" if transfer is not None else None,
        step_s=step_s,
    )
    notes = []
    if worth_probing_threads(findings):
        try:
            probe = probe_threads(options, findings.work_per_batch_s, bound, console)
        except Exception as exc:  # threads may fail where processes work (an unpicklable copy)
            notes.append(f"Threads: not probed, thread workers failed: {type(exc).__name__}: {exc}")
        else:
            findings = dataclasses.replace(findings, threads=probe)
    advice = advise(findings)
    tries = None
    if args.try_advice:
        tries = run_tries(options, advice, bound, console, step_s=step_s, transfer=transfer)
    return Report(
        spec=spec,
        kind="ferry" if torch_run is None else "torch",
        bound=bound,
        findings=findings,
        advice=advice,
        torch_run=torch_run,
        tries=tries,
        transfer=transfer is not None,
        notes=notes,
    )


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run the doctor as the parsed ``args`` say; ``argv`` is recorded in the ``--json``."""
    console = Console(args.quiet)
    problem = _check_outputs(args)
    if problem is None:
        try:
            loader = load_loader(args.spec)
        except SpecError as exc:
            problem = str(exc)
    if problem is not None:
        print(f"ferry doctor: {problem}", file=sys.stderr)
        return 2
    try:
        report = diagnose(loader, args.spec, args, console)
    except KeyboardInterrupt:
        console.finish()
        console.say("interrupted; no report")
        return 130
    except EmptyLoader as exc:
        print(f"ferry doctor: {exc}", file=sys.stderr)
        return 1
    except Exception:
        print(f"ferry doctor: the loader failed:\n{_traceback()}", file=sys.stderr)
        return 1
    print(format_report(report))
    if args.json is not None:
        args.json.write_text(json.dumps(to_json(report, argv), indent=2) + "\n")
        console.say(f"wrote {args.json}")
    if args.plot is not None:
        write_plot(report, args.plot)
        console.say(f"wrote {args.plot}")
    return 0
