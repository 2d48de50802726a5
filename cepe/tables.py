"""The one markdown-table helper of the reports (eval, RULER, the main job, bench-store), and the
JSON-and-table writer of the measuring scripts.

Hand-written rather than a library (``tabulate``'s ``pipe`` format pads and aligns its columns, which would
change every committed report byte for byte); stdlib only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .fileio import write_json, write_text


def pipe_table(head: Sequence[Any], rows: Iterable[Sequence[Any]]) -> list[str]:
    """The lines of a pipe table: ``| a | b |``, ``|---|---|``, then one ``| x | y |`` line per row."""
    lines = ["| " + " | ".join(map(str, head)) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return lines


def write_rows(out: str | os.PathLike[str], rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """A script's measured rows (dicts with the same keys) as ``OUT.json`` (``{"meta": ..., "rows": ...}``)
    and ``OUT.md`` (one pipe table), each written atomically; OUT's folder is made if missing."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # OUT + suffix, not with_suffix: a name with a dot in it (``kernels_v1.5``) keeps its whole name
    write_json(Path(f"{out}.json"), {"meta": meta, "rows": rows}, indent=1)
    write_text(
        Path(f"{out}.md"), "\n".join(pipe_table(list(rows[0]), [list(r.values()) for r in rows])) + "\n"
    )
