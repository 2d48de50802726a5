"""Compare two runs of the same stage step by step: the mean of their last N common logged losses.

Each side is a trainer log: a ``log.jsonl`` (one JSON record a step, ``{"step", "loss", ...}``) or the
text log a stage writes with ``--no-progress`` (``..., step S/T, ..., loss L, ...`` lines), as
``results/recipe/gpu_route/NAME.log`` holds for the accelerator's run.

Usage: python scripts/compare_losses.py A B [--last N]
e.g.   python scripts/compare_losses.py runs/recipe/fast_direct_copy/log.jsonl results/recipe/gpu_route/fast_direct_copy.log
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

_LINE = re.compile(r"step (\d+)/\d+, .*?loss ([0-9.]+)")


def read_losses(path: Path) -> dict[int, float]:
    """Step → loss from a ``log.jsonl`` or a text log (the last record of a step counts)."""
    out: dict[int, float] = {}
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if line.startswith("{"):
            rec = json.loads(line)
            if "loss" in rec and "step" in rec:
                out[int(rec["step"])] = float(rec["loss"])
        elif m := _LINE.search(line):
            out[int(m.group(1))] = float(m.group(2))
    return out


def compare(a: dict[int, float], b: dict[int, float], last: int) -> dict:
    common = sorted(set(a) & set(b))[-last:]
    if not common:
        raise ValueError("the two logs share no logged step")
    return {
        "steps": [common[0], common[-1]],
        "n": len(common),
        "mean_a": sum(a[s] for s in common) / len(common),
        "mean_b": sum(b[s] for s in common) / len(common),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--last", type=int, default=20, help="how many of the last common steps (default 20)")
    args = ap.parse_args(argv)
    for p in (args.a, args.b):
        if not p.is_file():
            print(f"compare_losses: no such log: {p}", file=sys.stderr)
            return 2
    res = compare(read_losses(args.a), read_losses(args.b), args.last)
    print(
        f"steps {res['steps'][0]}-{res['steps'][1]} ({res['n']}): mean loss {res['mean_a']:.3f} ({args.a}) "
        f"/ {res['mean_b']:.3f} ({args.b})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
