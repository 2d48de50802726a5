"""Cross-attention forward + backward at training shapes: the fused kernel against plain matmuls.

The route's recall stages spend about a third of a step in the CPU flash-attention kernel (the profile in
docs/TRAINING.md, "Where a recall step's time goes"). This times one cross-attention call, forward and
backward, as training runs it (B examples of T decoder queries over S encoder keys, GQA, bf16 or
``--dtype float32``, a key mask on the padded keys) through :func:`cepe.layers.attention_sdpa` (the fused kernel) and
:func:`cepe.layers.attention_ref` (scores and their gradient as plain batched matmuls, fp32 softmax), and
reports the best of ``--repeats`` timings and how far the gradients of the two agree.

    python scripts/attention_bench.py --keys 1024 2048 4096 8192 --out results/train_speed/attention
Run it with nothing else on the cores. Shapes (defaults): B 16, T 128, 9 query heads over 3 key/value heads
of 64 (the default decoder's), S as given; a quarter of the keys of every other example masked off.
"""

from __future__ import annotations

import time

import torch

from cepe.bench.kernels import random_inputs, report, shape_parser
from cepe.layers import attention_ref, attention_sdpa


def time_call(
    kernel, inputs: list[torch.Tensor], mask, scale: float, grad_out, repeats: int
) -> tuple[float, list]:
    """Best wall time of ``kernel(q, k, v, mask, scale)`` forward + backward over ``repeats`` runs after one
    warm-up, and the gradients of ``inputs`` (q, k, v)."""
    times = []
    for i in range(repeats + 1):
        for x in inputs:
            x.grad = None
        start = time.perf_counter()
        kernel(*inputs, mask, scale).backward(grad_out)
        if i:
            times.append(time.perf_counter() - start)
    return min(times), [x.grad.float() for x in inputs]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = shape_parser(__doc__.split("\n\n")[0], keys=[1024, 2048, 4096, 8192], batch=16, dtype_option=True)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for s in args.keys:
        b, h, kv, t, d = args.batch, args.heads, args.kv_heads, args.queries, args.head_dim
        q, k, v, mask, grad_out = random_inputs(b, h, kv, t, s, d, getattr(torch, args.dtype))
        scale = d**-0.5
        fused, g_fused = time_call(attention_sdpa, [q, k, v], mask, scale, grad_out, args.repeats)
        plain, g_plain = time_call(attention_ref, [q, k, v], mask, scale, grad_out, args.repeats)
        # fwd 2 products of 2·T·S·d per head; bwd 5 (scores recomputed, dV, dP, dQ, dK)
        flops = 2 * 7 * b * h * t * s * d
        diff = max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(g_fused, g_plain))
        rows.append(
            {
                "keys": s,
                "fused_s": round(fused, 4),
                "plain_s": round(plain, 4),
                "plain_over_fused": round(plain / fused, 2),
                "fused_gflops": round(flops / fused / 1e9, 1),
                "grad_max_rel_diff": float(f"{diff:.2g}"),
            }
        )
        print(rows[-1], flush=True)
    report(args, rows)
    return rows


if __name__ == "__main__":
    main()
