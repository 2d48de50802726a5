"""The benchmark harness: cost model numbers, memory accounting, and an end-to-end run on a tiny model.

No wall-clock time is asserted anywhere.
"""

from __future__ import annotations

import argparse
import functools
import json

import pytest
import torch

from cepe.bench import BenchConfig, run_benchmark
from cepe.bench.cli import config_from_args, register
from cepe.bench.flops import CostModel, DecoderShape, causal_pairs, decoder_flops, encoder_flops
from cepe.bench.runner import (
    _new_cache,
    build_model,
    cepe_prefill,
    cost_model,
    full_prefill,
    random_ids,
)
from cepe.measure import PeakRSS, tensor_bytes

# SmolLM2-135M (the default decoder) and the 4-layer, 256-wide encoder.
SMOL = DecoderShape(layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152)
ENC = DecoderShape(layers=4, hidden=256, heads=4, kv_heads=4, head_dim=64, intermediate=1024, vocab=49153)


def tiny_cfg(**kw) -> BenchConfig:
    base = dict(
        model="tiny",
        encoder_hidden=32,
        encoder_layers=2,
        encoder_heads=2,
        chunk=16,
        window=64,
        full_chunk=48,
        replug_piece=32,
        lengths=[96, 160],
        decode_context=160,
        decode_tokens=2,
        dtype="fp32",
    )
    base.update(kw)
    return BenchConfig(**base)


def test_causal_pairs_and_decoder_flops_by_hand():
    assert causal_pairs(0, 4) == 10
    assert causal_pairs(3, 2) == 2 * 3 + 3
    shape = DecoderShape(layers=1, hidden=4, heads=2, kv_heads=1, head_dim=2, intermediate=8, vocab=10)
    # per token: q 4*4 + k,v 2*4*2 + o 4*4 + mlp 3*4*8 = 144 weights
    assert shape.linear_params_per_layer == 144
    assert decoder_flops(shape, 0, 3, logits=1) == 2 * 3 * 144 + 4 * 6 * 2 * 2 + 2 * 4 * 10
    assert encoder_flops(shape, 5, 2) == 2 * 5 * 144 + 4 * (2 * 4 + 1) * 2 * 2


def test_cost_model_ratios_for_the_default_decoder():
    cm = CostModel(SMOL, ENC, cross_layers=30, window=2048, chunk=256)
    ratios = {t: cm.full_prefill(t) / cm.cepe_prefill(t) for t in (8192, 32768, 131072)}
    assert ratios[8192] == pytest.approx(2.5, abs=0.1)
    assert ratios[32768] == pytest.approx(8.0, abs=0.2)
    assert ratios[131072] == pytest.approx(29.7, abs=0.5)
    assert cm.cepe_extra_memory_fraction() == pytest.approx(1 / 45)
    assert SMOL.kv_bytes_per_token() == 23040
    # Φ (256 bf16 values) per encoder token plus the decoder window's K/V.
    assert cm.cache_bytes("cepe", 10000) == 2048 * 23040 + (10000 - 2048) * 512
    assert cm.cache_bytes("full", 10000) == 10000 * 23040
    # states re-projects K/V of every encoder token at each step: far more work than kv or absorbed.
    kv, states = cm.decode_step("cepe", 32768, "kv"), cm.decode_step("cepe", 32768, "states")
    assert states > 50 * kv
    with pytest.raises(ValueError, match="no cost model"):
        cm.prefill("bogus", 10)


def test_tensor_bytes_counts_shared_storage_once():
    a = torch.zeros(10, dtype=torch.float32)
    assert tensor_bytes({"x": a, "y": [a, a[2:]]}) == 40
    assert tensor_bytes(None) == 0


def test_peak_rss_region():
    mib = 2**20
    with PeakRSS() as mem:
        x = torch.ones(2**22)  # 16 MiB, touched, kept past the region
        x += 1
    assert mem.method.startswith("VmHWM")
    assert mem.baseline > 0 and mem.peak_delta >= 15 * mib and mem.kept_delta >= 15 * mib
    with PeakRSS() as temp:
        y = torch.ones(2**23)  # 32 MiB, touched, freed inside the region
        y += 1
        del y
    if temp.method == "VmHWM reset per region":  # the peak of this region alone, not of the process
        assert temp.peak_delta >= 30 * mib
    assert temp.kept_delta < 8 * mib  # what the region freed is not counted as kept
    del x


def test_kept_bytes_match_the_cost_model():
    cfg = tiny_cfg()
    model = build_model(cfg)
    cm = cost_model(model, cfg)
    ids = random_ids(160, 259, 0)
    with torch.inference_mode():
        cepe = cepe_prefill(model, ids, cfg.window)
        full = full_prefill(model, ids, cfg.full_chunk)
    assert tensor_bytes(cepe["cache"], cepe["context"]) == cm.cache_bytes("cepe", 160, bytes_per_elem=4)
    assert tensor_bytes(full["cache"]) == cm.cache_bytes("full", 160, bytes_per_elem=4)
    # Chunked full prefill leaves the same cache and last logits as one call.
    with torch.inference_mode():
        one = full_prefill(model, ids, 160)
    torch.testing.assert_close(full["logits"], one["logits"], rtol=1e-4, atol=1e-4)


def test_end_to_end_in_process(tmp_path):
    cfg = tiny_cfg(max_tokens={"replug": 96})
    result = run_benchmark(
        cfg, tmp_path, in_process=True, peak_matmul_size=128, peak_seconds=0.05, log=lambda s: None
    )
    data = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.png").stat().st_size > 1000
    assert data["summary"] == json.loads(json.dumps(result["summary"]))
    prefill = [r for r in data["rows"] if r["kind"] == "prefill"]
    assert len(prefill) == 8
    skipped = [r for r in prefill if r.get("skipped")]
    assert [(r["method"], r["tokens"]) for r in skipped] == [("replug", 160)]
    for r in prefill:
        assert "error" not in r, r.get("error")
        if not r.get("skipped"):
            assert r["tokens_per_s"] > 0 and r["flops"] > 0 and 0 < r["fraction_of_peak"]
    decode = [r for r in data["rows"] if r["kind"] == "decode"]
    assert [(r["method"], r["mode"]) for r in decode] == [
        ("cepe", "kv"),
        ("cepe", "states"),
        ("cepe", "absorbed"),
        ("full", None),
    ]
    assert all(r["tokens"] == 2 for r in decode)
    names = {t["target"].split(":")[0] for t in data["summary"]["targets"]}
    assert "decode" in names


@pytest.mark.multiproc
def test_worker_subprocess_runs_one_setting(tmp_path):
    from cepe.bench.api import run_worker

    row = run_worker(tiny_cfg(), {"kind": "prefill", "method": "cepe", "tokens": 96})
    assert "error" not in row, row.get("error")
    assert row["peak_delta_bytes"] == max(0, row["peak_rss_bytes"] - row["rss_baseline_bytes"])
    cfg = tiny_cfg()
    cm = cost_model(build_model(cfg), cfg)
    assert row["kept_tensor_bytes"] == cm.cache_bytes("cepe", 96, bytes_per_elem=4)  # what it keeps
    assert row["kept_bytes_model"] == row["kept_tensor_bytes"]  # the model at fp32's 4 bytes, not 2


def test_cli_config_parsing(tmp_path):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    conf = tmp_path / "b.json"
    conf.write_text(json.dumps({"model": "tiny", "lengths": [64], "window": 32}))
    args = parser.parse_args(
        [
            "bench",
            "--config",
            str(conf),
            "--lengths",
            "128",
            "--max-tokens",
            "full=131072",
            "--replug-piece",
            "16",
        ]
    )
    cfg = config_from_args(args)
    assert cfg.model == "tiny" and cfg.lengths == [128] and cfg.window == 32
    assert cfg.max_tokens["full"] == 131072 and cfg.max_tokens["replug"] == 32768
    bad = parser.parse_args(["bench", "--max-tokens", "nope=5"])
    with pytest.raises(ValueError, match="METHOD=N"):
        config_from_args(bad)
    with pytest.raises(ValueError, match="replug_piece"):
        BenchConfig(window=64, replug_piece=64).validate()
    # unknown keys and wrong types name the key and the file
    conf.write_text(json.dumps({"model": "tiny", "lenghts": [64]}))
    with pytest.raises(ValueError, match=r"b\.json: unknown bench config keys \['lenghts'\]"):
        config_from_args(parser.parse_args(["bench", "--config", str(conf)]))
    conf.write_text(json.dumps({"model": "tiny", "window": "wide"}))
    with pytest.raises(ValueError, match=r"b\.json: bench config\.window must be a number"):
        config_from_args(parser.parse_args(["bench", "--config", str(conf)]))


def test_shipped_configs_are_valid():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs" / "bench"
    files = sorted(root.glob("*.json"))
    assert files
    for f in files:
        cfg = BenchConfig.from_dict(json.loads(f.read_text()))
        cfg.validate()
        assert cfg.settings()


@pytest.mark.parametrize("method", ["full", "cepe"])
def test_static_cache_decode_matches_dynamic(method):
    """The benchmark's preallocated decode cache gives the same logits as HF's growing one."""
    cfg = tiny_cfg()
    model = build_model(cfg)
    ids = random_ids(160, int(model.decoder.config.vocab_size), 0)
    runs = {}
    for room in (None, 160 + 4):
        with torch.inference_mode():
            if method == "full":
                state = full_prefill(model, ids, cfg.full_chunk, cache=_new_cache(model, room))
                kept, step_fn = 160, model.decoder
            else:
                state = cepe_prefill(model, ids, cfg.window, "kv", cache=_new_cache(model, room))
                kept, step_fn = cfg.window, functools.partial(model, cross_context=state["context"])

            tok, logits = state["logits"][:, -1:].argmax(-1), [state["logits"][:, -1]]
            for step in range(3):
                out = step_fn(
                    input_ids=tok,
                    past_key_values=state["cache"],
                    use_cache=True,
                    cache_position=torch.tensor([kept + step]),
                )
                logits.append(out.logits[:, -1])
                tok = out.logits[:, -1:].argmax(-1)
        runs[room] = torch.stack(logits)
    assert type(_new_cache(model, 8)).__name__ == "StaticCache"
    torch.testing.assert_close(runs[164], runs[None], rtol=1e-5, atol=1e-5)


def test_decode_only_run_and_dynamic_cache(tmp_path):
    """configs/bench/decode.json style: no prefill lengths; decode rows on either cache kind."""
    for cache in ("static", "dynamic"):
        cfg = tiny_cfg(lengths=[], methods=["cepe", "full"], decode_cache=cache)
        result = run_benchmark(
            cfg, tmp_path / cache, in_process=True, peak_matmul_size=64, peak_seconds=0.01, log=lambda s: None
        )
        rows = result["rows"]
        assert [r["kind"] for r in rows] == ["decode"] * 4
        assert all(r["cache"] == cache and r["tokens_per_s"] > 0 for r in rows)
    with pytest.raises(ValueError, match="decode_cache must be"):
        tiny_cfg(decode_cache="paged").validate()


def test_plot_of_a_prefill_only_run(tmp_path, monkeypatch):
    """A run without decode settings plots its curves and says it has no decode (no empty axes)."""
    from matplotlib.figure import Figure

    from cepe.bench.report import plot

    rows = [
        {
            "kind": "prefill",
            "method": m,
            "tokens": t,
            "tokens_per_s": 100.0 / t,
            "peak_delta_bytes": 2**20 * t,
        }
        for m in ("cepe", "full")
        for t in (8, 32)
    ]
    result = {"rows": rows, "config": {"model": "tiny", "dtype": "fp32"}, "machine": "cpu"}
    saved = []
    original = Figure.savefig

    def keep(fig, *args, **kwargs):
        saved.append(fig)
        return original(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    out = tmp_path / "bench.png"
    plot(result, out)
    assert out.stat().st_size > 1000
    throughput, memory, decode = saved[0].axes
    assert len(throughput.lines) == len(memory.lines) == 2  # one curve per method
    assert not decode.axison and [t.get_text() for t in decode.texts] == ["no decode settings in this run"]


@pytest.mark.parametrize("run", ["bench-128k", "bench-decode"])
def test_summary_of_committed_runs_is_reproduced(run):
    """``summarize`` recomputes, key for key, the summary stored with committed runs (prefill ratios and
    targets, the memory slope, decode speeds)."""
    from pathlib import Path

    from cepe.bench.report import summarize

    result = json.loads((Path(__file__).resolve().parents[1] / "results" / run / "bench.json").read_text())
    assert result["summary"]["targets"] and summarize(result) == result["summary"]


def test_decode_modes_are_checked_from_a_file_or_set():
    """--set decode_modes=[kvv] (not only the flag) is refused before anything runs."""
    from cepe.bench.config import BenchConfig
    from cepe.configio import load_config

    with pytest.raises(ValueError, match="unknown decode_modes \\['kvv'\\]"):
        load_config(BenchConfig, overrides=["decode_modes=[kvv]"]).validate()


def test_a_failed_setting_is_reported_and_the_run_goes_on(tmp_path, monkeypatch):
    """A prefill that fails (out of memory at its length, say) is a row with its error, and the printed
    report names it (it read the row's cost-model FLOPs, which an error row lacks, and crashed)."""
    import cepe.bench.api as api
    from cepe.bench.report import format_report

    real = api.run_setting

    def failing(cfg, setting, model):
        if setting["kind"] == "prefill" and setting["method"] == "full":
            raise MemoryError("out of memory")
        return real(cfg, setting, model)

    monkeypatch.setattr(api, "run_setting", failing)
    result = run_benchmark(
        tiny_cfg(), tmp_path, in_process=True, peak_matmul_size=128, peak_seconds=0.05, log=lambda s: None
    )
    errors = [r for r in result["rows"] if r.get("error")]
    assert errors and all(r["method"] == "full" and "MemoryError" in r["error"] for r in errors)
    assert "error: MemoryError: out of memory" in format_report(result)


def test_cuda_memory_delta_is_above_what_was_resident(monkeypatch):
    """On CUDA the region's memory delta is its peak above the memory allocated when it began (the
    weights), as on the CPU it is above the resident size; it was the absolute peak."""
    from cepe.measure import Meter

    allocated = {"now": 500 * 2**20}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: allocated["now"] + 64 * 2**20)
    meter = Meter("cuda")
    with meter.measure(10):
        pass
    got = meter.summary()
    assert got["peak_memory_mb"] == 564.0 and got["rss_delta_mb"] == 64.0
