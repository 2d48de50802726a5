"""scripts/run_bias_bench.py: the run-bias layer with the fused kernel's logsumexp and with its own pass
compute the same function at training shapes, and it reports."""

from __future__ import annotations

import json

from conftest import load_script


def test_both_logsumexp_sources_agree_and_the_report_is_written(tmp_path):
    mod = load_script("run_bias_bench")
    out = tmp_path / "run"
    rows = mod.main(["--keys", "96", "--batch", "2", "--queries", "8", "--repeats", "1", "--out", str(out)])
    assert [r["keys"] for r in rows] == [96]
    assert rows[0]["max_rel_diff"] < 0.05  # bf16 outputs and gradients of the same function
    assert min(rows[0][key] for key in ("fused_s", "run_own_lse_s", "run_kernel_lse_s")) > 0
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["rows"] == rows and saved["meta"]["shape"]["KV"] == 3
    assert out.with_suffix(".md").read_text().startswith("| keys | fused_s |")
