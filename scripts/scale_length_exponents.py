"""A copy of an adapter with its context-length exponents (``CepeConfig.length_scale``, and
``length_scale_above``'s) times ``alpha``.

``alpha`` 0 gives the adapter the exponents were trained over (every factor exactly 1), 1 the trained one;
in between, each head's factor ``(n / length_scale)^(alpha·τ_h)`` is the geometric interpolation of the two.
Choose ``alpha`` on validation data (docs/TRAINING.md, "The gates together, and heads that sharpen with the
context's length").

Usage: python scripts/scale_length_exponents.py ADAPTER_DIR OUT_DIR --alpha 0.5 [--only below|above]
(``--only above``: just the exponents for contexts longer than the pivot, ``length_scale_above``'s;
``--only below``: just the others.)
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from cepe.fileio import atomic_path

NAMES = {"below": ("cross_attn.length_exp",), "above": ("cross_attn.length_exp_above",)}


def scale(adapter: str, out: str, alpha: float, only: str | None = None) -> Path:
    src, dst = Path(adapter), Path(out)
    weights = src / "adapter_model.safetensors"
    if not weights.is_file():
        raise SystemExit(f"no adapter_model.safetensors in {adapter}: pass an adapter directory")
    if not json.loads((src / "cepe_config.json").read_text()).get("length_scale"):
        raise SystemExit(f"{adapter} has no length exponents (length_scale is off)")
    if src.resolve() == dst.resolve():
        raise SystemExit("OUT_DIR must differ from ADAPTER_DIR")
    state = load_file(str(weights))
    names = NAMES[only] if only else NAMES["below"] + NAMES["above"]
    if not any(k.endswith(names) for k in state):
        raise SystemExit(f"{adapter} has no {only} length exponents")
    for k in state:
        if k.endswith(names):
            state[k] = (state[k].float() * alpha).to(state[k].dtype)
    return write_adapter(src, dst, state)


def write_adapter(src: Path, dst: Path, state: dict, config: dict | None = None) -> Path:
    """``dst``: ``src``'s files with ``state`` as its weights (and ``config`` as its cepe_config.json),
    each written atomically."""
    dst.mkdir(parents=True, exist_ok=True)
    new = ("adapter_model.safetensors",) + (("cepe_config.json",) if config is not None else ())
    for f in src.iterdir():
        if f.is_file() and f.name not in new:
            shutil.copy2(f, dst / f.name)
    if config is not None:
        with atomic_path(dst / "cepe_config.json") as tmp:
            tmp.write_text(json.dumps(config, indent=2) + "\n")
    with atomic_path(dst / "adapter_model.safetensors") as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    return dst


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("adapter", help="an adapter directory with length exponents")
    ap.add_argument("out", help="the new adapter directory")
    ap.add_argument("--alpha", type=float, required=True, help="multiplier on every exponent")
    ap.add_argument("--only", choices=sorted(NAMES), help="scale only the exponents below or above the pivot")
    a = ap.parse_args(argv)
    path = scale(a.adapter, a.out, a.alpha, a.only)
    print(f"wrote {path} (length exponents{f' ({a.only} the pivot)' if a.only else ''} x {a.alpha})")
    return path


if __name__ == "__main__":
    main()
