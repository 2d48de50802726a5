"""The ``cepe`` command line: a thin dispatcher over typed library functions.

Each command module below exposes ``register(subparsers)`` that adds its sub-commands; a sub-command's
``func(args)`` imports the library it needs and returns an exit code. Command modules import no torch or
transformers at module level, so ``cepe --help`` and ``cepe <command> --help`` stay fast
(``tests/test_structure.py`` checks it). Every sub-command's flags are generated from its config
dataclass (:func:`cepe.configio.add_config_flags`; ``tests/test_cli_configs.py`` checks it).
"""

from __future__ import annotations

import argparse

from cepe import commands, main_job, store_cli
from cepe.bench import cli as bench_cli
from cepe.cliutil import run
from cepe.data import cli as data_cli
from cepe.eval import cli as eval_cli
from cepe.training import cli as training_cli

COMMAND_MODULES = (commands, data_cli, training_cli, eval_cli, bench_cli, main_job, store_cli)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser with every sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="cepe", description="Context Expansion with Parallel Encoding for Hugging Face decoders."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    """Entry point of the ``cepe`` executable (or of a sub-tool that passes its own ``parser``)."""
    return run(parser or build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
