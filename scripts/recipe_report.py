"""Summarise the copy-warmup recipe ablation (scripts/recipe_ablation.sh) into results/recipe/:
training-loss curves against CPU-minutes (PNG), and a table of the final training loss, the width of Φ and
the copy probe (`cepe eval copy`, held-out passages) per variant (JSON + markdown).
``python scripts/recipe_report.py [RUNS_DIR [OUT_DIR]]`` (default runs/recipe, results/recipe).

CPU-minutes are steps × the run's median step time: the runs shared the machine with other jobs that paused
them, and a pause inflates the wall time of the step it falls in but not the median.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from cepe.fileio import atomic_path, write_text

DOMAINS = ("essays", "papers", "code")
# reference rows: (name, copy.json, method)
REFERENCES = [
    ("decoder alone (truncated)", "runs/recipe/copy_zero_bidir/copy/copy.json", "truncated"),
    ("full context (passage in the window)", "runs/recipe/copy_zero_bidir/copy/copy.json", "full"),
    ("shipped adapter (before)", "runs/recipe/shipped_copy/copy.json", "cepe"),
    ("long run, step 150", "runs/recipe/long_align_eval/copy_step_000150/copy.json", "cepe"),
]


def copy_columns(path: Path, method: str) -> dict[str, str]:
    """Copy-probe perplexities of ``method`` as ``essays / papers / code`` strings, natural and shuffled."""
    if not path.is_file():
        return {}
    rows = json.loads(path.read_text())["rows"]
    out = {}
    for order in ("natural", "shuffled"):
        vals = {
            r["setting"]["domain"]: r["value"]
            for r in rows
            if r["method"] == method and r["setting"]["order"] == order
        }
        if vals:
            out[f"copy ppl {order} (essays / papers / code)"] = " / ".join(
                f"{vals[d]:.1f}" for d in DOMAINS if d in vals
            )
    return out


def main(runs: Path = Path("runs/recipe"), out: Path = Path("results/recipe")) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    rows = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in sorted(p for p in runs.iterdir() if (p / "log.jsonl").is_file()):
        log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines() if x.strip()]
        if not log:
            continue
        step_s = statistics.median(r["step_s"] for r in log)
        minutes = [r["step"] * step_s / 60 for r in log]
        loss = [r.get("lm", r["loss"]) for r in log]  # the LM loss alone where a run adds supervision
        k = min(10, len(loss))
        ax.plot(
            minutes,
            [statistics.mean(loss[max(0, i - k + 1) : i + 1]) for i in range(len(loss))],
            label=run.name,
        )
        row = {
            "variant": run.name,
            "steps": log[-1]["step"],
            "median_step_s": round(step_s, 2),
            "cpu_minutes": round(minutes[-1], 1),
            "train_loss_last10": round(statistics.mean(loss[-k:]), 3),
            "train_loss_first": round(loss[0], 3),
        }
        cfg = run / "cepe_config.json"
        if cfg.is_file():  # what the states / absorbed caches and the store keep per context token
            enc = json.loads(cfg.read_text())["encoder"]
            row["phi_values_per_token"] = enc.get("output_size") or enc["hidden_size"]
        row.update(copy_columns(run / "copy" / "copy.json", "cepe"))
        rows.append(row)
    for name, path, method in REFERENCES:
        ref = copy_columns(Path(path), method)
        if ref:
            rows.append({"variant": name, **ref})
    ax.set_xlabel("CPU-minutes (2 cores, median step time)")
    ax.set_ylabel("training loss (shuffled copy warmup, 10-step mean)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(out / "recipe.png", suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120)
    write_text(out / "recipe.json", json.dumps(rows, indent=2) + "\n")
    keys = list(dict.fromkeys(k for r in rows for k in r))
    md = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    md += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    write_text(out / "recipe.md", "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main(*(Path(a) for a in sys.argv[1:]))
