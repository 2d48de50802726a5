"""The lm-evaluation-harness runs of the README's table, as ``OUT.json``, ``OUT.md`` and ``OUT.png``.

Each ``METHOD=DIR`` names the ``--output_path`` of one ``cepe-lm-eval --model cepe`` run; the newest
``results_*.json`` under it is read. Only the metrics, the model arguments, the task sizes, the lm-eval
version and the run's seconds are kept: lm-eval's own file also records the machine (its environment
report, absolute task paths), which a committed result must not.

Usage: python scripts/harness_table.py cepe=runs/harness/cepe truncated=runs/harness/truncated \
    --out results/harness/harness
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cepe.fileio import atomic_path
from cepe.tables import write_rows

# (task, metric key in lm-eval's results, column)
METRICS = (
    ("cepe_ppl", "word_perplexity,none", "cepe_ppl word perplexity"),
    ("cepe_ppl", "bits_per_byte,none", "cepe_ppl bits per byte"),
    ("cepe_mc", "acc,none", "cepe_mc acc"),
)


def newest_result(folder: Path) -> Path:
    """The newest ``results_*.json`` under ``folder`` (lm-eval puts it in a folder named after the model)."""
    found = sorted(folder.rglob("results_*.json"), key=lambda p: p.name)
    if not found:
        raise SystemExit(f"{folder}: no results_*.json (the --output_path of a cepe-lm-eval run)")
    return found[-1]


def row(method: str, data: dict[str, Any], source: str) -> dict[str, Any]:
    """One method's row: its metrics, rounded as printed by lm-eval, and where they came from."""
    args = dict(data.get("config", {}).get("model_args") or {})
    if args.get("method", "cepe") != method:
        raise SystemExit(f"{source}: a run of method={args.get('method', 'cepe')!r}, given as {method!r}")
    out: dict[str, Any] = {"method": method}
    for task, key, column in METRICS:
        try:
            out[column] = round(float(data["results"][task][key]), 4)
        except KeyError:
            raise SystemExit(f"{source}: no {key!r} for task {task!r}") from None
    out["documents (ppl / mc)"] = " / ".join(
        str(data["n-samples"][t]["effective"]) for t in ("cepe_ppl", "cepe_mc")
    )
    out["seconds"] = round(float(data.get("total_evaluation_time_seconds", "nan")), 1)
    out["model_args"] = ",".join(f"{k}={v}" for k, v in args.items())
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [c for _, _, c in METRICS]
    fig, axes = plt.subplots(1, len(columns), figsize=(3.2 * len(columns), 2.8))
    for ax, column in zip(axes, columns):
        ax.bar(
            [r["method"] for r in rows],
            [r[column] for r in rows],
            color=["C0", "C1", "C2", "C3"][: len(rows)],
        )
        ax.set_title(column, fontsize=9)
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=90)
    plt.close(fig)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="METHOD=DIR: a cepe-lm-eval --output_path and its method")
    ap.add_argument("--out", required=True, help="OUT: writes OUT.json, OUT.md and OUT.png")
    args = ap.parse_args(argv)
    rows, meta = [], {"lm_eval_version": None, "sources": {}}
    for spec in args.runs:
        method, sep, folder = spec.partition("=")
        if not sep or not method or not folder:
            raise SystemExit(f"{spec!r}: give METHOD=DIR, e.g. cepe=runs/harness/cepe")
        path = newest_result(Path(folder))
        data = json.loads(path.read_text(encoding="utf-8"))
        rows.append(row(method, data, str(path)))
        meta["lm_eval_version"] = data.get("lm_eval_version")
        meta["sources"][method] = path.name
    write_rows(args.out, rows, meta)
    plot(rows, Path(f"{args.out}.png"))
    print(Path(f"{args.out}.md").read_text(encoding="utf-8"), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
