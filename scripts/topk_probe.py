"""Cross-attention over each query's top-k keys only, at inference: does a sharper read help long contexts?

A probe, not a model option: it runs any ``cepe eval ...`` command line with every cross-attention layer's
softmax restricted to the ``--topk`` largest scores of each query and head (the null key and the run
biases included, as the adapter computes its scores; k-nearest-neighbour attention),
through the plain reference kernel. The adapter's weights are untouched; the self-attention and the
encoder's own attention are unchanged.

Usage: python scripts/topk_probe.py --topk 64 eval needle --model ADAPTER --config configs/eval/needle_val4.yaml \
           --methods cepe --autocast auto --out OUT
Pause a training run on the same cores first (the reference kernel is slower than the fused one).
"""

from __future__ import annotations

import argparse
import sys

import torch

import cepe.cross_attention as ca
from cepe.cli import main as cepe_main
from cepe.layers import attention_ref, repeat_kv


def topk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
    bias: torch.Tensor | None = None,
    *,
    topk: int,
) -> torch.Tensor:
    """:func:`cepe.layers.attention_ref` with each row's softmax over its ``topk`` largest scores only.

    q ``(N, H, T, hd)``; k, v ``(N, KV, S, hd)``; key_mask ``(N, S)`` or None; bias ``(N, H, T, S)`` or None.
    The scores are the reference's (with ``bias``, masked keys out); every key below a row's k-th score
    gets ``-inf`` added to its bias (ties at the k-th keep every tied key). Returns ``(N, H, T, hd)``.
    """
    if k.shape[2] <= topk:
        return attention_ref(q, k, v, key_mask, scale, bias)
    kr = repeat_kv(k, q.shape[1] // k.shape[1])
    scores = (torch.matmul(q, kr.transpose(-1, -2)) * scale).float()
    if bias is not None:
        scores = scores + bias
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    kth = torch.topk(scores, topk, dim=-1).values[..., -1:]
    cut = torch.zeros_like(scores).masked_fill(scores < kth, float("-inf"))
    return attention_ref(q, k, v, key_mask, scale, cut if bias is None else bias + cut)


def install(topk: int) -> None:
    """Route every cross-attention read through :func:`topk_attention` (this process only)."""
    if topk < 1:
        raise SystemExit(f"error: --topk must be at least 1, got {topk}")

    def kernel(q, k, v, key_mask, scale, bias=None):
        return topk_attention(q, k, v, key_mask, scale, bias, topk=topk)

    # the cross-attention module's lookups; the encoder keeps its own
    ca.ATTENTION_KERNELS = {"eager": kernel, "sdpa": kernel}
    run = ca.CrossAttention.attend_run

    def attend_run(self, q, k, v, key_mask, succ, offset, impl):  # the run biases' reference path
        return run(self, q, k, v, key_mask, succ, offset, "eager")

    ca.CrossAttention.attend_run = attend_run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topk", type=int, required=True, help="keys each query's softmax keeps")
    a, rest = ap.parse_known_args()
    install(a.topk)
    return cepe_main(rest)


if __name__ == "__main__":
    sys.exit(main())
