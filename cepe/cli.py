"""The ``cepe`` command line: a thin dispatcher over typed library functions.

Each subsystem module listed in ``_COMMAND_MODULES`` exposes ``register(subparsers)`` that adds its
sub-commands; a sub-command's ``func(args)`` calls the library function and returns an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

_COMMAND_MODULES = (
    "cepe.commands",
    "cepe.data.cli",
    "cepe.training.cli",
    "cepe.eval.cli",
    "cepe.bench",
    "cepe.main_job",
    "cepe.store_cli",
    "cepe.server",
    "cepe.bench.store_ttft",
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser with every available sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="cepe", description="Context Expansion with Parallel Encoding for Hugging Face decoders."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name is not None and name.startswith(err.name):
                continue  # subsystem not present in this build
            raise
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    """Entry point of the ``cepe`` executable (or of a sub-tool that passes its own ``parser``)."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as err:
        print(f"cepe {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
