"""How an adapter's context-length exponents and short-context gates came out.

Prints, for each adapter, each exponent set it has (``length_exp``: ``CepeConfig.length_scale``, and
``length_exp_above``: ``length_scale_above``) over all heads: the median, the median of the first
``--align-heads`` heads of every layer (the heads attention supervision trains, ``align_heads``) and of
the others, how many heads are above 0.05 and below -0.05, the extremes; and for short-context gates
(``short_gate``) the median bias, the mean |weight| of the token part and the medians of the match weights
(``docs/TRAINING.md``, "Each side of the pivot on its own").

Usage: python scripts/length_exp_stats.py ADAPTER [ADAPTER ...] [--align-heads 3]
Reads only the adapters' safetensors files; writes nothing.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch
from safetensors.torch import load_file


def per_layer(state: dict[str, torch.Tensor], suffix: str) -> torch.Tensor | None:
    """The tensors named ``...layers.{i}.cross_attn.<suffix>``, stacked in layer order, or None."""
    found = [
        (int(m.group(1)), v.float())
        for k, v in state.items()
        if (m := re.search(r"layers\.(\d+)\.", k)) and k.endswith("cross_attn." + suffix)
    ]
    return torch.stack([v for _, v in sorted(found, key=lambda x: x[0])]) if found else None


def median(t: torch.Tensor) -> float:
    """The median of ``t``'s values: the mean of the two middle ones for an even count (``Tensor.median``
    gives the lower of the two)."""
    return float(t.float().quantile(0.5))


def stats(adapter: str, align_heads: int = 3) -> dict[str, dict[str, float]]:
    path = Path(adapter) / "adapter_model.safetensors"
    if not path.is_file():
        raise SystemExit(f"no adapter_model.safetensors in {adapter}: pass an adapter directory")
    state = load_file(str(path))
    out: dict[str, dict[str, float]] = {}
    for name in ("length_exp", "length_exp_above"):
        t = per_layer(state, name)  # (layers, heads)
        if t is None:
            continue
        out[name] = {
            "heads": t.numel(),
            "median": median(t),
            "median_align_heads": median(t[:, :align_heads]),
            "median_other_heads": median(t[:, align_heads:]) if t.shape[1] > align_heads else float("nan"),
            "align_heads_above_0.05": int((t[:, :align_heads] > 0.05).sum()),
            "above_0.05": int((t > 0.05).sum()),
            "below_-0.05": int((t < -0.05).sum()),
            "max": t.max().item(),
            "min": t.min().item(),
        }
    bias, weight = per_layer(state, "short_gate.bias"), per_layer(state, "short_gate.weight")
    if bias is not None:
        out["short_gate"] = {
            "median_bias": median(bias),
            "mean_abs_weight": weight.abs().mean().item(),
        }
        match = per_layer(state, "short_match")
        if match is not None:
            out["short_gate"] |= {
                "median_a": median(match[..., 0]),
                "median_c": median(match[..., 1]),
            }
    if not out:
        raise SystemExit(f"{adapter} has no length exponents and no short-context gates")
    return out


def main(argv: list[str] | None = None) -> dict[str, dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("adapters", nargs="+", help="adapter directories")
    ap.add_argument("--align-heads", type=int, default=3, help="the first heads of each layer counted apart")
    a = ap.parse_args(argv)
    res = {}
    for adapter in a.adapters:
        res[adapter] = stats(adapter, a.align_heads)
        print(adapter)
        for part, vals in res[adapter].items():
            print(f"  {part}: " + ", ".join(f"{k} {v:.3g}" for k, v in vals.items()))
    return res


if __name__ == "__main__":
    main()
