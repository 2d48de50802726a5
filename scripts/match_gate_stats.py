"""Do an adapter's match gates act token by token, or as one more strength per head?

Prints, for each adapter with match gates (``CepeConfig.match_gate``), the correlations over all heads of
the three gate weights (a on m, c on κ̂, b the bias), the share of heads whose three weights have one
sign, and the largest |weight|. From zero, weights that move together (correlations near 1, most heads of
one sign) mean the features carried no more than a per-head bias (``docs/TRAINING.md``, "Gates that see
the match").

Usage: python scripts/match_gate_stats.py ADAPTER [ADAPTER ...]
Reads only the adapters' safetensors files; writes nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file


def weights(adapter: str) -> torch.Tensor:
    """Every head's ``(a, c, b)``: ``(layers · heads, 3)``."""
    path = Path(adapter) / "adapter_model.safetensors"
    if not path.is_file():
        raise SystemExit(f"no adapter_model.safetensors in {adapter}: pass an adapter directory")
    found = [
        v.float() for k, v in sorted(load_file(str(path)).items()) if k.endswith("cross_attn.match_gate")
    ]
    if not found:
        raise SystemExit(f"{adapter} has no match gates (cross_attn.match_gate): train it with match_gate")
    return torch.cat(found).reshape(-1, 3)


def stats(w: torch.Tensor) -> dict[str, float]:
    c = torch.corrcoef(w.T)
    same = ((w[:, 0].sign() == w[:, 2].sign()) & (w[:, 1].sign() == w[:, 2].sign())).float().mean()
    return {
        "corr_a_b": c[0, 2].item(),
        "corr_c_b": c[1, 2].item(),
        "corr_a_c": c[0, 1].item(),
        "one_sign": same.item(),
        "max_abs": w.abs().max().item(),
    }


def main(adapters: list[str]) -> None:
    for a in adapters:
        s = stats(weights(a))
        print(
            f"{a}: corr (a, b) {s['corr_a_b']:.2f}  (c, b) {s['corr_c_b']:.2f}  (a, c) {s['corr_a_c']:.2f}  "
            f"one sign {100 * s['one_sign']:.0f} %  max |w| {s['max_abs']:.2f}"
        )


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(sys.argv[1:])
