"""scripts/gpu_route.py: the route driver's bookkeeping (done stages skipped, the deadline's SIGTERM, the
last checkpoint and loss, the int8 export cut into pieces that join back to the file)."""

from __future__ import annotations

import json
import time

import pytest
from conftest import load_script


def _timeline():
    return {"t0": time.time(), "stages": [], "probes": []}


def test_last_step_needs_a_complete_checkpoint_and_last_loss_reads_the_log(tmp_path):
    mod = load_script("gpu_route")
    from cepe.training.checkpoint import STATE_FILE

    for step, complete in ((20, True), (40, True), (60, False)):
        d = tmp_path / "checkpoints" / f"step_{step:06d}"
        d.mkdir(parents=True)
        if complete:
            (d / STATE_FILE).write_text("{}")
    assert mod._last_step(tmp_path) == 40
    assert mod._last_loss(tmp_path) is None
    (tmp_path / "log.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in ((1, 4.97), (2, 4.7414)))
    )
    assert mod._last_loss(tmp_path) == 4.7414


def test_a_done_stage_is_skipped_without_running_anything(tmp_path, monkeypatch):
    mod = load_script("gpu_route")
    (tmp_path / "fast_warmup").mkdir()
    (tmp_path / "fast_warmup" / "status.json").write_text(json.dumps({"state": "done"}))
    monkeypatch.setattr(mod, "_cepe", lambda: ["false"])  # would fail if it ran
    tl = _timeline()
    assert mod.run_stage("fast_warmup", "warmup", tmp_path, [], time.time() + 60, tl)
    assert tl["stages"] == [{"name": "fast_warmup", "skipped": "done already"}]


def test_a_stage_past_the_deadline_gets_sigterm(tmp_path, monkeypatch):
    mod = load_script("gpu_route")
    # a stand-in trainer that writes "stopped" on SIGTERM, as cepe train checkpoints and exits
    script = f'trap \'echo {{\\"state\\": \\"stopped\\"}} > {tmp_path}/s/status.json; exit 0\' TERM; sleep 30 & wait'
    (tmp_path / "s").mkdir()
    monkeypatch.setattr(mod, "_cepe", lambda: ["bash", "-c", script, "stand-in"])
    tl = _timeline()
    t0 = time.time()
    done = mod.run_stage("s", "cepe", tmp_path, [], time.time() + 1.0, tl)
    assert time.time() - t0 < 15
    assert not done
    assert tl["stages"][0]["rc"] == 0 and tl["stages"][0]["done"] is False
    assert json.loads((tmp_path / "s" / "status.json").read_text())["state"] == "stopped"


def test_export_pieces_join_back_to_the_adapter_file(tmp_path, monkeypatch):
    mod = load_script("gpu_route")
    payload = bytes(range(256)) * 41  # 10,496 bytes

    def fake_run(cmd, **kwargs):  # stands in for `cepe export --quantize int8`
        out = tmp_path / "dest" / ".a.export"
        assert cmd[cmd.index("--quantize") + 1] == "int8"
        out.mkdir(parents=True)
        (out / "adapter_model.safetensors").write_bytes(payload)
        (out / "cepe_config.json").write_text("{}")

    monkeypatch.setattr(mod.subprocess, "run", fake_run)
    monkeypatch.setattr(mod, "PIECE", 4096)
    names = mod.export_int8(tmp_path / "adapter", tmp_path / "dest", "a")
    assert names == [f"a.int8.safetensors.part{i:02d}" for i in range(3)]
    joined = b"".join((tmp_path / "dest" / n).read_bytes() for n in names)
    assert joined == payload
    assert (tmp_path / "dest" / "a.cepe_config.json").exists()
    assert not (tmp_path / "dest" / ".a.export").exists()


def test_a_stage_starts_from_the_stage_its_config_names():
    mod = load_script("gpu_route")
    assert mod._parent("fast_warmup") is None
    assert mod._parent("fast_direct_copy") == "fast_warmup"
    assert mod._parent("fast_fold_gates") == "fast_fold_qa2"
    assert mod._parent("fast_fold_break_only") == "fast_fold_qa2"
    assert mod._kind("fast_warmup") == "warmup" and mod._kind("fast_fold_gates") == "cepe"


def test_a_start_that_is_neither_trained_nor_given_fails_before_training(tmp_path):
    mod = load_script("gpu_route")

    def end_of(name):
        return tmp_path / name / "adapter"

    with pytest.raises(SystemExit, match=r"--given fast_fold_qa2=PATH"):
        mod.check_starts(["fast_fold_gates"], {}, end_of)
    with pytest.raises(SystemExit, match=r"--given fast_fold_qa=PATH"):  # the first stage's own start
        mod.check_starts(["fast_fold_qa2", "fast_fold_gates"], {}, end_of)
    mod.check_starts(
        ["fast_fold_qa2", "fast_fold_gates", "fast_fold_break_only"], {"fast_fold_qa": tmp_path}, end_of
    )
    mod.check_starts(["fast_fold_gates"], {"fast_fold_qa2": tmp_path / "given"}, end_of)
    (tmp_path / "fast_fold_qa2" / "adapter").mkdir(parents=True)  # trained by an earlier run on this machine
    mod.check_starts(["fast_fold_gates"], {}, end_of)


def test_given_pieces_join_back_and_an_adapter_directory_is_used_as_it_is(tmp_path):
    mod = load_script("gpu_route")
    payload = bytes(range(256)) * 37
    src = tmp_path / "back"
    src.mkdir()
    for i in range(3):
        (src / f"qa2.int8.safetensors.part{i:02d}").write_bytes(payload[i * 4096 : (i + 1) * 4096])
    (src / "qa2.cepe_config.json").write_text('{"k": 1}')
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "cepe_config.json").write_text("{}")
    given = mod.parse_given(
        [f"fast_fold_qa2={src / 'qa2'}", f"fast_fold_gates={adapter}"], tmp_path / "joined"
    )
    assert given["fast_fold_gates"] == adapter
    joined = given["fast_fold_qa2"]
    assert joined == tmp_path / "joined" / "fast_fold_qa2"
    assert (joined / "adapter_model.safetensors").read_bytes() == payload
    assert (joined / "cepe_config.json").read_text() == '{"k": 1}'
    (src / "qa2.int8.safetensors.part01").unlink()
    with pytest.raises(SystemExit, match=r"missing: found parts \[0, 2\]"):
        mod.join_pieces(src / "qa2", tmp_path / "again")
    with pytest.raises(SystemExit, match="neither an adapter directory nor the prefix"):
        mod.parse_given([f"x={tmp_path / 'nothing'}"], tmp_path / "joined")
    with pytest.raises(SystemExit, match="NAME=PATH"):
        mod.parse_given(["fast_fold_qa2"], tmp_path / "joined")


def test_exact_pieces_join_back_checked_and_the_last_finished_stage_returns(tmp_path, monkeypatch):
    mod = load_script("gpu_route")
    payload = bytes(range(256)) * 53  # 13,568 bytes
    adapter = tmp_path / "read_lm" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_model.safetensors").write_bytes(payload)
    (adapter / "cepe_config.json").write_text('{"k": 2}')
    names = mod.cut_fp32(adapter, tmp_path / "pieces", "read_lm", piece=5000)
    assert names == [f"read_lm.fp32.safetensors.part{i:02d}" for i in range(3)]
    given = mod.parse_given([f"read_lm={tmp_path / 'pieces' / 'read_lm'}"], tmp_path / "joined")
    assert (given["read_lm"] / "adapter_model.safetensors").read_bytes() == payload
    assert (given["read_lm"] / "cepe_config.json").read_text() == '{"k": 2}'
    part = tmp_path / "pieces" / names[1]
    part.write_bytes(b"x" + part.read_bytes()[1:])  # one damaged byte
    with pytest.raises(SystemExit, match="SHA-256"):
        mod.join_pieces(tmp_path / "pieces" / "read_lm", tmp_path / "again")
    assert not (tmp_path / "again" / "adapter_model.safetensors").exists()
    (tmp_path / "pieces" / "read_lm.int8.safetensors.part00").write_bytes(b"")
    with pytest.raises(SystemExit, match="one set of pieces"):  # two kinds of pieces: which is meant?
        mod.join_pieces(tmp_path / "pieces" / "read_lm", tmp_path / "again")

    runs = tmp_path / "runs"
    for name, state in (("a", "done"), ("b", "done"), ("c", "stopped")):
        (runs / name).mkdir(parents=True)
        (runs / name / "status.json").write_text(json.dumps({"state": state}))
    ends = {"a": tmp_path / "nowhere", "b": adapter}
    monkeypatch.setattr(mod, "FP32_PIECE", 6000)
    got = mod.return_fp32(["a", "b", "c"], runs, ends.__getitem__, tmp_path / "keep", tmp_path / "out")
    assert got["stage"] == "b" and len(got["pieces"]) == 3
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        ["b.fp32.safetensors.part00", "b.cepe_config.json", "b.sha256"]
    )
    for p in got["pieces"][1:]:  # the later calls' pieces, brought next to the first
        (tmp_path / "out" / p).write_bytes((tmp_path / "keep" / p).read_bytes())
    back = mod.join_pieces(tmp_path / "out" / "b", tmp_path / "back")
    assert (back / "adapter_model.safetensors").read_bytes() == payload
    assert mod.return_fp32(["c"], runs, ends.__getitem__, tmp_path / "keep2", tmp_path / "out2") is None


def test_siblings_train_together_only_when_asked():
    mod = load_script("gpu_route")
    route = ["fast_fold_qa2", "fast_fold_gates", "fast_fold_break_only"]
    assert mod.sibling_groups(route, False) == [[s] for s in route]
    assert mod.sibling_groups(route, True) == [["fast_fold_qa2"], ["fast_fold_gates", "fast_fold_break_only"]]
    chain = ["fast_warmup", "fast_direct_copy", "fast_direct_recall2"]
    assert mod.sibling_groups(chain, True) == [[s] for s in chain]  # each starts from the one before


def test_stages_of_one_group_run_at_the_same_time(tmp_path, monkeypatch):
    mod = load_script("gpu_route")
    # a stand-in trainer: 2 s of work, then "done" in its output directory (the argument after --output-dir)
    script = 'out=$(echo "$@" | sed "s/.*--output-dir \\([^ ]*\\).*/\\1/"); sleep 2; mkdir -p $out; echo "{\\"state\\": \\"done\\"}" > $out/status.json'
    monkeypatch.setattr(mod, "_cepe", lambda: ["bash", "-c", script, "stand-in"])
    tl = _timeline()
    t0 = time.time()
    assert mod.run_stages([("a", "cepe", []), ("b", "cepe", [])], tmp_path, time.time() + 60, tl)
    assert time.time() - t0 < 3.5  # together, not one after the other (4 s)
    assert [r["name"] for r in tl["stages"]] == ["a", "b"] and all(r["done"] for r in tl["stages"])


def _probe_folder(root, name, val, val2, val3, lm):
    """A probe folder as scripts/probe_stage.sh writes it: the first validation needle's share at each
    total in calibrate.json, the second's and third's cells in their needle.json."""
    d = root / name / "step040"
    row = {f"needle_{t}": v for t, v in zip((2048, 4096, 8192), val)}
    row.update({"lm_val_1024": lm[0], "lm_val_2048": lm[1]})
    d.mkdir(parents=True)
    (d / "calibrate.json").write_text(json.dumps({"rows": [row]}))
    for sub, cells in (("needle_val2", val2), ("needle_val3", val3)):
        (d / sub).mkdir()
        rows = [{"method": "cepe", "value": v} for v in cells]
        rows.append({"method": "truncated", "value": 100.0})  # another method's rows are not counted
        (d / sub / "needle.json").write_text(json.dumps({"rows": rows}))
    return d


def test_validation_cells_count_half_answers_half_and_ties_go_to_lower_perplexity(tmp_path):
    mod = load_script("gpu_route")
    full = [100.0] * 15
    a = _probe_folder(tmp_path, "a", (80, 100, 100), full, [100.0] * 10 + [50.0] * 5, (24.0, 21.6))
    b = _probe_folder(tmp_path, "b", (100, 100, 80), full, [100.0] * 10 + [50.0] * 5, (22.0, 20.0))
    c = _probe_folder(tmp_path, "c", (100, 100, 100), full, [100.0] * 10 + [0.0] * 5, (19.0, 17.0))
    scores = {n: mod.validation_score(d) for n, d in (("a", a), ("b", b), ("c", c))}
    assert scores["a"] == (14 + 15 + 12.5, 22.8)
    assert scores["c"][0] == 15 + 15 + 10
    assert mod.rank(scores) == ["b", "a", "c"]  # a and b tie on cells: b's lm_val is lower
    assert mod.validation_score(tmp_path / "missing") == (0.0, None)
    assert mod.rank({"x": (3.0, None), "y": (3.0, 30.0)}) == ["y", "x"]
    (c / "needle_val4").mkdir()  # the fourth needle, where a probe wrote it, counts as the others do
    rows = [{"method": "cepe", "value": 100.0}] * 14 + [{"method": "cepe", "value": 50.0}]
    (c / "needle_val4" / "needle.json").write_text(json.dumps({"rows": rows}))
    assert mod.validation_score(c)[0] == 40 + 14.5


def test_export_rank_needs_a_ranking_and_a_trained_adapter_at_that_rank(tmp_path, monkeypatch):
    mod = load_script("gpu_route")
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    with pytest.raises(SystemExit, match="no ranking here"):
        mod.export_ranked(1, tmp_path / "out")
    (tmp_path / "runs").mkdir()
    ranking = [
        {"name": "start_h200", "trained": False, "adapter": "runs/given/start"},
        {
            "name": "gpu_a_h200",
            "trained": True,
            "adapter": "runs/recipe/gpu_a/checkpoints/step_000060/adapter",
        },
    ]
    (tmp_path / "runs" / "gpu_route_last.json").write_text(json.dumps({"ranking": ranking}))
    with pytest.raises(SystemExit, match="holds 1 trained"):
        mod.export_ranked(2, tmp_path / "out")
    seen = []
    monkeypatch.setattr(mod, "export_int8", lambda path, out, name: seen.append((path, name)) or [name])
    assert mod.export_ranked(1, tmp_path / "out") == 0
    assert seen == [(tmp_path / ranking[1]["adapter"], "gpu_a_h200")]


def test_probes_run_together_and_a_deadline_ends_each_with_its_evaluations(tmp_path, monkeypatch):
    """probe_many: a probe that ends writes its row; one past the deadline is killed with the processes
    it started (its evaluations), not only the shell that runs it."""
    import subprocess

    mod = load_script("gpu_route")
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "probe_stage.sh").write_text(
        'if [ "$1" = quick ]; then echo "summary of $1 at $ADAPTER"; exit 0; fi\n'
        'sleep 60 & echo $! > "child_$1"; wait\n'
    )
    tl = _timeline()
    t0 = time.time()
    mod.probe_many([("quick", 40, tmp_path / "a"), ("slow", 40, None)], time.time() + 2, tl)
    assert time.time() - t0 < 30
    rows = {r["name"]: r for r in tl["probes"]}
    assert rows["quick"]["rc"] == 0 and rows["quick"]["summary"] == [f"summary of quick at {tmp_path / 'a'}"]
    assert rows["slow"]["rc"] != 0
    child = int((tmp_path / "child_slow").read_text())
    time.sleep(0.2)
    gone = subprocess.run(["ps", "-o", "stat=", "-p", str(child)], capture_output=True, text=True).stdout
    assert gone.strip() in ("", "Z"), f"the probe's evaluation {child} outlived the deadline"
