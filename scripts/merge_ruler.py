"""Merge `cepe eval ruler` results of different methods on the same prompts into one report.

Usage: python scripts/merge_ruler.py OUT_DIR RUN_DIR [RUN_DIR ...]
Each RUN_DIR holds a ruler.json; the runs must share task settings, model and seed (checked, with the
prompts' token counts). Writes OUT_DIR/ruler.{json,md} and the heat map.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cepe.eval.report import write_report
from cepe.eval.tasks.ruler import merge


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    out, runs = argv[0], argv[1:]
    results = []
    for run in runs:
        path = Path(run) / "ruler.json"
        if not path.is_file():
            print(
                f"error: {path} not found: give directories written by `cepe eval ruler --out`",
                file=sys.stderr,
            )
            return 2
        results.append(json.loads(path.read_text()))
    try:
        merged = merge(results)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    paths = write_report(merged, out)
    print(f"wrote {paths['markdown']} ({', '.join(merged['methods'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
