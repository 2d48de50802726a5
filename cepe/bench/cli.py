"""``cepe bench`` and ``cepe bench-store``: flags over :class:`~cepe.bench.config.BenchConfig` and
:class:`~cepe.bench.config.StoreBenchConfig` (no torch import until a command runs)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .config import DTYPE_NAMES, PREFILL_METHODS, BenchConfig, StoreBenchConfig


def _max_tokens(items: list[str] | None) -> dict[str, int]:
    out = {}
    for item in items or []:
        name, _, value = item.partition("=")
        if name not in PREFILL_METHODS or not value.isdigit():
            raise ValueError(f"--max-tokens takes METHOD=N with METHOD in {PREFILL_METHODS}, got {item!r}")
        out[name] = int(value)
    return out


_FLAGS = {
    "model": "model",
    "dtype": "dtype",
    "lengths": "lengths",
    "methods": "methods",
    "window": "window",
    "chunk": "chunk",
    "encoder_hidden": "encoder_hidden",
    "encoder_layers": "encoder_layers",
    "encoder_heads": "encoder_heads",
    "micro_batch": "micro_batch",
    "full_chunk": "full_chunk",
    "replug_piece": "replug_piece",
    "decode_context": "decode_context",
    "decode_tokens": "decode_tokens",
    "decode_modes": "decode_modes",
    "decode_fill": "decode_fill",
    "decode_cache": "decode_cache",
    "repeats": "repeats",
    "threads": "threads",
    "seed": "seed",
}


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A :class:`BenchConfig` from ``--config`` (JSON or YAML) overridden by the flags given on the command
    line; unknown keys and wrong types are errors naming the key and the file."""
    from cepe.configio import build, read_config_file

    data: dict[str, Any] = read_config_file(args.config) if args.config else {}
    for flag, key in _FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            data[key] = value
    if args.random_init:
        data["random_init"] = True
    if args.compile:
        data["compile"] = True
    limits = {**BenchConfig().max_tokens, **data.get("max_tokens", {}), **_max_tokens(args.max_tokens)}
    data["max_tokens"] = limits
    try:
        cfg = build(BenchConfig, data, "bench config")
    except ValueError as err:
        raise ValueError(f"{args.config}: {err}" if args.config else str(err)) from err
    cfg.validate()
    return cfg


def _cmd(args: argparse.Namespace) -> int:
    from .api import run_benchmark
    from .report import format_report

    cfg = config_from_args(args)
    result = run_benchmark(cfg, args.out, in_process=args.in_process)
    print()
    print(format_report(result))
    print(f"\nwrote {Path(args.out) / 'bench.json'} and {Path(args.out) / 'bench.png'}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``cepe bench`` and ``cepe bench-store`` to the ``cepe`` command."""
    p = subparsers.add_parser(
        "bench",
        help="prefill throughput / peak memory / decode speed of CEPE vs full context, StreamingLLM, REPLUG",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="JSON file of BenchConfig fields (e.g. configs/bench/default.json)")
    p.add_argument("--out", default="bench_out", help="output directory for bench.json and bench.png")
    p.add_argument("--model", help="decoder: default, tiny, a local directory or a hub id")
    p.add_argument("--random-init", action="store_true", help="random decoder weights (timing only)")
    p.add_argument("--dtype", choices=[*sorted(DTYPE_NAMES), "auto"], help="auto: bf16 where it is fast here")
    p.add_argument("--lengths", type=int, nargs="+", help="total tokens per prefill setting")
    p.add_argument("--methods", nargs="+", choices=PREFILL_METHODS)
    p.add_argument("--window", type=int, help="decoder tokens (CEPE input, StreamingLLM cache, REPLUG pass)")
    p.add_argument("--chunk", type=int, help="encoder chunk length")
    p.add_argument("--encoder-hidden", type=int)
    p.add_argument("--encoder-layers", type=int)
    p.add_argument("--encoder-heads", type=int)
    p.add_argument("--micro-batch", type=int, help="encoder chunks per encoder call")
    p.add_argument("--full-chunk", type=int, help="tokens per call of the chunked full-context prefill")
    p.add_argument("--replug-piece", type=int, help="context tokens per REPLUG pass")
    p.add_argument(
        "--max-tokens",
        action="append",
        metavar="METHOD=N",
        help="longest length run for METHOD (default full=32768, replug=32768); e.g. full=131072 opts in",
    )
    p.add_argument("--decode-context", type=int, help="context tokens before decoding (0: no decode runs)")
    p.add_argument("--decode-tokens", type=int, help="timed decode steps per setting")
    p.add_argument("--decode-modes", nargs="+", choices=("kv", "states", "absorbed"))
    p.add_argument("--decode-fill", choices=("random", "prefill"), help="how decode caches are filled")
    p.add_argument(
        "--decode-cache",
        choices=("static", "dynamic"),
        help="decoder K/V cache while decoding: preallocated (static, default) or grown by concatenation",
    )
    p.add_argument("--repeats", type=int, help="timed prefills per setting (best reported)")
    p.add_argument("--threads", type=int, help="torch threads (0: default)")
    p.add_argument("--seed", type=int)
    p.add_argument("--compile", action="store_true", help="torch.compile encoder layers and cross-attention")
    p.add_argument("--in-process", action="store_true", help="one process for all settings (smoke runs)")
    p.set_defaults(func=_cmd)
    register_store(subparsers)


def _cmd_store(args: argparse.Namespace) -> int:
    cfg = StoreBenchConfig(
        model=args.model,
        lengths=args.lengths,
        full_max_tokens=args.full_max_tokens,
        dtype=args.dtype,
        store_dtype=args.store_dtype,
        cache=args.cache,
        threads=args.threads,
    )
    from .store_ttft import format_markdown, run_store_bench

    res = run_store_bench(cfg, args.out)
    print(format_markdown(res))
    return 0


def register_store(sub: argparse._SubParsersAction) -> None:
    """Add ``bench-store`` to the ``cepe`` command."""
    d = StoreBenchConfig()
    p = sub.add_parser(
        "bench-store", help="time to first token: stored context vs re-encoding vs full prefill"
    )
    p.add_argument("--model", default=d.model)
    p.add_argument("--lengths", type=int, nargs="+", default=d.lengths)
    p.add_argument("--full-max-tokens", type=int, default=d.full_max_tokens)
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPE_NAMES),
        default=d.dtype,
        help="model dtype for all three paths (bf16: much faster full prefill on CPUs with bf16 units)",
    )
    p.add_argument("--store-dtype", choices=["bf16", "fp32", "fp16"], default=d.store_dtype)
    p.add_argument("--cache", choices=["kv", "states", "absorbed"], default=d.cache)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--out", default="runs/bench-store")
    p.set_defaults(func=_cmd_store)
