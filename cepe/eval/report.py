"""Result files: JSON (everything), a markdown table, and PNG plots (matplotlib, Agg backend).

A result is ``{"task", "model", "config", "rows": [...]}``; a row is ``{"method", "setting": {...},
"metric", "value", "n", "tokens_per_s", "peak_memory_mb", ...}``.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cepe import fileio
from cepe.tables import pipe_table


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def markdown_table(result: dict[str, Any]) -> str:
    """Markdown table of the rows: setting columns, method, metric, value, n, tokens/s, peak MB."""
    rows = result.get("rows", [])
    keys: list[str] = []
    for r in rows:
        for k in r.get("setting", {}):
            if k not in keys:
                keys.append(k)
    head = [*keys, "method", "metric", "value", "n", "tokens/s", "peak MB"]
    lines = [f"# {result.get('task', 'eval')}: {result.get('model', '')}", ""]
    lines += pipe_table(
        head,
        (
            [_fmt(r.get("setting", {}).get(k, "")) for k in keys]
            + [r["method"], r["metric"], _fmt(r["value"]), _fmt(r.get("n", ""))]
            + [_fmt(r.get("tokens_per_s", "")), _fmt(r.get("peak_memory_mb", ""))]
            for r in rows
        ),
    )
    notes = result.get("notes")
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    extra = result.get("extra_markdown")
    if extra:
        lines += ["", extra.rstrip("\n")]
    return "\n".join(lines) + "\n"


def line_series(
    result: dict[str, Any], x_key: str, metric: str | None = None, ignore: Sequence[str] = ()
) -> tuple[dict[str, list[tuple[float, float]]], str]:
    """``({label: [(x, value)]}, y label)``: one series per method and per value of the settings other
    than ``x_key`` and ``ignore`` (settings that follow from ``x_key``, such as lm's decoder window per
    total), points sorted by x."""
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    ylabel = metric or ""
    for r in result.get("rows", []):
        if metric is not None and r["metric"] != metric:
            continue
        s = r.get("setting", {})
        if x_key not in s or not isinstance(r["value"], (int, float)):
            continue
        ylabel = r["metric"]
        rest = ", ".join(f"{k}={v}" for k, v in s.items() if k != x_key and k not in ignore)
        series[f"{r['method']}" + (f" ({rest})" if rest else "")].append((float(s[x_key]), float(r["value"])))
    return {label: sorted(pts) for label, pts in series.items()}, ylabel


def plot_lines(
    result: dict[str, Any], x_key: str, path: Path, metric: str | None = None, ignore: Sequence[str] = ()
) -> Path | None:
    """Metric against setting ``x_key`` (:func:`line_series`); None where nothing is plotted."""
    series, ylabel = line_series(result, x_key, metric, ignore)
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pts in sorted(series.items()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel(x_key)
    ax.set_ylabel(ylabel)
    ax.set_title(str(result.get("task", "")))
    ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def plot_heatmap(grid: list[list[float]], xs: list[Any], ys: list[Any], path: Path, title: str) -> Path:
    """Heatmap of ``grid[y][x]`` in [0, 1] (needle accuracy: depth rows x length columns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.0 + 0.8 * len(xs), 1.0 + 0.5 * len(ys)))
    im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(xs)), [str(x) for x in xs])
    ax.set_yticks(range(len(ys)), [f"{y:.0%}" if isinstance(y, float) else str(y) for y in ys])
    ax.set_xlabel("total tokens")
    ax.set_ylabel("needle depth")
    ax.set_title(title)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def plot_heatmap_panels(
    grids: dict[str, list[list[float]]], xs: list[Any], ys: list[Any], path: Path, title: str
) -> Path:
    """One heat-map panel per method of ``grid[y][x]`` in [0, 1] (rows ``ys``, columns ``xs``), values
    written in the cells; NaN cells stay blank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(grids)
    fig, axes = plt.subplots(
        1, len(names), figsize=(1.6 + 0.75 * len(xs) * len(names), 1.0 + 0.32 * len(ys)), squeeze=False
    )
    im = None
    for k, (ax, name) in enumerate(zip(axes[0], names)):
        grid = np.array(grids[name], dtype=float)
        im = ax.imshow(np.ma.masked_invalid(grid), vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        for (i, j), v in np.ndenumerate(grid):
            if not math.isnan(v):
                ax.text(j, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(xs)), [f"{x // 1024}K" if x % 1024 == 0 else str(x) for x in xs])
        ax.set_yticks(range(len(ys)), [str(y) for y in ys] if k == 0 else [""] * len(ys))
        ax.set_xlabel("tokens")
        ax.set_title(name, fontsize=9)
    fig.suptitle(title, fontsize=10)
    if im is not None:
        fig.colorbar(im, ax=list(axes[0]), fraction=0.02)
    _save(fig, path, bbox_inches="tight")
    plt.close(fig)
    return path


def _save(fig: Any, path: Path, **kwargs: Any) -> None:
    """``fig`` as a PNG at ``path``, written atomically (a stopped run leaves the previous file or none)."""
    with fileio.atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=120, **kwargs)


def _plotted(path: Path, draw: Any) -> Path | None:
    """``draw()``'s plot at ``path``, or None with a warning where drawing fails (matplotlib missing, a
    full disk): the plots come after the numbers, which are written whatever happens to them."""
    import warnings

    try:
        return draw()
    except Exception as err:  # noqa: BLE001 - any plotting failure, named in the warning
        path.unlink(missing_ok=True)  # an earlier run's plot beside these numbers would look like theirs
        import sys

        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")
        warnings.warn(f"plot {path} not written: {type(err).__name__}: {err}", stacklevel=2)
        return None


def write_report(result: dict[str, Any], out_dir: str | Path, x_key: str | None = None) -> dict[str, str]:
    """Write ``<task>.json``, ``<task>.md`` and (with ``x_key``) ``<task>.png`` into ``out_dir``.

    A result with ``heatmaps`` (``{method: grid[row][total]}``), ``heatmap_rows`` and ``totals`` also gets
    ``<task>_heatmap.png`` (one panel per method).

    Returns:
        ``{"json": path, "markdown": path, "plot": path?, "heatmap": path?}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    task = str(result.get("task", "eval"))
    paths = {"json": str(out / f"{task}.json"), "markdown": str(out / f"{task}.md")}
    # each written atomically, the JSON (what scripts take as the evaluation's being done) last
    fileio.write_text(paths["markdown"], markdown_table(result))
    if x_key:
        png = out / f"{task}.png"
        ignore = list(result.get("plot_ignore") or [])
        p = _plotted(png, lambda: plot_lines(result, x_key, png, ignore=ignore))
        if p is not None:
            paths["plot"] = str(p)
    if result.get("heatmaps"):
        hp = out / f"{task}_heatmap.png"
        args = (
            result["heatmaps"],
            list(result["totals"]),
            list(result["heatmap_rows"]),
            hp,
            f"{task}: accuracy %",
        )
        if _plotted(hp, lambda: plot_heatmap_panels(*args)) is not None:
            paths["heatmap"] = str(hp)
    for method, grid in (result.get("grids") or {}).items():
        hp = out / f"{task}_{method}.png"
        args = (grid, list(result["totals"]), list(result["depths"]), hp, f"{task}: {method}")
        if _plotted(hp, lambda a=args: plot_heatmap(*a)) is not None:
            paths[f"heatmap_{method}"] = str(hp)
    # an earlier run's plots that this one did not draw would read as this result's: remove them
    from cepe.eval.config import METHODS

    for stale in [f"{task}.png", f"{task}_heatmap.png", *(f"{task}_{m}.png" for m in METHODS)]:
        if str(out / stale) not in paths.values():
            (out / stale).unlink(missing_ok=True)
    fileio.write_text(paths["json"], json.dumps(result, indent=2, default=str))
    return paths
