"""``scripts/harness_table.py``: the README's lm-evaluation-harness table from lm-eval's own result files,
keeping the metrics and dropping what records the machine."""

import json

import pytest
from conftest import load_script


def _result(folder, method, word_ppl, acc, stamp="2026-01-01T00-00-00.0"):
    data = {
        "results": {
            "cepe_ppl": {"word_perplexity,none": word_ppl, "bits_per_byte,none": 1.08051157},
            "cepe_mc": {"acc,none": acc},
        },
        "n-samples": {"cepe_ppl": {"effective": 3}, "cepe_mc": {"effective": 20}},
        "config": {"model_args": {"model": "adapters/a", "method": method}},
        "total_evaluation_time_seconds": "12.34",
        "lm_eval_version": "0.4.13",
        "pretty_env_info": "machine details",
        "configs": {"cepe_ppl": {"dataset_kwargs": {"data_files": "/abs/path/cepe_ppl.jsonl"}}},
    }
    (folder / "adapters__a").mkdir(parents=True, exist_ok=True)
    (folder / "adapters__a" / f"results_{stamp}.json").write_text(json.dumps(data))


def test_rows_hold_the_newest_runs_metrics_and_no_machine_record(tmp_path):
    mod = load_script("harness_table")
    _result(tmp_path / "c", "cepe", 90.0, 0.5, stamp="2026-01-01T00-00-00.0")
    _result(tmp_path / "c", "cepe", 78.68892226, 0.75, stamp="2026-02-01T00-00-00.0")
    _result(tmp_path / "t", "truncated", 81.74831, 0.6)
    out = tmp_path / "res" / "harness"
    assert mod.main([f"cepe={tmp_path / 'c'}", f"truncated={tmp_path / 't'}", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    cepe, trunc = data["rows"]
    assert (cepe["method"], cepe["cepe_ppl word perplexity"], cepe["cepe_mc acc"]) == ("cepe", 78.6889, 0.75)
    assert (trunc["cepe_ppl word perplexity"], trunc["cepe_ppl bits per byte"]) == (81.7483, 1.0805)
    assert cepe["documents (ppl / mc)"] == "3 / 20" and cepe["seconds"] == 12.3
    text = out.with_suffix(".json").read_text() + out.with_suffix(".md").read_text()
    assert "/abs/path" not in text and "machine details" not in text
    assert out.with_suffix(".png").stat().st_size > 0


def test_a_run_given_as_another_method_or_missing_a_metric_is_refused(tmp_path):
    mod = load_script("harness_table")
    _result(tmp_path / "t", "truncated", 81.7, 0.6)
    with pytest.raises(SystemExit, match="method='truncated', given as 'cepe'"):
        mod.main([f"cepe={tmp_path / 't'}", "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="no results_"):
        mod.main([f"cepe={tmp_path / 'empty'}", "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="METHOD=DIR"):
        mod.main([str(tmp_path / "t"), "--out", str(tmp_path / "o")])
    f = next((tmp_path / "t").rglob("results_*.json"))
    data = json.loads(f.read_text())
    del data["results"]["cepe_mc"]["acc,none"]
    f.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="no 'acc,none' for task 'cepe_mc'"):
        mod.main([f"truncated={tmp_path / 't'}", "--out", str(tmp_path / "o")])
