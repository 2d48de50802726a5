"""A copy of an adapter with its context-length exponents (``CepeConfig.length_scale``, and
``length_scale_above``'s) times ``alpha``.

``alpha`` 0 gives the adapter the exponents were trained over (every factor exactly 1), 1 the trained one;
in between, each head's factor ``(n / length_scale)^(alpha·τ_h)`` is the geometric interpolation of the two.
Choose ``alpha`` on validation data (docs/TRAINING.md, "The gates together, and heads that sharpen with the
context's length").

Usage: python scripts/scale_length_exponents.py ADAPTER_DIR OUT_DIR --alpha 0.5
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from cepe.fileio import atomic_path


def scale(adapter: str, out: str, alpha: float) -> Path:
    src, dst = Path(adapter), Path(out)
    weights = src / "adapter_model.safetensors"
    if not weights.is_file():
        raise SystemExit(f"no adapter_model.safetensors in {adapter}: pass an adapter directory")
    if not json.loads((src / "cepe_config.json").read_text()).get("length_scale"):
        raise SystemExit(f"{adapter} has no length exponents (length_scale is off)")
    if src.resolve() == dst.resolve():
        raise SystemExit("OUT_DIR must differ from ADAPTER_DIR")
    state = load_file(str(weights))
    for k in state:
        if k.endswith(("cross_attn.length_exp", "cross_attn.length_exp_above")):
            state[k] = (state[k].float() * alpha).to(state[k].dtype)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != weights.name and f.is_file():
            shutil.copy2(f, dst / f.name)
    with atomic_path(dst / weights.name) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    return dst


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("adapter", help="an adapter directory with length exponents")
    ap.add_argument("out", help="the new adapter directory")
    ap.add_argument("--alpha", type=float, required=True, help="multiplier on every exponent")
    a = ap.parse_args(argv)
    path = scale(a.adapter, a.out, a.alpha)
    print(f"wrote {path} (length exponents x {a.alpha})")
    return path


if __name__ == "__main__":
    main()
