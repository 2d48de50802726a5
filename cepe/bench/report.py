"""Summaries of a benchmark run: ratios, targets, printed tables, JSON and PNG curves."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# CEPE / full-context prefill throughput the benchmark aims for, by total tokens (80% of the cost model's
# prediction for the default decoder, rounded down).
THROUGHPUT_TARGETS = {8192: 2.0, 32768: 6.0, 131072: 20.0}
MEMORY_TARGET_TOKENS = 131072
MEMORY_TARGET_RATIO = 1 / 6
DECODE_STATES_FACTOR = 5.0

MB = 2**20


def _index(rows: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    out = {}
    for r in rows:
        if r.get("skipped") or r.get("error"):
            continue
        if r["kind"] == "prefill":
            out[("prefill", r["method"], r["tokens"])] = r
        else:
            out[("decode", r["method"], r.get("mode"))] = r
    return out


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Ratios between methods and the status of every target that the measured rows allow to check."""
    idx = _index(result["rows"])
    targets: list[dict[str, Any]] = []  # in order: prefill (by length), memory, decode
    lengths = sorted({r["tokens"] for r in result["rows"] if r["kind"] == "prefill"})
    prefill = [_prefill_entry(idx, t, result["predicted_flops"].get(str(t), {}), targets) for t in lengths]
    memory = _memory_summary(idx, result["cost_model"], targets, int(result["config"]["window"]))
    decode = _decode_summary(idx, targets)
    return {"prefill": prefill, "memory": memory, "decode": decode, "targets": targets}


def _target(text: str, measured: float, met: bool) -> dict[str, Any]:
    return {"target": text, "measured": measured, "met": met}


def _prefill_entry(
    idx: dict[tuple, dict[str, Any]], t: int, predicted: dict[str, Any], targets: list[dict[str, Any]]
) -> dict[str, Any]:
    """CEPE over each other method at ``t`` tokens (throughput, peak memory), against the cost model's
    ``predicted`` FLOPs; appends the throughput and memory targets checkable at ``t``."""
    cepe, full = idx.get(("prefill", "cepe", t)), idx.get(("prefill", "full", t))
    entry: dict[str, Any] = {"tokens": t}
    for m in ("full", "streamingllm", "replug"):
        other = idx.get(("prefill", m, t))
        if cepe and other:
            entry[f"throughput_cepe_over_{m}"] = cepe["tokens_per_s"] / other["tokens_per_s"]
            entry[f"peak_delta_cepe_over_{m}"] = cepe["peak_delta_bytes"] / max(1, other["peak_delta_bytes"])
    if predicted.get("cepe") and predicted.get("full"):
        entry["predicted_cepe_over_full"] = predicted["full"] / predicted["cepe"]
    if not (cepe and full):
        return entry
    measured = entry["throughput_cepe_over_full"]
    entry["fraction_of_predicted"] = measured / entry["predicted_cepe_over_full"]
    entry["peak_total_cepe_over_full"] = cepe["peak_rss_bytes"] / full["peak_rss_bytes"]
    if t in THROUGHPUT_TARGETS:
        goal = THROUGHPUT_TARGETS[t]
        targets.append(_target(f"prefill throughput CEPE/full at {t} >= {goal}x", measured, measured >= goal))
    fraction = entry["fraction_of_predicted"]
    targets.append(
        _target(
            f"prefill throughput CEPE/full at {t} >= 80% of the cost model's ratio "
            f"({entry['predicted_cepe_over_full']:.2f}x)",
            fraction,
            fraction >= 0.8,
        )
    )
    if t == MEMORY_TARGET_TOKENS:
        ratio = entry["peak_delta_cepe_over_full"]
        targets.append(
            _target(
                f"prefill peak memory (over the loaded model) CEPE/full at {t} <= 1/6",
                ratio,
                ratio <= MEMORY_TARGET_RATIO,
            )
        )
    return entry


def _memory_summary(
    idx: dict[tuple, dict[str, Any]], cost_model: dict[str, Any], targets: list[dict[str, Any]], window: int
) -> dict[str, Any]:
    """Memory CEPE keeps per extra context token: the slope between its two longest prefill rows of at
    least ``window`` tokens (a shorter row's tokens all sit in the decoder's K/V cache, so a slope from it
    is not the context's), as a fraction of full context's K/V per token; appends the two memory-slope
    targets."""
    cepe_rows = sorted(
        (r for k, r in idx.items() if k[0] == "prefill" and k[1] == "cepe" and r["tokens"] >= window),
        key=lambda r: r["tokens"],
    )
    memory: dict[str, Any] = {
        "full_kv_bytes_per_token": cost_model["full_kv_bytes_per_token"],
        "cepe_extra_fraction_bound": cost_model["cepe_extra_memory_fraction"],
    }
    if len(cepe_rows) < 2:
        return memory
    a, b = cepe_rows[-2], cepe_rows[-1]
    span = b["tokens"] - a["tokens"]
    kv = memory["full_kv_bytes_per_token"]
    memory["cepe_kept_tensor_bytes_per_token"] = (b["kept_tensor_bytes"] - a["kept_tensor_bytes"]) / span
    memory["cepe_kept_rss_bytes_per_token"] = (b["kept_rss_delta_bytes"] - a["kept_rss_delta_bytes"]) / span
    memory["cepe_kept_tensor_fraction"] = memory["cepe_kept_tensor_bytes_per_token"] / kv
    memory["cepe_kept_rss_fraction"] = memory["cepe_kept_rss_bytes_per_token"] / kv
    memory["slope_between_tokens"] = [a["tokens"], b["tokens"]]
    bound = memory["cepe_extra_fraction_bound"]
    tensor, rss = memory["cepe_kept_tensor_fraction"], memory["cepe_kept_rss_fraction"]
    targets.append(
        _target(
            f"extra memory kept per context token (exact tensor bytes) <= {bound:.4f} of the "
            "full-context K/V per token",
            tensor,
            tensor <= bound * (1 + 1e-9),
        )
    )
    targets.append(
        _target(
            f"extra memory kept per context token (measured resident) <= {bound:.4f} of the "
            "full-context K/V per token, within a stated 5% tolerance for allocator pages",
            rss,
            rss <= bound * 1.05,
        )
    )
    return memory


def _decode_summary(idx: dict[tuple, dict[str, Any]], targets: list[dict[str, Any]]) -> dict[str, Any]:
    """Decode tokens/s per CEPE cache mode and for full context; appends the two decode targets."""
    decode: dict[str, Any] = {}
    for mode in ("kv", "states", "absorbed"):
        r = idx.get(("decode", "cepe", mode))
        if r:
            decode[mode] = r["tokens_per_s"]
    full_dec = idx.get(("decode", "full", None))
    if full_dec:
        decode["full"] = full_dec["tokens_per_s"]
    fast = max((decode[m] for m in ("kv", "absorbed") if m in decode), default=None)
    if fast is not None and "full" in decode:
        targets.append(
            _target(
                "decode: kv or absorbed at least as fast as full context",
                fast / decode["full"],
                fast >= decode["full"],
            )
        )
    if fast is not None and "states" in decode:
        targets.append(
            _target(
                f"decode: kv or absorbed >= {DECODE_STATES_FACTOR:g}x the states mode",
                fast / decode["states"],
                fast >= DECODE_STATES_FACTOR * decode["states"],
            )
        )
    return decode


def format_report(result: dict[str, Any]) -> str:
    """Human-readable tables of a run (rows, ratios, targets)."""
    peak = result["matmul_peak_flops"]
    lines = [
        f"machine: {result['machine']}",
        f"measured {result['config']['dtype']} matmul peak: {peak / 1e9:.1f} GFLOP/s",
        "",
        f"{'prefill':<13}{'tokens':>8}{'tok/s':>11}{'s':>9}{'GFLOP':>11}{'%peak':>7}{'peak MB':>9}{'kept MB':>9}",
    ]
    for r in result["rows"]:
        if r["kind"] != "prefill":
            continue
        head = f"{r['method']:<13}{r['tokens']:>8}"
        if r.get("skipped") or r.get("error"):
            why = r.get("skipped") or "error: " + r["error"].splitlines()[-1][:60]
            cost = f"; cost model: {r['flops'] / 1e9:.0f} GFLOP" if "flops" in r else ""
            lines.append(f"{head}  ({why}{cost})")
            continue
        lines.append(
            f"{head}{r['tokens_per_s']:>11.1f}{r['seconds']:>9.2f}{r['flops'] / 1e9:>11.1f}"
            f"{100 * r['flops_per_s'] / peak:>7.1f}{r['peak_delta_bytes'] / MB:>9.1f}"
            f"{r['kept_tensor_bytes'] / MB:>9.1f}"
        )
    dec = [r for r in result["rows"] if r["kind"] == "decode"]
    if dec:
        lines += ["", f"{'decode':<20}{'context':>8}{'tok/s':>9}{'ms/tok':>9}{'GFLOP/tok':>11}{'kept MB':>9}"]
        for r in dec:
            name = r["method"] + (f"/{r['mode']}" if r.get("mode") else "")
            if r.get("error"):
                lines.append(f"{name:<20}{r['context']:>8}  error: {r['error'].splitlines()[-1][:60]}")
                continue
            lines.append(
                f"{name:<20}{r['context']:>8}{r['tokens_per_s']:>9.2f}{r['ms_per_token']:>9.1f}"
                f"{r['flops_per_token'] / 1e9:>11.2f}{r['kept_tensor_bytes'] / MB:>9.1f}"
            )
    s = result["summary"]
    lines += ["", "ratios (CEPE over baseline; throughput: higher is better, memory: lower is better)"]
    for e in s["prefill"]:
        parts = []
        if "predicted_cepe_over_full" in e:
            parts.append(f"cost-model full/CEPE {e['predicted_cepe_over_full']:.2f}x")
        for m in ("full", "streamingllm", "replug"):
            if f"throughput_cepe_over_{m}" in e:
                parts.append(
                    f"vs {m}: throughput {e[f'throughput_cepe_over_{m}']:.2f}x, "
                    f"peak {e[f'peak_delta_cepe_over_{m}']:.3f}"
                )
        lines.append(f"  {e['tokens']:>7}: " + "; ".join(parts))
    mem = s["memory"]
    if "cepe_kept_rss_fraction" in mem:
        lines.append(
            f"  extra memory per context token (CEPE, {mem['slope_between_tokens']}): "
            f"tensors {mem['cepe_kept_tensor_bytes_per_token']:.0f} B, resident "
            f"{mem['cepe_kept_rss_bytes_per_token']:.0f} B = {mem['cepe_kept_rss_fraction']:.4f} of the "
            f"full-context K/V ({mem['full_kv_bytes_per_token']} B; bound {mem['cepe_extra_fraction_bound']:.4f})"
        )
    if s["decode"]:
        lines.append("  decode tok/s: " + ", ".join(f"{k} {v:.2f}" for k, v in s["decode"].items()))
    lines += ["", "targets"]
    for t in s["targets"]:
        lines.append(f"  [{'met' if t['met'] else 'NOT met'}] {t['target']}: measured {t['measured']:.4g}")
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write the run's results (atomically)."""
    from cepe.fileio import write_json as write_atomic

    write_atomic(path, result, indent=2)


class PartialRows:
    """The rows a run has measured so far, kept in a file while the run goes on (``cepe bench``:
    ``bench.partial.json``; ``cepe bench-store``: ``bench_store.partial.json``).

    :meth:`append` adds a row and rewrites the file atomically: ``{**header, "rows": [...], "complete":
    false}``, each row as measured (``cepe bench`` adds ``fraction_of_peak`` to its final rows; ``cepe
    bench-store``'s final rows are these), so a run stopped part-way (killed, out of memory, an error) keeps
    what it measured. :meth:`done`, called once the final file is written, removes it. A new
    run starts over (its ratios must come from one run), so the file is a record, not a resume point.
    With ``path`` None (a run that writes nothing) the rows are only collected.
    """

    def __init__(self, path: str | os.PathLike[str] | None, **header: Any) -> None:
        self.path = Path(path) if path is not None else None
        self.header = header
        self.rows: list[dict[str, Any]] = []

    def append(self, row: dict[str, Any]) -> None:
        """Add ``row`` and rewrite the file with every row so far."""
        self.rows.append(row)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json({**self.header, "rows": self.rows, "complete": False}, self.path)

    def done(self) -> None:
        """The run's final file is written: remove the partial one."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def plot(result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Throughput and peak memory vs context length per method, and decode speed per cache mode (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if not r.get("skipped") and not r.get("error")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    methods = sorted({r["method"] for r in rows if r["kind"] == "prefill"})
    for m in methods:
        pts = sorted((r["tokens"], r) for r in rows if r["kind"] == "prefill" and r["method"] == m)
        xs = [t for t, _ in pts]
        axes[0].plot(xs, [r["tokens_per_s"] for _, r in pts], marker="o", label=m)
        axes[1].plot(xs, [r["peak_delta_bytes"] / MB for _, r in pts], marker="o", label=m)
    for ax, title, unit in (
        (axes[0], "prefill throughput", "tokens / s"),
        (axes[1], "prefill peak memory over the loaded model", "MiB"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("total tokens")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if methods:
            ax.legend()
    dec = [r for r in rows if r["kind"] == "decode"]
    names = [r["method"] + (f"/{r['mode']}" if r.get("mode") else "") for r in dec]
    if dec:
        axes[2].bar(names, [r["tokens_per_s"] for r in dec], color="tab:gray")
        axes[2].set_title(f"decode after {dec[0]['context']} tokens")
        axes[2].set_ylabel("tokens / s")
    else:  # a prefill-only run: say so instead of drawing empty axes
        axes[2].axis("off")
        axes[2].text(0.5, 0.5, "no decode settings in this run", ha="center", va="center")
    fig.suptitle(f"{result['config']['model']} ({result['config']['dtype']}), {result['machine']}")
    fig.tight_layout()
    from cepe.fileio import atomic_path

    with atomic_path(path, suffix=".png") as tmp:  # a stopped run leaves the previous plot or none
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
