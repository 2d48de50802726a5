"""Summarise the short route's stages (docs/TRAINING.md, "The short route" and "Recall again after the
decision, then questions") into results/recipe/short_route.{json,md,png}: per stage-end checkpoint, the
copy probe, the validation needle (greedy accuracy and answer NLL), validation perplexity, the reported
needle, ICL and QA and, where written, validation perplexity beyond the pivot (lm_val_long), read from the
result folders the documented commands wrote
(results/recipe/NAME/stepNNN/{copy,calibrate.json,needle_encoder,icl,qa}). A missing result is left blank.

Usage: python scripts/route_report.py [OUT_DIR]   (default results/recipe)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from recipe_report import copy_columns  # scripts/ is on the path when this file is run

from cepe.fileio import atomic_path

ROOT = Path("results/recipe")
# the route's stage ends, in training order: (stage, step)
ROUTE = [
    ("fast_direct_copy", 100),
    ("fast_direct_recall2", 120),
    ("fast_direct_8kd", 100),
    ("fast_direct_mixed", 40),
    ("fast_direct_reread", 80),
    ("fast_direct_reread2", 60),
    ("fast_direct_qa", 40),
    ("fast_direct_qa2", 40),
    ("fast_direct_qa_teach", 30),
    ("fast_direct_qa_long", 40),
    ("fast_direct_qa_teach_held", 30),
    ("fast_direct_qa_compound", 40),
    ("fast_direct_qa_teach_held2", 30),
    ("fast_direct_qa_teach_held3", 30),
    ("fast_direct_qa_teach_held_fast", 30),
    ("fast_direct_held_reread", 20),
    ("fast_direct_null_teach", 30),
    ("fast_direct_lm512", 20),
    ("fast_direct_null_teach2", 30),
    ("fast_direct_tgate", 30),
    ("fast_direct_tgate2", 40),
    ("fast_direct_tgate512", 15),
    ("fast_direct_mgate", 30),
    ("fast_direct_mgate_c", 30),
    ("fast_direct_mgate512", 15),
    ("fast_direct_mgate_c2", 40),
    ("fast_direct_mgate_c3", 60),
    ("fast_direct_gates", 40),
    ("fast_direct_len", 40),
    ("fast_direct_len2", 40),
    ("fast_direct_len3", 40),
    ("fast_direct_len3_half", 40),
    ("fast_direct_len4", 40),
    ("fast_direct_len4g", 30),
    ("fast_direct_len5", 40),
    ("fast_direct_len6", 40),
    ("fast_direct_short", 40),
    ("fast_direct_copyshort", 40),
    ("fast_direct_copyshort_up", 40),
    ("fast_direct_copyshort2_up", 40),
    ("fast_direct_copyshort3", 40),
    ("fast_direct_long", 40),
    ("fast_direct_long2", 40),
    ("fast_direct_soft", 40),
    ("fast_direct_soft2", 40),
    ("fast_direct_soft3", 40),
    ("fast_direct_induct", 40),
    ("fast_direct_induct_c", 40),
    ("fast_direct_gates_c", 40),
    ("fast_direct_induct_c2", 40),
    ("fast_fold", 40),  # the route folded (docs/TRAINING.md, "A new machine"): on this CPU not run yet
    # the same five stages on an accelerator, exported in int8 and probed on the CPU
    # (docs/TRAINING.md, "The route on an accelerator")
    ("gpu_fast_fold", 40),
    ("fast_fold_qa", 40),  # the fold's mix swapped for fast_direct_qa's, from gpu_fast_fold
    ("fast_fold_qa2", 40),  # forty more of the same
    ("fast_fold_gates", 40),  # the fold's mix with only the gates training, from fast_fold_qa2
    ("fast_fold_qa3", 40),  # fast_fold_qa2's mix, forty more
    ("fast_fold_gates_nolen", 40),  # fast_fold_gates with the length exponents held
    ("fast_fold_break", 40),  # fast_fold_qa2's mix with answers that break their line, from fast_fold_qa2
    ("fast_fold_break_gates", 40),  # fast_fold_gates' mix with answers that break, from fast_fold_break
    ("fast_fold_break_only", 40),  # fast_fold_break without the two-clause facts
    ("fast_fold_decoys", 40),  # fast_fold_qa2's mix with decoy facts sharing the answer's opening
    ("soup_qa2_gates", 40),  # the average of fast_fold_qa2 and fast_fold_gates, both at step 40
    ("soup_qa2_children", 40),  # the average of fast_fold_qa3, fast_fold_break, fast_fold_break_only
    ("soup_qa2_gates_break", 40),  # the average of fast_fold_qa2, fast_fold_gates, fast_fold_break_only
    ("fast_fold_break_low", 40),  # fast_fold_break_only at a third of its learning rates
    ("soup_qa2_gates_break_low", 40),  # the average of fast_fold_qa2, fast_fold_gates, fast_fold_break_low
    ("soup_qa2_all", 40),  # the average of fast_fold_qa2 and its seven forty-step continuations
    ("soup_qa2_gates_break_decoys", 40),  # soup_qa2_gates_break's three and fast_fold_decoys
    ("soup_qa2_gates2_break", 40),  # soup_qa2_gates_break with fast_fold_gates at twice the weight
    ("fast_soup_break_low", 40),  # fast_fold_break_low's mix and rates from soup_qa2_gates_break
    ("soup_choice_fold", 40),  # soup_qa2_gates_break three parts to gpu_fast_fold's one
    ("fast_soup_gates", 40),  # fast_fold_gates' stage from soup_qa2_gates_break
    ("soup_choice_soup_gates", 40),  # the average of soup_qa2_gates_break and fast_soup_gates
    ("fast_soup_dec512", 40),  # fast_soup_break_low with 512 decoder tokens
    ("soup_choice_dec512", 40),  # the average of soup_qa2_gates_break and fast_soup_dec512
    ("fast_soup_dec512_recall", 40),  # fast_soup_dec512 with recall at 0.45 of the examples
    ("soup_choice_dec512x2", 40),  # the average of soup_qa2_gates_break and the two dec512 stages
]
TOTALS = (2048, 4096, 8192)
# the frozen decoder on configs/eval/lm_val.yaml at 1K (docs/TRAINING.md, "Too strong, not too eager")
DECODER_ALONE_LM_VAL_1K = 19.42


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _fmt(values: list[float | None], digits: int = 1) -> str:
    return " / ".join("" if v is None else f"{v:.{digits}f}" for v in values)


def stage_row(stage: str, step: int) -> dict:
    """One checkpoint's numbers (``None`` where its result was not written)."""
    d = ROOT / stage / f"step{step:03d}"
    row: dict = {"stage": stage, "step": step}
    row.update(copy_columns(d / "copy" / "copy.json", "cepe"))
    copy_val = _load(d / "copy_val" / "copy.json")
    if copy_val:  # the validation copy probe (retrieval split), natural order
        vals = {
            r["setting"]["domain"]: r["value"]
            for r in copy_val["rows"]
            if r["method"] == "cepe" and r["setting"]["order"] == "natural"
        }
        row["copy_val"] = [vals.get(k) for k in ("books", "papers", "code")]
    cal = _load(d / "calibrate.json")
    if cal:
        c = cal["rows"][0]
        row["val_needle"] = [c.get(f"needle_{t}") for t in TOTALS]
        row["val_answer_nll"] = [c.get(f"needle_nll_{t}") for t in TOTALS]
        row["lm_val"] = [c.get("lm_val_1024"), c.get("lm_val_2048")]
    lm_long = _load(d / "lm_val_long" / "lm.json")
    if lm_long:  # validation perplexity beyond the pivot (configs/eval/lm_val_long.yaml), domain average
        avg = {r["setting"]["total"]: r["value"] for r in lm_long["rows"] if r["setting"]["domain"] == "avg"}
        row["lm_val_long"] = [avg.get(4096), avg.get(8192)]
    val2 = _load(d / "needle_val2" / "needle.json")
    if val2:
        rows = [r for r in val2["rows"] if r["method"] == "cepe"]
        row["val2_needle"] = [
            statistics.mean(r["value"] for r in rows if r["setting"]["total"] == t) for t in TOTALS
        ]
    needle = _load(d / "needle_encoder" / "needle.json")
    if needle:
        rows = [r for r in needle["rows"] if r["method"] == "cepe"]
        row["needle"] = [
            statistics.mean(r["value"] for r in rows if r["setting"]["total"] == t) for t in TOTALS
        ]
        row["needle_mean"] = statistics.mean(r["value"] for r in rows)
    for task, key in (("icl", "k_encoder"), ("qa", "k")):
        res = _load(d / task / f"{task}.json")
        if res:
            row[task] = {str(r["setting"][key]): r["value"] for r in res["rows"] if r["method"] == "cepe"}
    return row


def markdown(rows: list[dict]) -> str:
    head = (
        "| checkpoint | copy natural (essays / papers / code) | copy shuffled "
        "| validation copy (books / papers / code) | validation needle 2K / 4K / 8K "
        "(%) | answer NLL 2K / 4K / 8K | second validation needle 2K / 4K / 8K (%) | `lm_val` 1K / 2K "
        "| `lm_val_long` 4K / 8K "
        "| reported needle 2K / 4K / 8K (%) | reported mean "
        "| ICL 2+4 / 2+8 | QA k = 2 / 5 / 10 |"
    )
    out = [head, "|" + "---|" * 13]
    for r in rows:
        icl, qa = r.get("icl", {}), r.get("qa", {})
        out.append(
            "| "
            + " | ".join(
                [
                    f"`{r['stage']}`"
                    + (
                        " (an average of checkpoints)"
                        if r["stage"].startswith("soup_")
                        else f" step {r['step']}"
                    ),
                    r.get("copy ppl natural (essays / papers / code)", ""),
                    r.get("copy ppl shuffled (essays / papers / code)", ""),
                    _fmt(r.get("copy_val", [])),
                    _fmt(r.get("val_needle", []), 0),
                    _fmt(r.get("val_answer_nll", []), 2),
                    _fmt(r.get("val2_needle", []), 0),
                    _fmt(r.get("lm_val", [])),
                    _fmt(r.get("lm_val_long", [])),
                    _fmt(r.get("needle", []), 0),
                    "" if "needle_mean" not in r else f"{r['needle_mean']:.0f}",
                    _fmt([icl.get(k) for k in ("4", "8")], 0) if icl else "",
                    _fmt([qa.get(k) for k in ("2", "5", "10")], 0) if qa else "",
                ]
            )
            + " |"
        )
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(rows)))
    labels = [f"{r['stage'].removeprefix('fast_direct_')} {r['step']}" for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 5.2))

    def series(key, fn):
        return [fn(r[key]) if key in r else float("nan") for r in rows]

    a.plot(x, series("needle_mean", float), "o-", label="reported needle (mean of 15 cells)")
    a.plot(x, series("val_needle", statistics.mean), "s--", label="validation needle (mean of 15)")
    a.plot(x, series("val2_needle", statistics.mean), "^:", label="second validation needle (mean of 15)")
    a.axhline(90, color="grey", lw=0.8, ls=":", label="target 90 %")
    a.set_ylabel("accuracy (%)")
    a.set_ylim(-5, 105)
    b.plot(x, series("lm_val", lambda v: v[0]), "o-", label="CEPE, lm_val 1K")
    b.axhline(DECODER_ALONE_LM_VAL_1K, color="grey", lw=0.8, ls=":", label="decoder alone")
    b.set_ylabel("validation perplexity")
    b.set_ylim(bottom=15)
    for ax in (a, b):
        ax.set_xticks(x, labels, fontsize=7, rotation=45, ha="right")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("The short route: stage ends (default decoder, held-out and validation sets)")
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=110)


def main(out: Path) -> None:
    rows = [stage_row(s, n) for s, n in ROUTE if (ROOT / s / f"step{n:03d}").is_dir()]
    if not rows:
        raise SystemExit(f"no stage results under {ROOT}/: run the route's probes first (docs/TRAINING.md)")
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("short_route.json", json.dumps(rows, indent=2) + "\n"),
        ("short_route.md", markdown(rows)),
    ):
        with atomic_path(out / name) as tmp:
            tmp.write_text(text)
    plot(rows, out / "short_route.png")
    print(f"wrote {out}/short_route.{{json,md,png}} ({len(rows)} checkpoints)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
