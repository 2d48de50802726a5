"""Fixed-target perplexity by source: two or more ``cepe eval fixedppl`` results of one config, side by side.

A curve's mean hides where two adapters differ; this splits each context length's perplexity by the
source of the sequences (``books``, ``papers``, ``code`` in the validation configs) and counts the sequences
on which each result beats the first. The results must have scored the same sequences (the same config;
their ``sequences`` lists are compared) and carry ``nll_per_sequence`` (every result written since that
field was added; older ones are refused with that reason).

Usage: python scripts/fixedppl_by_source.py A/fixedppl.json B/fixedppl.json [...] [--method cepe]
    [--out table.md]
Prints a markdown table (and writes it with ``--out``); runs no model.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from cepe.fileio import write_text
from cepe.tables import pipe_table


def load(path: str | Path, method: str) -> tuple[list[dict[str, Any]], dict[int, list[float]]]:
    """The scored sequences of one result and, per context length, the method's mean NLL per sequence."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"{path}: not a readable fixedppl result ({e})") from None
    if data.get("task") != "fixedppl":
        raise SystemExit(
            f"{path}: a {data.get('task')!r} result, not fixedppl (`cepe eval fixedppl --out DIR`)"
        )
    seqs = data.get("sequences")
    by_context: dict[int, list[float]] = {}
    for row in data.get("rows", []):
        if row.get("method") != method:
            continue
        per = row.get("nll_per_sequence")
        if per is None or seqs is None:
            raise SystemExit(
                f"{path}: no per-sequence NLLs (written before they were recorded); rerun `cepe eval fixedppl`"
            )
        by_context[int(row["setting"]["context"])] = [float(x) for x in per]
    if not by_context:
        raise SystemExit(f"{path}: no rows for method {method!r}")
    return seqs, by_context


def by_source(
    results: list[tuple[list[dict[str, Any]], dict[int, list[float]]]],
) -> list[dict[str, Any]]:
    """Rows of (context, source): each result's perplexity there, and the sequences it beats the first on.

    Raises:
        SystemExit: when the results scored different sequences or different context lengths.
    """
    seqs0, first = results[0]
    for i, (seqs, curve) in enumerate(results[1:], 1):
        if seqs != seqs0:
            raise SystemExit(
                f"result {i + 1} scored other sequences than the first: give results of one config"
            )
        if sorted(curve) != sorted(first):
            raise SystemExit(f"result {i + 1} has contexts {sorted(curve)}, the first {sorted(first)}")
    sources = sorted({s["source"] for s in seqs0})
    rows = []
    for context in sorted(first):
        for source in [*sources, "all"]:
            idx = [i for i, s in enumerate(seqs0) if source in ("all", s["source"])]
            ppl = [math.exp(sum(c[context][i] for i in idx) / len(idx)) for _, c in results]
            wins = [sum(c[context][i] < first[context][i] for i in idx) for _, c in results]
            rows.append(
                {"context": context, "source": source, "n": len(idx), "ppl": ppl, "beats_first": wins}
            )
    return rows


def markdown(rows: list[dict[str, Any]], names: list[str]) -> str:
    head = ["context", "source", "n", *names] + [f"{n}: change, sequences better" for n in names[1:]]
    body = [
        [r["context"], r["source"], r["n"], *(f"{p:.3f}" for p in r["ppl"])]
        + [
            f"{100 * (p / r['ppl'][0] - 1):+.1f} %, {w} of {r['n']}"
            for p, w in zip(r["ppl"][1:], r["beats_first"][1:])
        ]
        for r in rows
    ]
    return "\n".join(pipe_table(head, body)) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "results", nargs="+", help="fixedppl.json files of one config (the first is the baseline)"
    )
    ap.add_argument("--method", default="cepe", help="the method's rows to compare (default cepe)")
    ap.add_argument("--out", help="also write the markdown table here")
    args = ap.parse_args(argv)
    if len(args.results) < 2:
        ap.error("give at least two results")
    rows = by_source([load(p, args.method) for p in args.results])
    names = [f"ppl {i + 1}" for i in range(len(args.results))]
    table = "\n".join(f"- {n}: `{p}`" for n, p in zip(names, args.results)) + "\n\n" + markdown(rows, names)
    sys.stdout.write(table)
    if args.out:
        write_text(args.out, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
