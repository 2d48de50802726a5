"""Where a chain of recipe stages stands (scripts/train_chain.sh): per stage, its steps done of its
config's steps, its median seconds a step, what that makes for its steps, its loss as the mean of each
window of steps, its newest checkpoint, and the hours left at each stage's measured pace.

Everything comes from the run folders and the configs; no model is loaded and nothing is timed:
- steps: ``configs/train/recipe/NAME.yaml`` (``extends`` followed); done: ``runs/recipe/NAME/log.jsonl``.
- seconds a step: the median of the ``step_s`` its rows logged. A pause (``kill -STOP``, the host busy)
  inflates the step it falls in and not the median, so steps × median is the stage's CPU-minutes at its own
  pace, as the documented per-stage tables give them. A resumed run rewrites ``log.jsonl`` up to its
  checkpoint's step: the rows are the steps the run kept, each once (``cepe.training.trainer.read_log``).
- the loss windows: the mean of ``loss`` (and of each ``--terms`` key the rows carry) over steps 1-N,
  N+1-2N, ... (``--every N``, default 50); a last window shorter than N is marked with its step range.
- ``--pace-from N`` / ``--pace-to M``: the median over steps N to M only (before and after a change of
  speed, e.g. a restart with another allocator); the loss windows still cover every step.
- hours left: each stage's remaining steps times its own median; a stage not yet begun has no pace of its
  own (nor has a stage whose first step is under way) and is left out of the sum, which names them.

The chain's ``heads:NAME`` entries (heads fitted and judged, no training steps) are left out, so the
chain's own arguments can be given.

Usage: python scripts/chain_report.py NAME [NAME ...] [--runs runs/recipe] [--every 50]
    [--terms lm_qa,lm_lm] [--pace-from N] [--pace-to M] [--out OUT]
(``--out OUT`` writes OUT.json and OUT.md; the markdown table is printed either way.)
e.g.   python scripts/chain_report.py fast_warmup fast_direct_copy fast_direct_recall2 read_lm
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from cepe.configio import read_config_file
from cepe.fileio import write_json, write_text
from cepe.tables import pipe_table
from cepe.training.runctl import read_status
from cepe.training.trainer import read_log

CONFIGS = Path("configs/train/recipe")


def windows(rows: list[dict[str, Any]], key: str, every: int) -> list[str]:
    """Mean of ``key`` over steps 1-every, every+1-2·every, ...; a partial last window names its steps."""
    out = []
    last = rows[-1]["step"] if rows else 0
    for lo in range(1, last + 1, every):
        hi = lo + every - 1
        vals = [float(r[key]) for r in rows if lo <= r["step"] <= hi and key in r]
        if not vals:
            continue
        text = f"{statistics.fmean(vals):.3f}"
        if hi > last:
            text += f" ({lo}-{last})"
        out.append(text)
    return out


def stage_steps(name: str, configs: Path) -> int:
    """The ``steps`` a recipe stage's config (with what it extends) asks for."""
    path = configs / f"{name}.yaml"
    if not path.is_file():
        raise SystemExit(f"no such stage: {path} (NAME is a file name under {configs}, without .yaml)")
    steps = read_config_file(path).get("steps")
    if not isinstance(steps, int) or steps <= 0:
        raise SystemExit(f"{path}: no positive `steps` in the config or what it extends")
    return steps


def newest_checkpoint(out: Path) -> int | None:
    steps = [
        int(p.name.split("_")[1])
        for p in (out / "checkpoints").glob("step_*")
        if p.name.split("_")[1].isdigit()
    ]
    return max(steps) if steps else None


def stage_row(
    name: str,
    runs: Path,
    configs: Path,
    every: int,
    terms: list[str],
    pace_from: int = 1,
    pace_to: int | None = None,
) -> dict[str, Any]:
    """One stage's measured state (see the module docstring); the pace (median step time, and the hours
    left from it) over the steps numbered ``pace_from`` to ``pace_to`` (None: the last)."""
    total = stage_steps(name, configs)
    out = runs / name
    try:
        rows = [r for r in read_log(out) if "step" in r]
    except ValueError as e:
        raise SystemExit(str(e)) from None
    done = rows[-1]["step"] if rows else 0
    step_s = [
        float(r["step_s"])
        for r in rows
        if "step_s" in r and r["step"] >= pace_from and (pace_to is None or r["step"] <= pace_to)
    ]
    median = statistics.median(step_s) if step_s else None
    state = "not begun"
    status = out / "status.json"
    if status.is_file():
        try:  # a run that says it is running while its process is gone reads "stopped (process gone)"
            state = (read_status(out) or {}).get("state", "unknown")
        except json.JSONDecodeError:
            state = "unknown"
    row: dict[str, Any] = {
        "stage": name,
        "state": state,
        "steps_done": done,
        "steps": total,
        "median_step_s": round(median, 2) if median is not None else None,
        "minutes_at_median": round(done * median / 60, 1) if median is not None else None,
        "hours_left": round((total - done) * median / 3600, 2) if median is not None else None,
        "newest_checkpoint": newest_checkpoint(out),
        f"loss_each_{every}": windows(rows, "loss", every),
    }
    for term in terms:
        row[f"{term}_each_{every}"] = windows(rows, term, every)
    return row


def table(rows: list[dict[str, Any]]) -> list[str]:
    head = [
        "stage",
        "state",
        "steps",
        "median s a step",
        "minutes (steps × median)",
        "hours left",
        "newest checkpoint",
    ]
    extra = [k for k in rows[0] if "_each_" in k]
    head += [k.replace("_each_", " each ") for k in extra]

    def cell(v: Any) -> str:
        if v is None or v == []:
            return ""
        return " / ".join(v) if isinstance(v, list) else str(v)

    body = [
        [
            r["stage"],
            r["state"],
            f"{r['steps_done']} / {r['steps']}",
            cell(r["median_step_s"]),
            cell(r["minutes_at_median"]),
            cell(r["hours_left"]),
            cell(r["newest_checkpoint"]),
        ]
        + [cell(r[k]) for k in extra]
        for r in rows
    ]
    return pipe_table(head, body)


def summary(rows: list[dict[str, Any]]) -> str:
    left = [r["hours_left"] for r in rows if r["hours_left"] is not None]
    unpaced = [r["stage"] for r in rows if r["hours_left"] is None]
    text = f"hours left at each stage's own pace: {sum(left):.2f}"
    if unpaced:
        text += f", not counting {len(unpaced)} stage(s) with no step timed yet ({', '.join(unpaced)})"
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stages", nargs="+", metavar="NAME", help="recipe stages, in chain order")
    ap.add_argument("--runs", default="runs/recipe", help="the chain's run folder (default runs/recipe)")
    ap.add_argument("--configs", default=str(CONFIGS), help=f"recipe configs (default {CONFIGS})")
    ap.add_argument("--every", type=int, default=50, help="steps per loss window (default 50)")
    ap.add_argument("--terms", default="", help="comma-separated loss terms to window too, e.g. lm_qa,lm_lm")
    ap.add_argument(
        "--pace-from",
        type=int,
        default=1,
        help="the median step time over steps from this one on (e.g. after a change of speed; default 1)",
    )
    ap.add_argument("--pace-to", type=int, default=None, help="... and up to this one (default: the last)")
    ap.add_argument("--out", help="write OUT.json and OUT.md")
    args = ap.parse_args(argv)
    if args.every <= 0:
        ap.error(f"--every must be a positive number of steps, got {args.every}")
    terms = [t for t in args.terms.split(",") if t]
    stages = [n for n in args.stages if not n.startswith("heads:")]  # the chain's heads: no training steps
    if not stages:
        ap.error(
            "no training stage named: heads:NAME entries have no steps (their verdicts are in "
            "results/recipe/NAME/val_verdict.md); name the stages, e.g. read_lm6"
        )
    rows = [
        stage_row(n, Path(args.runs), Path(args.configs), args.every, terms, args.pace_from, args.pace_to)
        for n in stages
    ]
    lines = [*table(rows), "", summary(rows)]
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"every": args.every, "terms": terms, "summary": summary(rows)}
        write_json(out.with_suffix(".json"), {"meta": meta, "rows": rows}, indent=1)
        write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
