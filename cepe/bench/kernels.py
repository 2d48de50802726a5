"""What the attention micro-benchmarks share (``scripts/attention_bench.py``, ``scripts/run_bias_bench.py``):
their shape options (B examples of T decoder queries, H query heads over KV key/value heads of hd, S keys),
the record of the machine they ran on, and their report (``OUT.json`` + ``OUT.md``)."""

from __future__ import annotations

import argparse
import platform
from pathlib import Path
from typing import Any

import torch

from ..tables import write_rows


def shape_parser(
    description: str, keys: list[int], batch: int, dtype_option: bool = False
) -> argparse.ArgumentParser:
    """A parser with the shape options (defaults: the default decoder's 9 heads over 3 of 64, T 128), the
    repeats and ``--out``; with ``dtype_option`` also ``--dtype`` (bf16 as training on a CPU with bf16
    units, fp32 as it trains without them; without it the benchmark runs bf16)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--keys", type=int, nargs="+", default=keys, help="encoder keys S")
    ap.add_argument("--batch", type=int, default=batch, help="examples B")
    ap.add_argument("--queries", type=int, default=128, help="decoder tokens T")
    ap.add_argument("--heads", type=int, default=9, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=3, help="key/value heads")
    ap.add_argument("--head-dim", type=int, default=64)
    if dtype_option:
        ap.add_argument(
            "--dtype",
            choices=["bfloat16", "float32"],
            default="bfloat16",
            help="q, k, v and the output gradient's dtype (float32: what `bf16: auto` trains in on a CPU "
            "without bf16 units)",
        )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    return ap


def random_inputs(
    b: int, h: int, kv: int, t: int, s: int, d: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q`` (B, H, T, hd), ``k``, ``v`` (B, KV, S, hd) of ``dtype`` that require gradients, a key mask (B, S)
    with a quarter of the keys of every other example off (padding, as chunks of unequal lengths leave it),
    and a gradient for the output (B, H, T, hd), drawn from torch's global generator."""
    q = torch.randn(b, h, t, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, kv, s, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, kv, s, d, dtype=dtype, requires_grad=True)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[1::2, s - s // 4 :] = False
    return q, k, v, mask, torch.randn(b, h, t, d, dtype=dtype)


def report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Write the rows with the shape and machine (threads, torch, CPU) to ``args.out`` (if given)."""
    if args.out is None:
        return
    meta = {
        "shape": {
            "B": args.batch,
            "T": args.queries,
            "H": args.heads,
            "KV": args.kv_heads,
            "hd": args.head_dim,
        },
        "dtype": getattr(args, "dtype", "bfloat16"),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
    }
    write_rows(args.out, rows, meta)
    print(f"wrote {args.out}.json and .md")
