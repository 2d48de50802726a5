"""scripts/compare_losses.py: losses from both log forms, compared over the last common steps."""

from __future__ import annotations

import json
import math

import pytest
from conftest import load_script


def _status_lines(losses: dict[int, float], steps: int, skip: tuple[int, ...] = ()) -> str:
    """A ``--no-progress`` stage log of ``losses`` (step → loss, from step 1) as the trainer writes it: each
    line's loss the mean of the last 10 steps' (its ``loss_recent``), formatted by its status line; no
    line for the steps in ``skip``."""
    from cepe.training.runctl import format_status

    lines = ["cepe: compute bfloat16 (fast paths), 2 threads, 1 process(es)"]
    for s in sorted(set(losses) - set(skip)):
        recent = [losses[t] for t in range(max(1, s - 9), s + 1)]
        st = {"stage": "cepe", "state": "running", "step": s, "steps": steps}
        st |= {"loss_recent": sum(recent) / len(recent), "updated": 0.0}
        lines.append(format_status("runs/recipe/x", st))
    return "\n".join(lines) + "\n"


def test_both_log_forms_and_the_last_common_steps(tmp_path):
    mod = load_script("compare_losses")
    a = tmp_path / "log.jsonl"
    a.write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in range(1, 6)))
    b = tmp_path / "stage.log"
    b.write_text(_status_lines({s: 2.0 * s for s in range(1, 8)}, 9))
    assert mod.read_losses(b) == pytest.approx({s: 2.0 * s for s in range(1, 8)}, abs=1e-3)
    res = mod.compare(mod.read_losses(a), mod.read_losses(b), last=2)
    assert res["steps"] == [4, 5] and res["n"] == 2 and res["mean_a"] == 4.5
    assert res["mean_b"] == pytest.approx(9.0, abs=1e-3)
    with pytest.raises(ValueError, match="no logged step"):
        mod.compare({1: 1.0}, {2: 1.0}, 5)
    assert mod.main([str(a), str(tmp_path / "missing.log")]) == 2


def test_a_text_log_gives_each_steps_loss_not_the_trailing_mean(tmp_path):
    """The same run's log.jsonl and stage log give the same means: a status line's loss is the mean of the
    last 10 steps', which on a falling curve stands above the steps it is printed at."""
    mod = load_script("compare_losses")
    losses = {s: 4.0 + 2.0 * math.exp(-s / 15) + 0.3 * math.sin(1.7 * s) for s in range(1, 121)}
    a = tmp_path / "log.jsonl"
    a.write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in losses.items()))
    b = tmp_path / "stage.log"
    b.write_text(_status_lines(losses, 120))
    for last in (20, 115, 7):
        res = mod.compare(mod.read_losses(a), mod.read_losses(b), last)
        assert res["mean_b"] == pytest.approx(res["mean_a"], abs=1e-3), last
    assert mod.read_losses(b) == pytest.approx(losses, abs=5e-3)


def test_a_text_log_that_lacks_a_step_is_refused(tmp_path, capsys):
    mod = load_script("compare_losses")
    b = tmp_path / "stage.log"
    b.write_text(_status_lines({s: 3.0 for s in range(1, 31)}, 30, skip=(12,)))
    with pytest.raises(ValueError, match="1 step\\(s\\) have none \\(first 12\\)"):
        mod.read_losses(b)
    a = tmp_path / "log.jsonl"
    a.write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n")
    assert mod.main([str(a), str(b)]) == 2
    assert "first 12" in capsys.readouterr().err
    both = tmp_path / "both.log"
    both.write_text(a.read_text() + _status_lines({1: 3.0}, 30))
    with pytest.raises(ValueError, match="both"):
        mod.read_losses(both)
