"""``run_benchmark``: every setting of a :class:`BenchConfig`, each in a fresh worker process (see
:mod:`cepe.bench`)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from cepe.dtypes import torch_dtype

from .config import PREFILL_METHODS, BenchConfig
from .flops import CostModel
from .report import PartialRows, plot, summarize, write_json
from .runner import RESULT_TAG, build_model, cost_model, matmul_peak_flops, run_setting

# the rows measured so far, rewritten after each setting and removed once bench.json is written (see
# report.PartialRows): a record, not a resume point
PARTIAL = "bench.partial.json"


def _machine() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{platform.machine()} cpu x{os.cpu_count()}, torch {torch.__version__} "
        f"threads {torch.get_num_threads()}, load {load:.2f}"
    )


def run_worker(cfg: BenchConfig, setting: dict[str, Any]) -> dict[str, Any]:
    """Measure ``setting`` in a fresh ``python -m cepe.bench.runner`` process; its result row."""
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
        out_dir: where ``bench.json`` and ``bench.png`` go (None: write nothing); while the run goes on,
            ``bench.partial.json`` holds the rows measured so far.
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
    peak = matmul_peak_flops(peak_matmul_size, torch_dtype(cfg.dtype), peak_seconds)
    log(f"{machine_start}; {cfg.dtype} matmul peak {peak / 1e9:.1f} GFLOP/s")
    model = build_model(cfg) if in_process else None
    cm = _cost_model(cfg, model)
    out = Path(out_dir) if out_dir is not None else None
    # a run stopped part-way keeps the rows it measured (not a resume point)
    partial = PartialRows(
        out / PARTIAL if out is not None else None, config=cfg.to_dict(), machine=machine_start
    )
    rows = partial.rows
    for setting in cfg.settings():
        partial.append(_measure(cfg, setting, cm, model, peak, log))
    predicted = {str(t): {m: cm.prefill(m, t) for m in PREFILL_METHODS} for t in sorted({*cfg.lengths})}
    result: dict[str, Any] = {
        "config": cfg.to_dict(),
        "machine": machine_start,
        "machine_end": _machine(),
        "matmul_peak_flops": peak,
        "cost_model": _cost_model_record(cm, cfg),
        "predicted_flops": predicted,
        "rows": rows,
    }
    for r in rows:
        if "flops_per_s" in r:
            r["fraction_of_peak"] = r["flops_per_s"] / peak
    result["summary"] = summarize(result)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        try:
            plot(result, out / "bench.png")
        except Exception as err:  # noqa: BLE001 - matplotlib missing, a full disk: the numbers are kept
            (out / "bench.png").unlink(missing_ok=True)  # not an earlier run's plot beside these numbers
            log(f"bench.png not written: {type(err).__name__}: {err}")
        write_json(result, out / "bench.json")  # last: the run's record, whatever became of its plot
        partial.done()
    return result


def _cost_model(cfg: BenchConfig, model: Any) -> CostModel:
    """The cost model of the run's shapes: from ``model`` (in-process), else from a model built on the meta
    device (only the sizes are needed here; a worker builds the real model)."""
    if model is not None:
        return cost_model(model, cfg)
    meta_cfg = BenchConfig.from_dict({**cfg.to_dict(), "random_init": True, "compile": False})
    with torch.device("meta"):
        return cost_model(build_model(meta_cfg), cfg)


def _measure(
    cfg: BenchConfig, setting: dict[str, Any], cm: CostModel, model: Any, peak: float, log
) -> dict[str, Any]:
    """One setting's row: skipped (with why), measured in a worker process or, with ``model``, in this
    process (an error is reported in the row and the run goes on)."""
    name = setting["method"] + (f"/{setting['mode']}" if setting.get("mode") else "")
    size = setting.get("tokens") or setting.get("context")
    why = cfg.skipped(setting)
    if why:
        log(f"  {setting['kind']} {name} {size}: skipped ({why})")
        return {**setting, "skipped": why, "flops": cm.prefill(setting["method"], setting["tokens"])}
    t0 = time.perf_counter()
    if model is None:
        row = run_worker(cfg, setting)
    else:
        try:
            row = run_setting(cfg, setting, model)
        except Exception as err:  # report and carry on with the other settings
            row = {**setting, "error": f"{type(err).__name__}: {err}"}
        if "memory_method" in row:
            row["memory_method"] += " (in-process: shares the heap of earlier settings)"
    if "error" in row:
        log(f"  {setting['kind']} {name} {size}: ERROR {row['error'].splitlines()[-1]}")
    else:
        log(
            f"  {setting['kind']} {name} {size}: {row['tokens_per_s']:.2f} tok/s, "
            f"{100 * row['flops_per_s'] / peak:.1f}% of peak ({time.perf_counter() - t0:.1f} s wall)"
        )
    return row


def _cost_model_record(cm: CostModel, cfg: BenchConfig) -> dict[str, Any]:
    """The cost model as saved in ``bench.json``."""
    return {
        "decoder": cm.dec.to_dict(),
        "encoder": cm.enc.to_dict(),
        "cross_layers": cm.cross_layers,
        "full_kv_bytes_per_token": cm.dec.kv_bytes_per_token(2 if cfg.dtype == "bf16" else 4),
        "cepe_extra_memory_fraction": cm.cepe_extra_memory_fraction(),
        "counted": "matmul FLOPs only (2 per multiply-add); causal pairs only; see cepe.bench.flops",
    }
