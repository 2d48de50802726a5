"""``cepe prepare-data``: build tokenized train / test / retrieval shards (see :func:`prepare_data`)."""

from __future__ import annotations

import argparse
import json

from cepe.data.corpora import BUNDLED
from cepe.data.tokenized import DEFAULT_SHARD_TOKENS


def _run(args: argparse.Namespace) -> int:
    from cepe.data.prepare import SUMMARY_FILE, prepare_data

    sources = list(args.corpora or []) + list(args.files or [])
    out = prepare_data(
        sources,
        args.out,
        tokenizer=args.tokenizer,
        seed=args.seed,
        test_fraction=args.test_fraction,
        retrieval_fraction=args.retrieval_fraction,
        max_docs=args.max_docs,
        shard_tokens=args.shard_tokens,
        text_field=args.text_field,
        download=not args.no_download,
        progress=not args.quiet,
    )
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
        "arrays with a deterministic document-level train/test/retrieval split.",
    )
    p.add_argument("files", nargs="*", help="local files or directories (text, .jsonl[.gz], .json, .parquet)")
    p.add_argument("--corpora", nargs="+", default=[], metavar="NAME", help=f"bundled: {', '.join(BUNDLED)}")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--tokenizer", default="default", help="'default' (SmolLM2-135M-Instruct), a dir or hub id"
    )
    p.add_argument("--seed", type=int, default=0, help="split seed")
    p.add_argument("--test-fraction", type=float, default=0.05)
    p.add_argument("--retrieval-fraction", type=float, default=0.05)
    p.add_argument("--max-docs", type=int, default=None, help="at most this many documents per corpus")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    p.add_argument("--text-field", default="text", help="text field of JSONL/parquet records")
    p.add_argument("--no-download", action="store_true", help="never fetch Debian packages (Austen, Linux)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)
