"""``cepe bench``: prefill throughput, peak memory and decode speed of CEPE against full context,
StreamingLLM and REPLUG on the same decoder, next to an analytical FLOP count.

Each setting runs in a fresh worker process (:mod:`cepe.bench.runner`) so its peak resident memory is its
own (see :mod:`cepe.bench.memory` for the method). The run also measures the machine's bf16 (or fp32)
matmul peak and reports, per setting, the fraction of it that the setting achieved (analytical FLOPs from
:mod:`cepe.bench.flops` over measured seconds). Results: ``bench.json``, ``bench.png`` and a printed report.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .flops import CostModel, DecoderShape
from .report import format_report, plot, summarize, write_json
from .runner import (
    DTYPES,
    PREFILL_METHODS,
    BenchConfig,
    build_model,
    cost_model,
    matmul_peak_flops,
    run_setting,
)

__all__ = ["BenchConfig", "CostModel", "DecoderShape", "register", "run_benchmark"]

RESULT_TAG = "CEPE_BENCH_RESULT "


def _machine() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{platform.machine()} cpu x{os.cpu_count()}, torch {torch.__version__} "
        f"threads {torch.get_num_threads()}, load {load:.2f}"
    )


def _run_worker(cfg: BenchConfig, setting: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "cepe.bench.runner", json.dumps(cfg.to_dict()), json.dumps(setting)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    return {**setting, "error": (proc.stderr or proc.stdout or f"exit {proc.returncode}")[-2000:]}


def run_benchmark(
    cfg: BenchConfig,
    out_dir: str | os.PathLike[str] | None = None,
    in_process: bool = False,
    peak_matmul_size: int = 4096,
    peak_seconds: float = 2.0,
    log=print,
) -> dict[str, Any]:
    """Measure every setting of ``cfg`` and summarise.

    Args:
        cfg: the run's configuration.
        out_dir: where ``bench.json`` and ``bench.png`` go (None: write nothing).
        in_process: measure in this process with one model (fast, for tests and smoke runs; peak memory
            then includes heap left over by earlier settings and is flagged as such).
        peak_matmul_size: side of the square matmul that measures the machine's peak.
        peak_seconds: how long the peak is measured (best of the repeated matmuls).
        log: progress printer.

    Returns:
        ``{"config", "machine", "matmul_peak_flops", "cost_model", "predicted_flops", "rows", "summary"}``.
    """
    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    requested, cfg = cfg.dtype, cfg.resolved()
    if requested != cfg.dtype:
        log(f"dtype auto -> {cfg.dtype} on this machine")
    machine_start = _machine()
    peak = matmul_peak_flops(peak_matmul_size, DTYPES[cfg.dtype], peak_seconds)
    log(f"{machine_start}; {cfg.dtype} matmul peak {peak / 1e9:.1f} GFLOP/s")
    model = build_model(cfg) if in_process else None
    if model is None:
        # Only the sizes are needed here; a worker builds the real model.
        meta_cfg = BenchConfig.from_dict({**cfg.to_dict(), "random_init": True, "compile": False})
        with torch.device("meta"):
            cm = cost_model(build_model(meta_cfg), cfg)
    else:
        cm = cost_model(model, cfg)
    rows: list[dict[str, Any]] = []
    for setting in cfg.settings():
        why = cfg.skipped(setting)
        name = setting["method"] + (f"/{setting['mode']}" if setting.get("mode") else "")
        size = setting.get("tokens") or setting.get("context")
        if why:
            rows.append(
                {**setting, "skipped": why, "flops": cm.prefill(setting["method"], setting["tokens"])}
            )
            log(f"  {setting['kind']} {name} {size}: skipped ({why})")
            continue
        t0 = time.perf_counter()
        if in_process:
            try:
                row = run_setting(cfg, setting, model)
            except Exception as err:  # report and carry on with the other settings
                row = {**setting, "error": f"{type(err).__name__}: {err}"}
        else:
            row = _run_worker(cfg, setting)
        if in_process and "memory_method" in row:
            row["memory_method"] += " (in-process: shares the heap of earlier settings)"
        rows.append(row)
        if "error" in row:
            log(f"  {setting['kind']} {name} {size}: ERROR {row['error'].splitlines()[-1]}")
        else:
            log(
                f"  {setting['kind']} {name} {size}: {row['tokens_per_s']:.2f} tok/s, "
                f"{100 * row['flops_per_s'] / peak:.1f}% of peak ({time.perf_counter() - t0:.1f} s wall)"
            )
    predicted = {str(t): {m: cm.prefill(m, t) for m in PREFILL_METHODS} for t in sorted({*cfg.lengths})}
    result: dict[str, Any] = {
        "config": cfg.to_dict(),
        "machine": machine_start,
        "machine_end": _machine(),
        "matmul_peak_flops": peak,
        "cost_model": {
            "decoder": cm.dec.to_dict(),
            "encoder": cm.enc.to_dict(),
            "cross_layers": cm.cross_layers,
            "full_kv_bytes_per_token": cm.dec.kv_bytes_per_token(2 if cfg.dtype == "bf16" else 4),
            "cepe_extra_memory_fraction": cm.cepe_extra_memory_fraction(),
            "counted": "matmul FLOPs only (2 per multiply-add); causal pairs only; see cepe.bench.flops",
        },
        "predicted_flops": predicted,
        "rows": rows,
    }
    for r in rows:
        if "flops_per_s" in r:
            r["fraction_of_peak"] = r["flops_per_s"] / peak
    result["summary"] = summarize(result)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        write_json(result, out / "bench.json")
        plot(result, out / "bench.png")
    return result


# ---------------------------------------------------------------------------------------------- CLI
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
    """A :class:`BenchConfig` from ``--config`` (JSON) overridden by the flags given on the command line."""
    data: dict[str, Any] = {}
    if args.config:
        with open(args.config) as f:
            data = json.load(f)
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
        cfg = BenchConfig.from_dict(data)
    except TypeError as err:
        raise ValueError(f"bad bench config: {err}") from err
    cfg.validate()
    return cfg


def _cmd(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    result = run_benchmark(cfg, args.out, in_process=args.in_process)
    print()
    print(format_report(result))
    print(f"\nwrote {Path(args.out) / 'bench.json'} and {Path(args.out) / 'bench.png'}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``cepe bench`` to the ``cepe`` command."""
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
    p.add_argument("--dtype", choices=[*sorted(DTYPES), "auto"], help="auto: bf16 where it is fast here")
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
