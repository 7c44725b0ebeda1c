"""``python -m ferry`` (also the ``ferry`` console script): the command-line tools.

Subcommands:

- ``bench``: side-by-side benchmark of ``ferry.DataLoader`` against ``torch.utils.data``;
  ``python -m ferry bench --help`` lists its options.
- ``doctor``: measures the loader a function of yours returns, says where its time goes and
  what to change; ``python -m ferry doctor --help``.

``python -m ferry --version`` prints ferry's version, torch's and Python's.

Example::

    $ python -m ferry bench --quick --only tensor --workers 0
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Sequence

import torch

import ferry
from ferry.bench import cli
from ferry.doctor import cli as doctor_cli

__all__ = ["main"]


def _program_name() -> str:
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m ferry" if script in ("", "__main__.py", "-c") else script


def version_line() -> str:
    """What ``--version`` prints: ferry's version, its distribution's name, torch's and Python's."""
    return (
        f"ferry {ferry.__version__} (installed as ferry-data), "
        f"torch {torch.__version__}, Python {platform.python_version()}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog=_program_name(), description="ferry: a drop-in, faster torch.utils.data."
    )
    parser.add_argument("--version", action="version", version=version_line())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = commands.add_parser(
        "bench", help="benchmark ferry.DataLoader against torch.utils.data.DataLoader"
    )
    cli.configure(bench)
    doctor = commands.add_parser(
        "doctor", help="measure your loader: where its time goes, and what to change"
    )
    doctor_cli.configure(doctor)
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exit_:  # argparse's way out of --help and of usage errors
        return exit_.code if isinstance(exit_.code, int) else 2
    if args.command == "doctor":
        return doctor_cli.run(args, args_list)
    return cli.run(args, args_list)


if __name__ == "__main__":
    sys.exit(main())
