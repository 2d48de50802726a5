"""``cepe prepare-data``: build tokenized train / test / retrieval shards (see :func:`prepare_data`).

The flags are generated from :class:`~cepe.data.prepare.PrepareDataConfig` (the arguments of
:func:`~cepe.data.prepare.prepare_data`); ``--out`` and ``--quiet`` are kept spellings of ``--out-dir`` and
``--no-progress``, and positional files are added to ``corpora``.
"""

from __future__ import annotations

import argparse
import json

from cepe.configio import add_config_flags, add_const_flag, config_from_args
from cepe.data.corpora import BUNDLED
from cepe.data.prepare import PrepareDataConfig


def config_from_cli(args: argparse.Namespace) -> PrepareDataConfig:
    """The :class:`PrepareDataConfig` of a command line: ``--config``, ``--set``, the flags, then the
    positional files appended to ``corpora``."""
    cfg = config_from_args(PrepareDataConfig, args, "prepare-data config")
    cfg.corpora = [*cfg.corpora, *(args.files or [])]
    return cfg


def _run(args: argparse.Namespace) -> int:
    from cepe.data.prepare import SUMMARY_FILE, prepare_data

    out = prepare_data(**config_from_cli(args).kwargs())
    summary = json.loads((out / SUMMARY_FILE).read_text(encoding="utf-8"))
    for split, s in summary["splits"].items():
        print(f"{split:>9}: {s['docs']:>7} docs {s['tokens']:>12} tokens  ≥8K: {s['docs_ge_8192']}")
    print(f"wrote {out}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``prepare-data`` sub-command."""
    p = subparsers.add_parser(
        "prepare-data",
        help="tokenize corpora into train/test/retrieval shards",
        description="Tokenize bundled corpora and/or local files (text, JSONL, parquet) into sharded token "
        "arrays with a deterministic document-level train/test/retrieval split. Every PrepareDataConfig "
        f"field is a flag (or a --config key). Bundled corpora: {', '.join(BUNDLED)}.",
    )
    p.add_argument(
        "files",
        nargs="*",
        help="local files or directories (text, .jsonl[.gz], .json, .parquet): more corpora",
    )
    add_config_flags(
        p,
        PrepareDataConfig,
        aliases={"out_dir": ["--out"]},
        config_file="PrepareDataConfig fields, YAML or JSON; the flags below override it",
    )
    add_const_flag(p, "--quiet", "progress", False, help="no progress bar (= --no-progress)")
    p.set_defaults(func=_run)
