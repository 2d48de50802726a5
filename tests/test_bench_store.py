"""``cepe bench-store`` on the tiny model: every measurement present, first tokens agree, byte counts."""

from __future__ import annotations

import json

import pytest
import torch

from cepe.bench.store_ttft import StoreBenchConfig, _first_token_full, kv_bytes_per_token, run_store_bench
from cepe.tiny import tiny_model


def test_chunked_full_prefill_matches_one_call_generate():
    model, _ = tiny_model()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (300,), generator=g)
    prompt = torch.randint(0, 256, (1, 7), generator=g)
    x = torch.cat([ids[None], prompt], 1)
    ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=1, do_sample=False)
    assert _first_token_full(model, ids, prompt, chunk=64) == int(ref[0, -1])


def test_bench_store_tiny(tmp_path):
    cfg = StoreBenchConfig(
        model="tiny", lengths=[256, 1024], full_max_tokens=256, store_dtype="fp32", threads=1
    )
    res = run_store_bench(cfg, tmp_path, log=lambda *a: None)
    short, long = res["rows"]
    for row in (short, long):
        assert row["first_token_same"]  # fp32 store: exactly the re-encoded states
        for key in ("ttft_stored_cold_s", "ttft_stored_warm_s", "ttft_reencode_s", "encode_s"):
            assert row[key] > 0
    assert short["ttft_full_s"] > 0 and long["ttft_full_s"] is None and "full_skipped" in long
    b = res["bytes"]
    model, _ = tiny_model()
    assert b["full_kv_bytes_per_token"] == kv_bytes_per_token(model.decoder.config, 4) == 2 * 2 * 2 * 8 * 4
    assert b["phi_bytes_per_token"] == 16 * 4
    # file: Φ + key mask (1 B) + token id (4 B) per token, plus a header that matters less as T grows
    assert 16 * 4 + 5 < b["file_bytes_per_token"]["1024"] < b["file_bytes_per_token"]["256"]
    saved = json.loads((tmp_path / "bench_store.json").read_text())
    assert saved["rows"][0]["tokens"] == 256
    assert "| 1024 |" in (tmp_path / "bench_store.md").read_text()


def test_a_run_stopped_part_way_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    """As ``cepe bench`` does: the rows measured so far are in ``bench_store.partial.json`` after each
    length, each exactly as ``bench_store.json`` holds it; a finished run leaves only ``bench_store.json``
    and ``bench_store.md``. Before, a run stopped at its second length kept nothing."""
    from cepe.bench import store_ttft

    cfg = StoreBenchConfig(
        model="tiny", lengths=[256, 300], full_max_tokens=256, store_dtype="fp32", threads=1
    )
    partial = tmp_path / "bench_store.partial.json"
    real, measured = store_ttft._measure_length, []

    def stop_at_second(*args, **kw):
        if measured:
            raise RuntimeError("stopped at the second length")
        measured.append(real(*args, **kw))
        return measured[-1]

    monkeypatch.setattr(store_ttft, "_measure_length", stop_at_second)
    with pytest.raises(RuntimeError, match="second length"):
        run_store_bench(cfg, tmp_path, log=lambda *a: None)
    kept = json.loads(partial.read_text())
    assert kept["complete"] is False and kept["config"]["lengths"] == [256, 300]
    assert kept["rows"] == json.loads(json.dumps(measured))  # the one row measured, every key
    assert kept["rows"][0]["tokens"] == 256 and kept["rows"][0]["ttft_full_s"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_store.partial.json"]

    # a new run starts over (not a resume point); at each length the file holds the rows before it, as
    # the final file holds them, and once the final files are written it is gone
    seen = []

    def snapshot(*args, **kw):
        seen.append(json.loads(partial.read_text())["rows"])
        return real(*args, **kw)

    monkeypatch.setattr(store_ttft, "_measure_length", snapshot)
    res = run_store_bench(cfg, tmp_path, log=lambda *a: None)
    final = json.loads((tmp_path / "bench_store.json").read_text())
    assert seen == [kept["rows"], final["rows"][:1]] and len(final["rows"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_store.json", "bench_store.md"]
    assert final == json.loads(json.dumps(res))
    assert {k: v for k, v in kept.items() if k not in ("rows", "complete")} == {
        k: v for k, v in final.items() if k not in ("rows", "bytes")
    }


def test_bench_store_with_a_mixture_that_reads_the_ids(tmp_path, monkeypatch):
    """An adapter whose output mixture matches the context's ids (the shipped one): every path gets the
    ids next to Φ, and the stored and re-encoded first tokens agree."""
    from cepe.bench import store_ttft

    def mixture(*args, **kwargs):
        model, tok = tiny_model()
        model.enable_output_mix(3, hidden=False, agree=True)
        model.enable_output_copy()
        return model, tok

    monkeypatch.setattr("cepe.generation.load_model_and_tokenizer", mixture)
    seen = []
    first = store_ttft._first_token_cepe

    def spy(model, prompt, cache, **enc):
        seen.append(enc["encoder_input_ids"].shape[-1] == enc["encoder_hidden_states"].shape[1])
        return first(model, prompt, cache, **enc)

    monkeypatch.setattr(store_ttft, "_first_token_cepe", spy)
    cfg = StoreBenchConfig(model="tiny", lengths=[300], full_max_tokens=0, store_dtype="fp32", threads=1)
    (row,) = run_store_bench(cfg, tmp_path, log=lambda *a: None)["rows"]
    assert seen == [True] * 5 and row["first_token_same"]


def test_bench_store_bf16(tmp_path, monkeypatch):
    """``dtype="bf16"``: every path (re-encode, stored, full prefill) runs the bf16 model, and the run says so."""
    from cepe.bench import store_ttft

    seen = []
    cepe_first, full_first = store_ttft._first_token_cepe, store_ttft._first_token_full

    def cepe_spy(model, prompt, cache, **enc):
        seen.append(("cepe", model.dtype, enc["encoder_hidden_states"].dtype))
        return cepe_first(model, prompt, cache, **enc)

    def full_spy(model, ids, prompt, chunk):
        seen.append(("full", model.dtype, next(model.decoder.parameters()).dtype))
        return full_first(model, ids, prompt, chunk)

    monkeypatch.setattr(store_ttft, "_first_token_cepe", cepe_spy)
    monkeypatch.setattr(store_ttft, "_first_token_full", full_spy)
    cfg = StoreBenchConfig(model="tiny", lengths=[256], full_max_tokens=256, dtype="bf16", threads=1)
    res = run_store_bench(cfg, tmp_path, log=lambda *a: None)
    # warm-up, untimed pass at the length, re-encode, stored cold, stored warm, full prefill
    assert [k for k, *_ in seen] == ["cepe"] * 5 + ["full"]
    assert all(d == torch.bfloat16 for _, *dts in seen for d in dts)
    (row,) = res["rows"]
    assert row["ttft_full_s"] > 0 and row["ttft_stored_cold_s"] > 0
    assert row["first_token_same"]  # a bf16 store of a bf16 model: the stored Φ is the re-encoded one
    assert res["config"]["dtype"] == "bf16" and "model dtype bfloat16" in res["machine"]
    assert json.loads((tmp_path / "bench_store.json").read_text())["config"]["dtype"] == "bf16"
    md = (tmp_path / "bench_store.md").read_text()
    assert "model dtype bf16 (every path)" in md and "differs" not in md
    # a flipped first token is reported with its likely cause
    flipped = {**res, "rows": [{**row, "first_token_same": False}]}
    assert "unexpected" in store_ttft.format_markdown(flipped)
    fp32 = {**flipped, "config": {**res["config"], "dtype": "fp32"}}
    assert "near-tie" in store_ttft.format_markdown(fp32)
    with pytest.raises(ValueError, match="dtype"):
        run_store_bench(StoreBenchConfig(model="tiny", dtype="fp16"), None)


def test_busy_machine_is_flagged_and_bad_settings_refused():
    """A report whose rows ran with the load average above the CPU count says its times are uncertain;
    lengths or a chunk that no run could use are refused before any model loads."""
    import pytest

    from cepe.bench.config import StoreBenchConfig
    from cepe.bench.store_ttft import busy_warning, run_store_bench

    rows = [{"tokens": 4096, "load_avg_start": 7.0, "load_avg_end": 8.9}]
    assert "load average 7.0-8.9 on 2 CPUs" in busy_warning({"machine": "x86_64 cpu x2", "rows": rows})
    quiet = [{"tokens": 4096, "load_avg_start": 0.4, "load_avg_end": 1.1}]
    assert busy_warning({"machine": "x86_64 cpu x2", "rows": quiet}) is None
    for bad, said in (({"lengths": [0]}, "lengths must be positive"), ({"full_chunk": 0}, "full_chunk")):
        with pytest.raises(ValueError, match=said):
            run_store_bench(StoreBenchConfig(model="tiny", **bad))
