"""A copy of an adapter whose match gates (``CepeConfig.match_gate``) read less by default and more where
the context matches: every head's bias row gains ``--bias`` and both match weights gain ``--gain``.

Head h's gate is ``2·σ(a_h·m̃ + c_h·κ̃ + b_h)`` over its standardised match statistics (m̃: how far its best
scores stand out, κ̃: how concentrated its attention is), so a negative ``--bias`` lowers the strength of
tokens that match nothing (``2·σ(-2)`` ≈ 0.24 where the logit was 0) and a positive ``--gain`` gives it back,
and more, to tokens whose statistics lie above the head's mean. ``--bias 0 --gain 0`` is the adapter itself.
Choose the pair on validation data (docs/TRAINING.md, "Gates for long contexts, and twice the short copies").

Usage: python scripts/shift_match_gates.py ADAPTER_DIR OUT_DIR --bias -2 --gain 1
"""

from __future__ import annotations

import argparse
from pathlib import Path

from safetensors.torch import load_file
from scale_length_exponents import write_adapter  # scripts/ is on the path when this file is run

KEY = "cross_attn.match_gate"


def shift(adapter: str, out: str, bias: float, gain: float) -> Path:
    src, dst = Path(adapter), Path(out)
    weights = src / "adapter_model.safetensors"
    if not weights.is_file():
        raise SystemExit(f"no adapter_model.safetensors in {adapter}: pass an adapter directory")
    if src.resolve() == dst.resolve():
        raise SystemExit("OUT_DIR must differ from ADAPTER_DIR")
    state = load_file(str(weights))
    keys = [k for k in state if k.endswith(KEY)]
    if not keys:
        raise SystemExit(f"{adapter} has no match gates (match_gate is off)")
    for k in keys:
        w = state[k].float().clone()  # (H, 3): rows (a, c, b)
        w[:, :2] += gain
        w[:, 2] += bias
        state[k] = w.to(state[k].dtype)
    return write_adapter(src, dst, state)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("adapter", help="an adapter with match gates")
    ap.add_argument("out", help="the new adapter directory")
    ap.add_argument("--bias", type=float, required=True, help="added to every head's gate bias")
    ap.add_argument("--gain", type=float, required=True, help="added to every head's two match weights")
    a = ap.parse_args(argv)
    path = shift(a.adapter, a.out, a.bias, a.gain)
    print(f"wrote {path} ({a.adapter} with match-gate bias {a.bias:+g} and gain {a.gain:+g})")
    return path


if __name__ == "__main__":
    main()
