"""The benchmark's cost model against what each method computes, the memory slope of short rows, and the
command's closing line. No wall-clock time is asserted."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch
from test_bench import tiny_cfg

from cepe.bench.runner import build_model, cost_model, prefill, random_ids

_tiny = tiny_cfg  # the benchmark tests' tiny settings


@pytest.mark.parametrize("method", ["cepe", "full", "streamingllm", "replug"])
def test_cost_model_counts_the_logit_rows_each_method_computes(method):
    """The cost model's output-head FLOPs are 2·hidden·vocab per logit row the method's prefill computes
    (counted at the head). StreamingLLM scoring the last token keeps two rows in its last call (the
    prediction of the last token comes from the position before it); the model counted one."""
    cfg = _tiny()
    model = build_model(cfg)
    cm = cost_model(model, cfg)
    headless = dataclasses.replace(cm, dec=dataclasses.replace(cm.dec, vocab=0))
    rows = []
    model.decoder.lm_head.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[:-1].numel()))
    for total in (5, 64, 65, 96, 129, 160, 161):
        rows.clear()
        with torch.inference_mode():
            prefill(model, cfg, method, random_ids(total, int(model.decoder.config.vocab_size), 0))
        modelled = (cm.prefill(method, total) - headless.prefill(method, total)) / (
            2 * cm.dec.hidden * cm.dec.vocab
        )
        assert modelled == sum(rows), (method, total)


def _result(lengths: list[int], window: int = 64) -> dict:
    """A run's result with CEPE prefill rows keeping exactly what the cost model says (fp32)."""
    cfg = _tiny(lengths=lengths, window=window, methods=["cepe"], decode_context=0)
    cm = cost_model(build_model(cfg), cfg)
    rows = [
        {
            "kind": "prefill",
            "method": "cepe",
            "tokens": t,
            "tokens_per_s": 1.0,
            "peak_delta_bytes": 1,
            "peak_rss_bytes": 1,
            "kept_tensor_bytes": cm.cache_bytes("cepe", t, bytes_per_elem=4),
            "kept_rss_delta_bytes": cm.cache_bytes("cepe", t, bytes_per_elem=4),
        }
        for t in lengths
    ]
    return {
        "config": cfg.to_dict(),
        "rows": rows,
        "predicted_flops": {},
        "cost_model": {
            "full_kv_bytes_per_token": cm.dec.kv_bytes_per_token(4),
            "cepe_extra_memory_fraction": cm.cepe_extra_memory_fraction(),
        },
    }


def test_memory_slope_leaves_out_rows_inside_the_window():
    """A CEPE row of fewer than ``window`` tokens holds them all in the decoder's K/V cache: a slope from
    it to a longer row mixes decoder K/V into "memory per context token" and fails the target that the
    kept bytes meet exactly."""
    from cepe.bench.report import summarize

    short = summarize(_result([32, 160]))  # only one row at or beyond the window: no slope to take
    assert "cepe_kept_tensor_fraction" not in short["memory"]
    assert not [t for t in short["targets"] if "extra memory" in t["target"]]
    full = summarize(_result([32, 64, 160]))
    mem = full["memory"]
    assert mem["slope_between_tokens"] == [64, 160]
    assert mem["cepe_kept_tensor_fraction"] == pytest.approx(mem["cepe_extra_fraction_bound"])
    assert all(t["met"] for t in full["targets"] if "extra memory" in t["target"])


def test_bench_command_does_not_claim_a_plot_it_did_not_write(tmp_path, monkeypatch, capsys):
    """When the plot cannot be drawn (the run removes it and says so), the closing line names only
    bench.json."""
    import cepe.bench.api as api
    import cepe.bench.report as report
    from cepe.bench.cli import register

    def fake_run(cfg, out, in_process=False):
        (tmp_path / "bench.json").write_text("{}")
        return {}

    monkeypatch.setattr(api, "run_benchmark", fake_run)
    monkeypatch.setattr(report, "format_report", lambda result: "report")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    conf = tmp_path / "b.json"
    conf.write_text(json.dumps({"model": "tiny", "lengths": [128], "window": 32, "replug_piece": 16}))
    args = parser.parse_args(["bench", "--config", str(conf), "--out", str(tmp_path)])
    assert args.func(args) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"wrote {tmp_path / 'bench.json'}"


@pytest.mark.parametrize("field, value", [("threads", -1), ("decode_tokens", -2)])
def test_negative_threads_or_decode_tokens_are_refused_by_name(field, value):
    """A negative thread count failed inside torch, not naming the field; negative decode tokens silently
    dropped the decode settings."""
    with pytest.raises(ValueError, match=field):
        _tiny(**{field: value}).validate()


def test_a_report_name_with_a_dot_keeps_its_whole_name(tmp_path):
    """``write_rows`` writes ``OUT.json`` and ``OUT.md``: a name with a dot in it is not cut at the dot."""
    from cepe.tables import write_rows

    write_rows(tmp_path / "kernels_v1.5", [{"a": 1}], {"m": 0})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels_v1.5.json", "kernels_v1.5.md"]


def test_a_run_stopped_part_way_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    """The rows measured so far are written after each setting (``bench.partial.json``); a finished run
    leaves only ``bench.json``. Before, a run killed at its last setting lost every row."""
    import cepe.bench.api as api

    cfg = _tiny(lengths=[96], decode_context=0)
    real, calls = api._measure, []

    def stop_at_third(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(api, "_measure", stop_at_third)
    quiet = dict(in_process=True, peak_matmul_size=64, peak_seconds=0.01, log=lambda s: None)
    with pytest.raises(KeyboardInterrupt):
        api.run_benchmark(cfg, tmp_path, **quiet)
    kept = json.loads((tmp_path / api.PARTIAL).read_text())
    assert kept["complete"] is False and [r["method"] for r in kept["rows"]] == cfg.methods[:2]
    assert not (tmp_path / "bench.json").exists()
    monkeypatch.setattr(api, "_measure", real)
    api.run_benchmark(cfg, tmp_path, **quiet)
    assert (tmp_path / "bench.json").is_file() and not (tmp_path / api.PARTIAL).exists()
