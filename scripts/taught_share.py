"""How many examples the online teacher runs for, kind by kind, in a stage with ``online_teacher: true``:
each example built as training builds it (its micro-batch's drawn layout and masks) and counted as taught
by ``teacher_tasks`` and ``teacher_max_context`` (:func:`cepe.training.trainer.taught_counts`). No model is
loaded; the stage's data must be prepared (``runs/data/...``, as its chain makes it).

Usage: python scripts/taught_share.py CONFIG [--steps N]
e.g.   python scripts/taught_share.py configs/train/recipe/read_lm7.yaml --steps 30
"""

from __future__ import annotations

import argparse

from cepe.tables import pipe_table
from cepe.training.config import load_config
from cepe.training.trainer import taught_counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--steps", type=int, default=None, help="the first N optimizer steps (default: all)")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    counts = taught_counts(cfg, args.steps)
    rows = [[k, n, t, f"{100 * t / n:.1f} %"] for k, (n, t) in sorted(counts.items())]
    n_all, t_all = sum(n for n, _ in counts.values()), sum(t for _, t in counts.values())
    rows.append(["all", n_all, t_all, f"{100 * t_all / max(n_all, 1):.1f} %"])
    print("\n".join(pipe_table(["kind", "examples", "taught", "share"], rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
