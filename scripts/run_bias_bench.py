"""What run biases (``CepeConfig.run_bias``) add to one cross-attention layer's training step.

Times, at a route stage's shapes (B examples of T decoder queries over S encoder keys, GQA, bf16, a key
mask on padded keys), the forward twice (gradient checkpointing recomputes it) and the backward of:

- ``fused``: the fused kernel alone (:func:`cepe.layers.attention_sdpa`), a layer without the biases;
- ``run_kernel_lse``: :meth:`cepe.cross_attention.CrossAttention.attend_run` as it runs now, the
  logsumexp and its gradient from the fused kernel (:func:`cepe.layers.attention_sdpa_lse`,
  :class:`cepe.layers.FlashWithLse`);
- ``run_own_lse``: the same with the logsumexp computed by its own passes over the scores
  (:class:`cepe.cross_attention.KeysLogsumexp`: the implementation before, and the path on devices
  without the fused CPU kernel);

plus the read pass that finds each query's most-attended key (:func:`cepe.cross_attention.best_keys`,
once a step: it is kept across the recomputation). Reports the best of ``--repeats`` timings (after a
warm-up) and how far the two run-bias paths' outputs and gradients differ.

    python scripts/run_bias_bench.py --keys 2048 8192 --out results/train_speed/run_bias
Run it with nothing else on the cores. Shapes (defaults): B 4, T 128, 9 query heads over 3 key/value heads
of 64 (the default decoder's), S as given; a quarter of the keys of every other example masked off.
"""

from __future__ import annotations

import time
from unittest import mock

import torch

from cepe import cross_attention
from cepe.bench.kernels import random_inputs, report, shape_parser
from cepe.cross_attention import CrossAttention, best_keys, successor_keys
from cepe.layers import attention_sdpa


def _without_kernel_lse(q, k, v, key_mask, scale):
    return attention_sdpa(q, k, v, key_mask, scale), None


def time_step(fn, inputs: list[torch.Tensor], grad_out: torch.Tensor, repeats: int) -> tuple[float, list]:
    """Best wall time, over ``repeats`` runs after one warm-up, of ``fn()`` once without gradient (a
    checkpointed layer's forward), once more with it (the recomputation in backward) and the backward;
    the output and the gradients of ``inputs``."""
    times = []
    for i in range(repeats + 1):
        for x in inputs:
            x.grad = None
        start = time.perf_counter()
        with torch.no_grad():
            fn()
        out = fn()
        out.backward(grad_out)
        if i:
            times.append(time.perf_counter() - start)
    return min(times), [out.detach().float()] + [x.grad.float() for x in inputs]


def measure(layer: CrossAttention, b: int, t: int, s: int, repeats: int) -> dict:
    """One row: B examples of T queries over S keys through ``layer`` (its heads and head width)."""
    h, kv, d = layer.num_heads, layer.num_kv, layer.head_dim
    q, k, v, mask, grad_out = random_inputs(b, h, kv, t, s, d)
    read_times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        best, _ = best_keys(q.detach(), k.detach(), mask, layer.scale, need_lse=False)
        read_times.append(time.perf_counter() - start)
    read_s = min(read_times[1:])
    succ = successor_keys(best, None, mask, s)[1]
    inputs = [q, k, v]
    fused, _ = time_step(lambda: attention_sdpa(q, k, v, mask, layer.scale), inputs, grad_out, repeats)

    def run():
        return layer.attend_run(q, k, v, mask, succ, 0, "sdpa")

    kernel, got = time_step(run, inputs, grad_out, repeats)
    with mock.patch.object(cross_attention, "attention_sdpa_lse", _without_kernel_lse):
        own, want = time_step(run, inputs, grad_out, repeats)
    diff = max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(got, want))
    return {
        "keys": s,
        "fused_s": round(fused, 4),
        "run_own_lse_s": round(own, 4),
        "run_kernel_lse_s": round(kernel, 4),
        "read_pass_s": round(read_s, 4),
        "own_over_fused": round((own + read_s) / fused, 2),
        "kernel_over_fused": round((kernel + read_s) / fused, 2),
        "max_rel_diff": float(f"{diff:.2g}"),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = shape_parser(__doc__.split("\n\n")[0], keys=[2048, 8192], batch=4)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    b, h, kv, t, d = args.batch, args.heads, args.kv_heads, args.queries, args.head_dim
    layer = CrossAttention(h * d, h * d, h, kv, d, 1e-5, 0, run_bias=True)
    with torch.no_grad():
        layer.run_bias.copy_(torch.linspace(-2.0, 2.5, h))
    rows = []
    for s in args.keys:
        rows.append(measure(layer, b, t, s, args.repeats))
        print(rows[-1], flush=True)
    report(args, rows)
    return rows


if __name__ == "__main__":
    main()
