"""Running a ``cepe`` argument parser: parse, call the sub-command, turn user errors into exit code 2.

Stdlib only, so every CLI module (``cepe.cli``, ``cepe.training.cli``) can use it without importing the
others.
"""

from __future__ import annotations

import argparse
import sys


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse ``argv`` with ``parser`` and run the chosen sub-command's ``func(args)``; its exit code."""
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as err:
        print(f"cepe {args.command}: error: {err}", file=sys.stderr)
        return 2
