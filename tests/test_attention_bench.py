"""scripts/attention_bench.py: the fused and the plain kernel agree at training shapes, and it reports."""

from __future__ import annotations

import json

from conftest import load_script


def test_kernels_agree_and_the_report_is_written(tmp_path):
    mod = load_script("attention_bench")
    out = tmp_path / "attn"
    rows = mod.main(["--keys", "96", "--batch", "2", "--queries", "8", "--repeats", "1", "--out", str(out)])
    assert [r["keys"] for r in rows] == [96]
    assert rows[0]["grad_max_rel_diff"] < 0.05  # bf16 gradients of the same function, padded keys masked
    assert rows[0]["fused_s"] > 0 and rows[0]["plain_s"] > 0
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["rows"] == rows and saved["meta"]["shape"]["KV"] == 3
    assert out.with_suffix(".md").read_text().startswith("| keys | fused_s |")


def test_float32_kernels_agree_closely_and_the_dtype_is_recorded(tmp_path):
    mod = load_script("attention_bench")
    out = tmp_path / "attn32"
    rows = mod.main(
        [
            "--keys",
            "96",
            "--batch",
            "2",
            "--queries",
            "8",
            "--repeats",
            "1",
            "--dtype",
            "float32",
            "--out",
            str(out),
        ]
    )
    assert rows[0]["grad_max_rel_diff"] < 1e-4  # fp32: the two kernels differ only in summation order
    assert json.loads(out.with_suffix(".json").read_text())["meta"]["dtype"] == "float32"
