"""What the match gates' sensor (``CepeConfig.match_gate``) costs next to the attention it watches.

Times, for one cross-attention layer of the default decoder's shape (9 query heads, 3 KV heads, head
dim 64) over one training micro-batch (4 examples, 128 decoder tokens, 8,192 context keys, one example
half padded), under bf16 autocast as training runs: the layer's own attention, building the sensor's
augmented keys, and the sensor's fused attention (``match_stats_sdpa``). Run it with nothing else on the
cores (docs/TRAINING.md, "The gates together, and heads that sharpen with the context's length").

Usage: python scripts/sensor_cost.py [--keys 8192] [--repeat 10]
Writes nothing.
"""

from __future__ import annotations

import argparse
import time

import torch

from cepe.cross_attention import MatchKeys, match_stats_sdpa
from cepe.layers import attention_sdpa


def timed(fn, repeat: int) -> float:
    """Median seconds of ``repeat`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=8192, help="context keys per example")
    ap.add_argument("--repeat", type=int, default=10, help="timed calls per measurement (median)")
    args = ap.parse_args(argv)
    b, h, kvh, t, s, hd = 4, 9, 3, 128, args.keys, 64
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, t, hd, generator=g).bfloat16()
    k = torch.randn(b, kvh, s, hd, generator=g).bfloat16()
    v = torch.randn(b, kvh, s, hd, generator=g).bfloat16()
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[1, s // 2 :] = False
    scale = hd**-0.5
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        keys = MatchKeys.build(k, mask)
        out = {
            "attention_ms": 1e3 * timed(lambda: attention_sdpa(q, k, v, mask, scale), args.repeat),
            "build_keys_ms": 1e3 * timed(lambda: MatchKeys.build(k, mask), args.repeat),
            "sensor_attention_ms": 1e3 * timed(lambda: match_stats_sdpa(q, keys, scale), args.repeat),
        }
    for name, ms in out.items():
        print(f"{name}: {ms:.1f}")
    return out


if __name__ == "__main__":
    main()
