"""One table row per value of a swept setting, from the validation runs under ``OUT/<prefix>_<value>/``.

Each row holds, where the run exists: the validation needle's accuracy and answer NLL per total
(``needle/needle.json``, mean over depths), validation perplexity per total (``lm_val/lm.json``, the
domain average) and validation ICL per number of encoder demonstrations (``icl_val/icl.json``).
Used by ``scripts/calibrate_context_scale.sh`` and ``scripts/chunk_length_sweep.sh``.

Usage: python scripts/sweep_table.py OUT ADAPTER KEY PREFIX NAME TITLE VALUE [VALUE ...]
Writes ``OUT/NAME.json`` and ``OUT/NAME.md`` (titled ``TITLE: ADAPTER``) and prints the table.
"""

from __future__ import annotations

import json
import math
import os
import sys

from cepe.fileio import write_json, write_text


def row(run_dir: str, key: str, value: str) -> dict:
    r: dict = {key: float(value)}
    path = f"{run_dir}/needle/needle.json"
    if os.path.exists(path):
        needle = json.load(open(path))["rows"]
        for total in sorted({c["setting"]["total"] for c in needle}):
            cells = [c for c in needle if c["setting"]["total"] == total]
            r[f"needle_{total}"] = sum(c["value"] for c in cells) / len(cells)
            r[f"needle_nll_{total}"] = sum(c["answer_nll"] for c in cells) / len(cells)
    path = f"{run_dir}/lm_val/lm.json"
    if os.path.exists(path):
        for c in json.load(open(path))["rows"]:
            if c["setting"]["domain"] == "avg":
                r[f"lm_val_{c['setting']['total']}"] = c["value"]
    path = f"{run_dir}/icl_val/icl.json"
    if os.path.exists(path):
        for c in json.load(open(path))["rows"]:
            r[f"icl_val_2+{c['setting']['k_encoder']}"] = c["value"]
    return r


def _cell(v: float) -> str:
    """Three significant digits, without an exponent from 1,000 on (a perplexity of 1234.5 reads 1234)."""
    return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def table(rows: list[dict], title: str) -> list[str]:
    """The rows under ``title``; the first column, the swept value, as given (``:g``), the others to three
    significant digits."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = [f"# {title}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += [
        "| "
        + " | ".join(f"{r[k]:g}" if j == 0 else _cell(r.get(k, math.nan)) for j, k in enumerate(keys))
        + " |"
        for r in rows
    ]
    return lines


def main(argv: list[str]) -> None:
    out, adapter, key, prefix, name, title, *values = argv
    rows = [row(f"{out}/{prefix}_{v}", key, v) for v in values]
    write_json(f"{out}/{name}.json", {"adapter": adapter, "rows": rows}, indent=1)
    lines = table(rows, f"{title}: {adapter}")
    write_text(f"{out}/{name}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
