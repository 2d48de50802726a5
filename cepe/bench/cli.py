"""``cepe bench`` and ``cepe bench-store``: flags generated from :class:`~cepe.bench.config.BenchConfig` and
:class:`~cepe.bench.config.StoreBenchConfig` by :func:`cepe.configio.add_config_flags` (no torch import until
a command runs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from cepe.configio import add_config_flags
from cepe.configio import config_from_args as _load

from .config import BenchConfig, StoreBenchConfig


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A :class:`BenchConfig` from ``--config`` (JSON or YAML), ``--set`` and the flags given on the command
    line; unknown keys and wrong types are errors naming the key and the file. ``--max-tokens METHOD=N``
    (and a file's ``max_tokens``) add to the default limits rather than replacing them."""
    cfg = _load(BenchConfig, args, "bench config")
    cfg.max_tokens = {**BenchConfig().max_tokens, **cfg.max_tokens}
    cfg.validate()
    return cfg


def _cmd(args: argparse.Namespace) -> int:
    from .api import run_benchmark
    from .report import format_report

    cfg = config_from_args(args)
    result = run_benchmark(cfg, args.out, in_process=args.in_process)
    print()
    print(format_report(result))
    written = [str(f) for f in (Path(args.out) / "bench.json", Path(args.out) / "bench.png") if f.exists()]
    print(f"\nwrote {' and '.join(written)}")  # the plot is left out when it could not be drawn
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``cepe bench`` and ``cepe bench-store`` to the ``cepe`` command."""
    p = subparsers.add_parser(
        "bench",
        help="prefill throughput / peak memory / decode speed of CEPE vs full context, StreamingLLM, REPLUG",
        description="Benchmark prefill and decoding; every BenchConfig field is a flag (or a --config key).",
    )
    add_config_flags(
        p, BenchConfig, config_file="BenchConfig fields, JSON or YAML (e.g. configs/bench/default.json)"
    )
    p.add_argument("--out", default="bench_out", help="output directory for bench.json and bench.png")
    p.add_argument("--in-process", action="store_true", help="one process for all settings (smoke runs)")
    p.set_defaults(func=_cmd)
    register_store(subparsers)


def _cmd_store(args: argparse.Namespace) -> int:
    from .store_ttft import format_markdown, run_store_bench

    res = run_store_bench(_load(StoreBenchConfig, args, "bench-store config"), args.out)
    print(format_markdown(res))
    return 0


def register_store(sub: argparse._SubParsersAction) -> None:
    """Add ``bench-store`` to the ``cepe`` command."""
    p = sub.add_parser(
        "bench-store", help="time to first token: stored context vs re-encoding vs full prefill"
    )
    add_config_flags(p, StoreBenchConfig, config_file="StoreBenchConfig fields, JSON or YAML")
    p.add_argument(
        "--out",
        default="runs/bench-store",
        help="output directory for bench_store.json and bench_store.md (bench_store.partial.json while it runs)",
    )
    p.set_defaults(func=_cmd_store)
