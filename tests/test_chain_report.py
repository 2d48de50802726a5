"""scripts/chain_report.py: a chain's stages from their configs and run folders (no model)."""

from __future__ import annotations

import json

import pytest
from conftest import load_script


def _chain(tmp_path):
    configs, runs = tmp_path / "configs", tmp_path / "runs"
    configs.mkdir()
    (configs / "base.yaml").write_text("steps: 6\nlr: 1.0\n")
    (configs / "a.yaml").write_text("extends: base.yaml\n")
    (configs / "b.yaml").write_text("extends: a.yaml\nsteps: 4\n")
    (configs / "c.yaml").write_text("extends: a.yaml\n")
    out = runs / "a"
    (out / "checkpoints/step_000004").mkdir(parents=True)
    (out / "checkpoints/step_000002").mkdir()
    (out / "status.json").write_text(json.dumps({"state": "done"}))
    # step 5 was paused (its step time holds the pause)
    rows = [(1, 4.0, 2.0), (2, 2.0, 3.0), (3, 1.0, 2.0), (4, 3.0, 2.0), (5, 2.0, 600.0), (6, 1.0, 2.0)]
    lines = [json.dumps({"step": s, "loss": loss, "lm_qa": loss / 2, "step_s": t}) for s, loss, t in rows]
    (out / "log.jsonl").write_text("\n".join(lines) + "\n")
    (runs / "b").mkdir()
    (runs / "b/status.json").write_text(json.dumps({"state": "running"}))
    (runs / "b/log.jsonl").write_text(
        json.dumps({"step": 1, "loss": 5.0, "step_s": 10.0}) + '\n{"step": 2, "lo'
    )
    return configs, runs


def test_steps_pace_windows_and_hours_left(tmp_path, capsys):
    mod = load_script("chain_report")
    configs, runs = _chain(tmp_path)
    a = mod.stage_row("a", runs, configs, every=4, terms=["lm_qa"])
    assert (a["state"], a["steps_done"], a["steps"]) == ("done", 6, 6)
    assert a["median_step_s"] == 2.0  # the paused step does not move the median
    assert a["minutes_at_median"] == round(6 * 2.0 / 60, 1) and a["hours_left"] == 0
    assert a["newest_checkpoint"] == 4
    assert a["loss_each_4"] == [f"{(4 + 2 + 1 + 3) / 4:.3f}", f"{1.5:.3f} (5-6)"]
    assert a["lm_qa_each_4"] == [f"{10 / 8:.3f}", f"{0.75:.3f} (5-6)"]
    b = mod.stage_row("b", runs, configs, every=4, terms=[])
    assert (b["state"], b["steps_done"], b["steps"], b["median_step_s"]) == ("running", 1, 4, 10.0)
    assert b["hours_left"] == round(3 * 10.0 / 3600, 2) and b["newest_checkpoint"] is None
    c = mod.stage_row("c", runs, configs, every=4, terms=[])
    assert (c["state"], c["steps"], c["hours_left"]) == ("not begun", 6, None)
    out = tmp_path / "r/report"
    args = ["a", "b", "c", "--runs", str(runs), "--configs", str(configs), "--every", "4", "--out", str(out)]
    assert mod.main(args) == 0
    printed = capsys.readouterr().out
    assert "| a | done | 6 / 6 | 2.0 | 0.2 | 0.0 | 4 | 2.500 / 1.500 (5-6) |" in printed
    assert printed.rstrip().endswith(
        f"{3 * 10 / 3600:.2f}, not counting 1 stage(s) with no step timed yet (c)"
    )
    assert out.with_suffix(".md").read_text() == printed
    assert json.loads(out.with_suffix(".json").read_text())["rows"][2]["stage"] == "c"
    # the pace from a later step: the median of steps 4-6 (3.0, 2.0, 2.0) is 2.0; from 5: (600 + 2) / 2
    assert mod.stage_row("a", runs, configs, every=4, terms=[], pace_from=5)["median_step_s"] == 301.0
    assert mod.stage_row("b", runs, configs, every=4, terms=[], pace_from=2)["median_step_s"] is None
    assert mod.stage_row("a", runs, configs, every=4, terms=[], pace_to=2)["median_step_s"] == 2.5
    assert (
        mod.main(["a", "--runs", str(runs), "--configs", str(configs), "--pace-from", "5", "--pace-to", "6"])
        == 0
    )
    assert "| a | done | 6 / 6 | 301.0 |" in capsys.readouterr().out
    # the chain's own arguments: its heads entries have no training steps and are left out
    assert mod.main(["a", "heads:zzz", "b", "c", *args[3:7], "--every", "4"]) == 0
    assert capsys.readouterr().out == printed


def test_unknown_stage_and_a_broken_log_are_refused_with_the_reason(tmp_path):
    mod = load_script("chain_report")
    configs, runs = _chain(tmp_path)
    with pytest.raises(SystemExit, match="no such stage"):
        mod.stage_row("zzz", runs, configs, every=4, terms=[])
    (runs / "a/log.jsonl").write_text('{"step": 1, "loss": 1.0}\nnot json\n{"step": 2, "loss": 1.0}\n')
    with pytest.raises(SystemExit, match="log.jsonl:2: not a JSON record"):
        mod.stage_row("a", runs, configs, every=4, terms=[])
    (configs / "d.yaml").write_text("lr: 1.0\n")
    with pytest.raises(SystemExit, match="no positive `steps`"):
        mod.stage_row("d", runs, configs, every=4, terms=[])


def test_a_stage_whose_process_is_gone_is_not_running(tmp_path):
    """A stage whose status says running while its process is gone (a killed session) reads as stopped."""
    import subprocess

    mod = load_script("chain_report")
    configs, runs = _chain(tmp_path)
    gone = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True, check=True)
    (runs / "b/status.json").write_text(json.dumps({"state": "running", "pid": int(gone.stdout)}))
    assert mod.stage_row("b", runs, configs, every=4, terms=[])["state"] == "stopped (process gone)"


def test_only_heads_entries_are_refused_with_what_to_name(tmp_path, capsys):
    """A call naming only ``heads:`` entries (no training steps) says what to name (was an IndexError)."""
    mod = load_script("chain_report")
    configs, runs = _chain(tmp_path)
    with pytest.raises(SystemExit):
        mod.main(["heads:mix_fit16", "--runs", str(runs), "--configs", str(configs)])
    assert "no training stage named" in capsys.readouterr().err
