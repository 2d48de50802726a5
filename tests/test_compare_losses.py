"""scripts/compare_losses.py: losses from both log forms, compared over the last common steps."""

from __future__ import annotations

import json

import pytest
from conftest import load_script


def test_both_log_forms_and_the_last_common_steps(tmp_path):
    mod = load_script("compare_losses")
    a = tmp_path / "log.jsonl"
    a.write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in range(1, 6)))
    b = tmp_path / "stage.log"
    b.write_text(
        "cepe: compute bfloat16\n"
        + "".join(
            f"x: cepe running, step {s}/9, tokens seen 1,024 dec, loss {2.0 * s:.4f}, 9 tok/s\n"
            for s in (2, 3, 4, 7)
        )
    )
    assert mod.read_losses(b) == {2: 4.0, 3: 6.0, 4: 8.0, 7: 14.0}
    res = mod.compare(mod.read_losses(a), mod.read_losses(b), last=2)
    assert res == {"steps": [3, 4], "n": 2, "mean_a": 3.5, "mean_b": 7.0}
    with pytest.raises(ValueError, match="no logged step"):
        mod.compare({1: 1.0}, {2: 1.0}, 5)
    assert mod.main([str(a), str(tmp_path / "missing.log")]) == 2
