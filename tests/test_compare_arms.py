"""scripts/compare_arms.py: the table of training arms built from the evaluations' JSON files."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import load_script


def _module():
    return load_script("compare_arms")


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": rows}))


def test_compare_arms_tables_each_arm_and_step(tmp_path):
    root = tmp_path / "arms"
    for arm, base in (("cepe", 10.0), ("ceped", 20.0)):
        folder = root / f"{arm}_step40"
        _write(
            folder / "lm_val" / "lm.json",
            [
                {"setting": {"domain": "avg", "total": 1024}, "value": base},
                {"setting": {"domain": "books", "total": 1024}, "value": 99.0},
            ],
        )
        _write(
            folder / "needle_encoder" / "needle.json",
            [
                {"setting": {"total": 2048, "depth": 0.9}, "value": 100.0},  # in the window: left out
                {"setting": {"total": 2048, "depth": 0.5}, "value": base},
                {"setting": {"total": 4096, "depth": 0.5}, "value": 0.0},
            ],
        )
        _write(
            folder / "qa" / "qa.json",
            [
                {"method": "cepe", "setting": {"k": 5}, "value": base + 1},
                {"method": "truncated", "setting": {"k": 5}, "value": 0.0},
            ],
        )
    run = tmp_path / "long_cepe"
    run.mkdir()
    run.joinpath("log.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "step_s": 30.0}) for s in range(1, 61)) + "\n"
    )
    assert _module().main([str(root), str(run)]) == 0
    table = json.loads((root / "compare.json").read_text())
    assert table["cepe step 40"]["lm_val ppl 1K"] == 10.0 and table["ceped step 40"]["lm_val ppl 1K"] == 20.0
    assert table["cepe step 40"]["needle beyond the window % (2 cells)"] == 5.0
    assert table["ceped step 40"]["qa EM k=5 %"] == 21.0
    assert table["cepe step 40"]["training CPU-minutes"] == 20.0  # 40 steps of 30 s
    assert "training CPU-minutes" not in table["ceped step 40"]
    assert (root / "compare.png").stat().st_size > 0
    assert "| lm_val ppl 1K | 10.00 | 20.00 |" in (root / "compare.md").read_text()
