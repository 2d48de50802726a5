"""An adapter with another adapter's weights for contexts longer than the pivot (its exponents,
``CepeConfig.length_scale_above``, and its gates, ``CepeConfig.long_gate``) grafted on.

Both adapters must have capped exponents (``length_scale_below``) at the same pivot. Then a context of at most
``length_scale`` tokens reads exactly as BASE reads it, and a longer one as BASE with DONOR's exponents
and long gates: where BASE and DONOR share every weight that acts on long contexts (their other
differences act only below the pivot: capped exponents, ``short_gate``), that is exactly DONOR there.

Usage: python scripts/graft_length_exponents.py BASE_DIR DONOR_DIR OUT_DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from safetensors.torch import load_file
from scale_length_exponents import write_adapter  # scripts/ is on the path when this file is run


def above_pivot(key: str) -> bool:
    """Whether an adapter weight acts only on contexts longer than the pivot."""
    return (
        key.endswith(("cross_attn.length_exp_above", "cross_attn.long_match"))
        or ".cross_attn.long_gate." in key
    )


def graft(base: str, donor: str, out: str) -> Path:
    src, don, dst = Path(base), Path(donor), Path(out)
    for d in (src, don):
        if not (d / "adapter_model.safetensors").is_file():
            raise SystemExit(f"no adapter_model.safetensors in {d}: pass adapter directories")
    if dst.resolve() in (src.resolve(), don.resolve()):
        raise SystemExit("OUT_DIR must differ from BASE_DIR and DONOR_DIR")
    cfg_b = json.loads((src / "cepe_config.json").read_text())
    cfg_d = json.loads((don / "cepe_config.json").read_text())
    if not (cfg_d.get("length_scale_above") or cfg_d.get("long_gate")):
        raise SystemExit(f"{donor} has no weights above its pivot (length_scale_above and long_gate are off)")
    for c, name in ((cfg_b, base), (cfg_d, donor)):
        if not c.get("length_scale") or not c.get("length_scale_below"):
            raise SystemExit(f"{name} needs capped length exponents (length_scale with length_scale_below)")
    if cfg_b["length_scale"] != cfg_d["length_scale"]:
        raise SystemExit(f"the pivots differ: {cfg_b['length_scale']} (base) against {cfg_d['length_scale']}")
    state = load_file(str(src / "adapter_model.safetensors"))
    grafted = {k: v for k, v in load_file(str(don / "adapter_model.safetensors")).items() if above_pivot(k)}
    state = {k: v for k, v in state.items() if not above_pivot(k)} | grafted
    for flag in ("length_scale_above", "long_gate"):
        cfg_b[flag] = bool(cfg_d.get(flag))
    return write_adapter(src, dst, state, cfg_b)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", help="the adapter to graft onto (capped length exponents)")
    ap.add_argument("donor", help="the adapter whose exponents and gates above the pivot are taken")
    ap.add_argument("out", help="the new adapter directory")
    a = ap.parse_args(argv)
    path = graft(a.base, a.donor, a.out)
    print(f"wrote {path} ({a.base} with the weights above the pivot of {a.donor})")
    return path


if __name__ == "__main__":
    main()
