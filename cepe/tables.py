"""The one markdown-table helper of the reports (eval, RULER, the main job, bench-store).

Hand-written rather than a library (``tabulate``'s ``pipe`` format pads and aligns its columns, which would
change every committed report byte for byte); stdlib only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def pipe_table(head: Sequence[Any], rows: Iterable[Sequence[Any]]) -> list[str]:
    """The lines of a pipe table: ``| a | b |``, ``|---|---|``, then one ``| x | y |`` line per row."""
    lines = ["| " + " | ".join(map(str, head)) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return lines
