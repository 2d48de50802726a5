"""Compare two runs of the same stage step by step: the mean of their last N common logged losses.

Each side is a trainer log: a ``log.jsonl`` (one JSON record a step, ``{"step", "loss", ...}``) or the
text log a stage writes with ``--no-progress`` (``..., step S/T, ..., loss L, ...`` lines), as
``results/recipe/gpu_route/NAME.log`` holds for the accelerator's run. A text line's loss is the trainer's
status: the mean of the last 10 steps' losses (fewer in the first steps), not the step's own; each step's
loss is recovered from those means, which needs a line for every step from step 1 (a resumed run's lines
continue the means, as its trainer reloads the last steps' losses from its ``log.jsonl``).

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
RECENT = 10  # a status line's loss: the mean over this many last steps (the trainer's ``loss_recent``)


def read_losses(path: Path) -> dict[int, float]:
    """Step → loss from a ``log.jsonl`` or a text log (the last record of a step counts; a text log's
    trailing means turned back into each step's loss by :func:`step_losses`).

    Raises:
        ValueError: the file holds both JSON records and status lines, or a text log lacks a step.
    """
    records: dict[int, float] = {}
    means: dict[int, float] = {}
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if line.startswith("{"):
            rec = json.loads(line)
            if "loss" in rec and "step" in rec:
                records[int(rec["step"])] = float(rec["loss"])
        elif m := _LINE.search(line):
            means[int(m.group(1))] = float(m.group(2))
    if records and means:
        raise ValueError(f"{path}: holds both log.jsonl records and status lines; give a stage's own log")
    return records or step_losses(means, path)


def step_losses(means: dict[int, float], path: Path | str = "the text log") -> dict[int, float]:
    """Each step's loss from the status lines' means of the last ``RECENT`` steps (``means[s]``: the mean
    over steps ``max(1, s - RECENT + 1)`` to ``s``): with ``total[s]`` the sum of steps 1..s,
    ``total[s] = s · means[s]`` up to ``RECENT`` and ``RECENT · means[s] + total[s - RECENT]`` after, and a
    step's loss is ``total[s] - total[s - 1]``. The lines round the means to 4 decimals: ``total[s]`` is off
    by at most ``5e-4 · ceil(s / RECENT)``, so a mean over n consecutive steps (two totals' difference over n)
    by at most ``1e-3 · ceil(s / RECENT) / n``, one step's loss by more.

    Raises:
        ValueError: a step from 1 to the last has no line (another ``log_every``, a log that begins later).
    """
    if not means:
        return {}
    last = max(means)
    gaps = [s for s in range(1, last + 1) if s not in means]
    if gaps:
        raise ValueError(
            f"{path}: a status line's loss is the mean of the last {RECENT} steps' and each step's is "
            f"recovered from a line for every step from step 1, but {len(gaps)} step(s) have none "
            f"(first {gaps[0]}); compare the run's log.jsonl instead"
        )
    total = [0.0] * (last + 1)
    for s in range(1, last + 1):
        total[s] = s * means[s] if s <= RECENT else RECENT * means[s] + total[s - RECENT]
    return {s: total[s] - total[s - 1] for s in range(1, last + 1)}


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
    try:
        res = compare(read_losses(args.a), read_losses(args.b), args.last)
    except ValueError as e:
        print(f"compare_losses: {e}", file=sys.stderr)
        return 2
    print(
        f"steps {res['steps'][0]}-{res['steps'][1]} ({res['n']}): mean loss {res['mean_a']:.3f} ({args.a}) "
        f"/ {res['mean_b']:.3f} ({args.b})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
