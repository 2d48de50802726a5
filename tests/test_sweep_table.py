"""scripts/sweep_table.py: one row per swept value from the validation runs' JSON."""

from __future__ import annotations

import json

from conftest import load_script


def _write(path, rows):
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"rows": rows}))


def test_rows_average_needle_depths_and_read_lm_and_icl(tmp_path):
    mod = load_script("sweep_table")
    needle = [
        {"setting": {"total": t, "depth": d}, "value": v, "answer_nll": n}
        for t, d, v, n in [(2048, 0.0, 100, 0.2), (2048, 0.5, 0, 0.6), (4096, 0.0, 0, 1.5)]
    ]
    _write(tmp_path / "scale_1" / "needle" / "needle.json", needle)
    lm = [{"setting": {"domain": d, "total": 1024}, "value": v} for d, v in [("books", 30.0), ("avg", 21.5)]]
    _write(tmp_path / "scale_1" / "lm_val" / "lm.json", lm)
    _write(tmp_path / "scale_1" / "icl_val" / "icl.json", [{"setting": {"k_encoder": 8}, "value": 25.0}])
    _write(tmp_path / "scale_1.5" / "needle" / "needle.json", needle[2:])
    mod.main([str(tmp_path), "ADAPTER", "context_scale", "scale", "calibrate", "title", "1", "1.5"])
    rows = json.loads((tmp_path / "calibrate.json").read_text())["rows"]
    assert rows[0] == {
        "context_scale": 1.0,
        "needle_2048": 50.0,
        "needle_nll_2048": 0.4,
        "needle_4096": 0.0,
        "needle_nll_4096": 1.5,
        "lm_val_1024": 21.5,
        "icl_val_2+8": 25.0,
    }
    assert rows[1] == {"context_scale": 1.5, "needle_4096": 0.0, "needle_nll_4096": 1.5}
    md = (tmp_path / "calibrate.md").read_text().splitlines()
    assert md[0] == "# title: ADAPTER" and md[5].startswith("| 1.5 | nan | nan | 0 | 1.5 | nan |")
