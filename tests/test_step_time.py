"""scripts/step_time.py (the micro-batches of one step, timed as training runs them) and
scripts/taught_share.py (how many examples the online teacher runs for), on the tiny config."""

from __future__ import annotations

import json

import pytest
from conftest import load_script


def test_step_time_runs_the_steps_micro_batches_and_reports_the_process(tmp_path, capsys):
    mod = load_script("step_time")
    out = tmp_path / "r/t.json"
    args = [
        "configs/train/tiny/cepe.yaml",
        "--step",
        "1",
        "--set",
        "init_adapter=null",
        "--set",
        "bf16=false",
    ]
    assert mod.main([*args, "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    r = json.loads(out.read_text())
    assert r == printed
    assert r["micro_batches"] == 2 and r["encoder_shapes"] == [[4, 4, 8], [4, 4, 8]]  # batch 8, micro 4
    assert r["wall_s"] > 0 and r["minor_faults"] >= 0 and r["peak_rss_gib"] > 0 and r["bf16"] is False
    assert mod.main([*args, "--micro", "1"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["micro_batches"] == 1
    with pytest.raises(SystemExit, match="not mlm"):
        mod.main(["configs/train/tiny/mlm.yaml"])


def test_taught_share_prints_each_kind_and_all(tmp_path, capsys):
    import yaml

    d = yaml.safe_load(open("configs/train/tiny/cepe.yaml"))
    d.pop("init_adapter")
    d.update(
        online_teacher=True,
        tasks={"lm": 2, "recall": 1},
        recall_cue=4,
        recall_span=[4, 12],
        teacher_tasks=["lm"],
        context_drop=1.0,
        teacher_max_context=16,
        steps=3,
    )
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(d))
    assert load_script("taught_share").main([str(cfg)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split("|")[1].strip(): line.split("|")[2:5] for line in lines[2:]}
    assert set(rows) == {"lm", "recall", "all"}
    n_all, t_all = int(rows["all"][0]), int(rows["all"][1])
    assert (
        n_all == 3 * 8
        and 0 < t_all == int(rows["lm"][1]) < int(rows["lm"][0])
        and rows["recall"][1].strip() == "0"
    )


def test_training_says_which_malloc_serves_a_cpu_run(monkeypatch):
    import torch

    import cepe.training.trainer as trainer
    from cepe.training.trainer import _allocator_note

    monkeypatch.setattr(trainer, "jemalloc_active", lambda: True)
    assert _allocator_note(torch.device("cpu")) == ", jemalloc (purged each step)"
    monkeypatch.setattr(trainer, "jemalloc_active", lambda: False)
    assert "scripts/fast_alloc.sh" in _allocator_note(torch.device("cpu"))
    assert _allocator_note(torch.device("cuda")) == ""


@pytest.mark.multiproc
def test_purge_is_a_no_op_without_jemalloc_and_returns_its_pages_with_it(tmp_path):
    """Without jemalloc ``purge`` says so (False); in a process that preloads it (where the machine has
    it), it purges, and a freed large tensor's pages leave the resident memory."""
    import os
    import subprocess
    import sys

    from cepe import alloc

    if not alloc.jemalloc_active():
        assert alloc.purge() is False
    lib = next((p for p in ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",) if os.path.isfile(p)), None)
    if lib is None:
        pytest.skip("no libjemalloc.so.2 on this machine")
    code = (
        "import os, torch; from cepe import alloc\n"
        "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20\n"
        "x = torch.ones(64 * 2**20 // 4); del x; kept = rss()\n"
        "ok = alloc.purge(); print(alloc.jemalloc_active(), ok, round(kept - rss()))\n"
    )
    env = {**os.environ, "LD_PRELOAD": lib, "MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    active, ok, freed_mib = out.stdout.split()
    assert active == "True" and ok == "True" and int(freed_mib) >= 48, out.stdout
