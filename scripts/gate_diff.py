"""How far did training move the per-head cross-attention gates between two checkpoints of one adapter?

Prints, for adapters A and B (``init_mode: gate``), the mean |gate| over all heads of each, the relative
change of that mean (negative: B's gates are more closed, every reading weaker at once) and the largest
change of any single gate (what ``optim.gate_lr`` bounds when the gates are held).

Usage: python scripts/gate_diff.py ADAPTER_A ADAPTER_B
Reads only the adapters' safetensors files; writes nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

from safetensors.torch import load_file


def gates(adapter: str) -> dict:
    path = Path(adapter) / "adapter_model.safetensors"
    if not path.is_file():
        raise SystemExit(f"no adapter_model.safetensors in {adapter}: pass an adapter directory")
    found = {k: v.float() for k, v in load_file(str(path)).items() if k.endswith("cross_attn.gate")}
    if not found:
        raise SystemExit(
            f"{adapter} has no per-head gates (cross_attn.gate): it was not trained with init_mode gate"
        )
    return found


def main(a: str, b: str) -> None:
    ga, gb = gates(a), gates(b)
    if ga.keys() != gb.keys():
        raise SystemExit(
            "the two adapters have gates in different layers: compare checkpoints of one run or route"
        )
    mean_a = sum(v.abs().sum().item() for v in ga.values()) / sum(v.numel() for v in ga.values())
    mean_b = sum(v.abs().sum().item() for v in gb.values()) / sum(v.numel() for v in gb.values())
    largest = max((ga[k] - gb[k]).abs().max().item() for k in ga)
    print(f"mean |gate|: A {mean_a:.4f}  B {mean_b:.4f}  change {100 * (mean_b / mean_a - 1):+.1f} %")
    print(f"largest change of one gate: {largest:.3g}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
