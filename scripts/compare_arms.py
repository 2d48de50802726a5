"""Compare training arms (for example CEPE against CEPED from the same start) on the probes and the
instruction-style evaluations, at each scored step.

Usage: python scripts/compare_arms.py RESULTS_DIR [RUN_DIR ...]

RESULTS_DIR holds one folder per arm and step, ``ARM_stepN``, with what ``scripts/eval_candidate.sh``
(``needle_encoder/``, ``icl/``, ``qa/``) and ``scripts/eval_checkpoint.sh`` (``copy/``, ``needle_val/``,
``lm_val/``, ``icl_val/``) wrote. Each RUN_DIR (a training run whose base name is ``long_ARM`` or given as
``ARM=RUN_DIR``) adds the CPU-minutes of its first N steps (the sum of its logged step times). Writes
``compare.json``, ``compare.md`` and ``compare.png`` in RESULTS_DIR.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from cepe.fileio import atomic_path, write_text

IN_WINDOW = (2048, 0.9)  # the reported needle's one cell whose needle lies in the decoder window


def _rows(path: Path) -> list[dict]:
    return json.loads(path.read_text())["rows"] if path.is_file() else []


def metrics(folder: Path) -> dict[str, float]:
    """The comparison's numbers for one arm at one step (missing evaluations are left out)."""
    out: dict[str, float] = {}
    for r in _rows(folder / "lm_val" / "lm.json"):
        if r["setting"]["domain"] == "avg":
            out[f"lm_val ppl {r['setting']['total'] // 1024}K"] = r["value"]
    for order in ("natural", "shuffled"):
        vals = [r["value"] for r in _rows(folder / "copy" / "copy.json") if r["setting"]["order"] == order]
        if vals:
            out[f"copy ppl {order} (mean of 3)"] = sum(vals) / len(vals)
    needle = _rows(folder / "needle_val" / "needle.json")
    if needle:
        out["needle_val %"] = sum(r["value"] for r in needle) / len(needle)
        out["needle_val answer NLL"] = sum(r["answer_nll"] for r in needle) / len(needle)
    for r in _rows(folder / "icl_val" / "icl.json"):
        out[f"icl_val 2+{r['setting']['k_encoder']} %"] = r["value"]
    for r in _rows(folder / "icl" / "icl.json"):
        if r["method"] == "cepe":
            out[f"icl 2+{r['setting']['k_encoder']} %"] = r["value"]
    for r in _rows(folder / "qa" / "qa.json"):
        if r["method"] == "cepe":
            out[f"qa EM k={r['setting']['k']} %"] = r["value"]
    cells = [
        r
        for r in _rows(folder / "needle_encoder" / "needle.json")
        if (r["setting"]["total"], r["setting"]["depth"]) != IN_WINDOW
    ]
    if cells:
        out[f"needle beyond the window % ({len(cells)} cells)"] = sum(r["value"] for r in cells) / len(cells)
    return out


def cpu_minutes(run: Path, step: int) -> float | None:
    log = run / "log.jsonl"
    if not log.is_file():
        return None
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    by_step = {r["step"]: r.get("step_s", 0.0) for r in rows}  # a resumed step keeps its last record
    return sum(v for s, v in by_step.items() if s <= step) / 60


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    root = Path(argv[0])
    runs: dict[str, Path] = {}
    for spec in argv[1:]:
        name, _, path = spec.rpartition("=")
        runs[name or Path(path).name.removeprefix("long_")] = Path(path)
    found = sorted(
        (m.group(1), int(m.group(2)), p)
        for p in root.iterdir()
        if p.is_dir() and (m := re.fullmatch(r"(.+)_step(\d+)", p.name))
    )
    if not found:
        print(f"no ARM_stepN folders in {root}")
        return 1
    table = {f"{arm} step {step}": {"arm": arm, "step": step, **metrics(p)} for arm, step, p in found}
    for arm, step, _ in found:
        if arm in runs and (m := cpu_minutes(runs[arm], step)) is not None:
            table[f"{arm} step {step}"]["training CPU-minutes"] = m
    write_text(root / "compare.json", json.dumps(table, indent=1) + "\n")

    names = list(table)
    keys = [k for k in dict.fromkeys(k for v in table.values() for k in v) if k not in ("arm", "step")]
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for k in keys:
        cells = [f"{table[n][k]:.2f}" if isinstance(table[n].get(k), float) else "" for n in names]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    write_text(root / "compare.md", "\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [k for k in keys if k != "training CPU-minutes"]
    cols = 4
    fig, axes = plt.subplots(-(-len(shown) // cols), cols, figsize=(4 * cols, 3 * -(-len(shown) // cols)))
    for ax, k in zip(axes.flat, shown):
        for i, arm in enumerate(dict.fromkeys(a for a, _, _ in found)):
            pts = [(table[n]["step"], table[n][k]) for n in names if table[n]["arm"] == arm and k in table[n]]
            if pts:  # markers and dashes differ, so that arms with equal values stay visible
                ax.plot(*zip(*pts), marker="os^D"[i % 4], linestyle=("-", "--")[i % 2], label=arm)
        ax.set_title(k, fontsize=9)
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(shown) :]:
        ax.axis("off")
    axes.flat[0].legend()
    fig.tight_layout()
    with atomic_path(root / "compare.png", suffix=".png") as tmp:
        fig.savefig(tmp, dpi=90)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
