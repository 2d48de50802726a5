"""scripts/val_verdict.py: a candidate's validation results against the shipped adapter's (no model)."""

from __future__ import annotations

import json

import pytest
from conftest import load_script


def _write(root, config, task, rows):
    (root / config).mkdir(parents=True, exist_ok=True)
    (root / config / f"{task}.json").write_text(json.dumps({"task": task, "rows": rows, "methods": ["cepe"]}))


def _folder(root, short, needle, qa_em, qa_nll, lm=(16.0, 13.0)):
    _write(
        root,
        "fixedppl_val_short",
        "fixedppl",
        [{"method": "cepe", "setting": {"context": c}, "value": v} for c, v in zip((0, 512, 1024), short)]
        + [{"method": "truncated", "setting": {"context": 512}, "value": 1.0}],
    )
    _write(
        root,
        "needle_val4",
        "needle",
        [
            {"method": "cepe", "setting": {"total": t, "depth": d}, "value": a, "answer_nll": n}
            for (t, d), (a, n) in needle.items()
        ],
    )
    _write(
        root, "qa_val", "qa", [{"method": "cepe", "setting": {"k": 2}, "value": qa_em, "answer_nll": qa_nll}]
    )
    _write(
        root,
        "lm_val",
        "lm",
        [
            {"method": "cepe", "setting": {"total": t, "domain": "avg"}, "value": v}
            for t, v in zip((1024, 2048), lm)
        ],
    )
    # a reported test set and the foreign-context control are not validation configs: never compared
    _write(root, "fixedppl", "fixedppl", [{"method": "cepe", "setting": {"context": 512}, "value": short[1]}])


def test_cells_verdicts_and_the_replacement_rule(tmp_path, capsys):
    mod = load_script("val_verdict")
    base, cand = tmp_path / "base", tmp_path / "cand"
    _folder(base, (10.0, 8.0, 7.9), {(2048, 0.0): (100, 0.2), (2048, 0.5): (0, 0.4)}, 7.5, 4.0)
    # better at 512, worse at 1024 (mixed); needle mean 50 -> 100 (better), its NLL worse; QA same EM
    _folder(cand, (99.0, 7.5, 8.0), {(2048, 0.0): (100, 0.3), (2048, 0.5): (100, 0.5)}, 7.5, 3.0)
    rows = mod.compare(base, cand, "cepe", 0.0)
    assert {r["config"] for r in rows} == {"fixedppl_val_short", "needle_val4", "qa_val", "lm_val"}
    cells = {(r["config"], r["cell"]): r for r in rows}
    assert ("fixedppl_val_short", "ppl, context 0") not in cells  # the decoder alone is left out
    assert cells["fixedppl_val_short", "ppl, context 512"]["verdict"] == "better"
    assert cells["fixedppl_val_short", "ppl, context 1024"]["verdict"] == "worse"
    assert (
        cells["needle_val4", "accuracy, 2048"]["base"] == 50
        and cells["needle_val4", "accuracy, 2048"]["candidate"] == 100
    )
    assert cells["needle_val4", "answer NLL, 2048"]["candidate"] == pytest.approx(0.4)
    verdicts = mod.config_verdicts(rows)
    assert verdicts == {
        "fixedppl_val_short": ("mixed", ""),
        "lm_val": ("same", ""),
        "needle_val4": ("better", "worse"),
        "qa_val": ("same", "better"),
    }
    assert mod.rule(verdicts)[0] is False
    out = tmp_path / "v/verdict"
    assert mod.main([str(cand), "--base", str(base), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith("no (worse or mixed on fixedppl_val_short: mixed)")
    assert out.with_suffix(".md").read_text() == printed
    assert json.loads(out.with_suffix(".json").read_text())["meta"]["replaces"] is False
    # no config worse, one better: it replaces; a tolerance turns small changes into "same"
    _folder(
        cand, (99.0, 7.5, 7.9), {(2048, 0.0): (100, 0.3), (2048, 0.5): (100, 0.5)}, 7.5, 3.0, lm=(16.1, 13)
    )
    ok, line = mod.rule(mod.config_verdicts(mod.compare(base, cand, "cepe", 0.01)))
    assert ok and line.endswith("yes (better on fixedppl_val_short, needle_val4)")
    assert not mod.rule(mod.config_verdicts(mod.compare(base, cand, "cepe", 0.0)))[0]  # lm_val 16 -> 16.1
    assert not mod.rule({"qa_val": ("same", "better")})[0]  # better on none


def test_a_config_the_candidate_lacks_rules_the_replacement_out(tmp_path, capsys):
    mod = load_script("val_verdict")
    base, cand = tmp_path / "base", tmp_path / "cand"
    _folder(base, (10.0, 8.0, 7.9), {(2048, 0.0): (100, 0.2), (2048, 0.5): (0, 0.4)}, 7.5, 4.0)
    # better everywhere it was evaluated, but its needle evaluation failed (only the log is there)
    _folder(cand, (99.0, 7.5, 7.5), {(2048, 0.0): (100, 0.3)}, 7.5, 3.0, lm=(15, 12))
    for f in (cand / "needle_val4").glob("*.json"):
        f.unlink()
    assert mod.missing(base, cand) == ["needle_val4"]
    verdicts = mod.config_verdicts(mod.compare(base, cand, "cepe", 0.0))
    assert mod.rule(verdicts)[0] is True  # on what both hold it would replace
    ok, line = mod.rule(verdicts, mod.missing(base, cand))
    assert not ok and "not evaluated: needle_val4" in line
    out = tmp_path / "verdict"
    assert mod.main([str(cand), "--base", str(base), "--out", str(out)]) == 0
    meta = json.loads(out.with_suffix(".json").read_text())["meta"]
    assert meta["not_evaluated"] == ["needle_val4"] and meta["replaces"] is False
    assert "not evaluated for the candidate: needle_val4" in capsys.readouterr().out


def test_a_base_config_folder_with_no_result_is_not_compared(tmp_path):
    mod = load_script("val_verdict")
    base, cand = tmp_path / "base", tmp_path / "cand"
    _folder(base, (10.0, 8.0, 7.9), {(2048, 0.0): (100, 0.2)}, 7.5, 4.0)
    _folder(cand, (10.0, 7.5, 7.5), {(2048, 0.0): (100, 0.2)}, 7.5, 4.0)
    for f in (base / "qa_val").glob("*.json"):  # the base's evaluation left only its folder
        f.unlink()
    rows = mod.compare(base, cand, "cepe", 0.0)
    assert "qa_val" not in {r["config"] for r in rows} and "fixedppl_val_short" in {r["config"] for r in rows}
    assert mod.missing(base, cand) == []


def test_bad_folders_are_refused_with_the_reason(tmp_path):
    mod = load_script("val_verdict")
    base, cand = tmp_path / "base", tmp_path / "cand"
    _folder(base, (10.0, 8.0, 7.9), {(2048, 0.0): (100, 0.2)}, 7.5, 4.0)
    cand.mkdir()
    with pytest.raises(SystemExit, match="no validation config in common"):
        mod.compare(base, cand, "cepe", 0.0)
    with pytest.raises(SystemExit, match="no such folder"):
        mod.main([str(tmp_path / "nowhere"), "--base", str(base)])
    _write(cand, "qa_val", "qa", [{"method": "full", "setting": {"k": 2}, "value": 1.0}])
    with pytest.raises(SystemExit, match="no 'cepe' rows in a qa result"):
        mod.compare(base, cand, "cepe", 0.0)
    _write(cand, "lm_val", "icl", [{"method": "cepe", "setting": {}, "value": 1.0}])
    (cand / "qa_val/qa.json").unlink()
    with pytest.raises(SystemExit, match="expected one cepe eval result"):
        mod.compare(base, cand, "cepe", 0.0)


def test_a_change_from_zero_has_no_relative_size_and_the_json_stays_standard(tmp_path):
    mod = load_script("val_verdict")
    base, cand = tmp_path / "base", tmp_path / "cand"
    _folder(base, (10.0, 8.0, 7.9), {(2048, 0.0): (0, 0.2)}, 7.5, 4.0)
    _folder(cand, (10.0, 8.0, 7.9), {(2048, 0.0): (100, 0.2)}, 7.5, 4.0)
    row = {(r["config"], r["cell"]): r for r in mod.compare(base, cand, "cepe", 0.5)}[
        "needle_val4", "accuracy, 2048"
    ]
    assert row["change"] is None and row["verdict"] == "better"  # no tolerance can make 0 -> 100 the same
    out = tmp_path / "v"
    mod.main([str(cand), "--base", str(base), "--out", str(out)])
    assert "Infinity" not in out.with_suffix(".json").read_text()


def test_a_candidate_result_lacking_cells_rules_the_replacement_out(tmp_path):
    """A candidate evaluated on fewer cells (a shorter run: one context length of two) is not compared on
    the cells it has alone: the config is named as not evaluated whole."""
    mod = load_script("val_verdict")
    base, cand = tmp_path / "base", tmp_path / "cand"
    _folder(base, (10.0, 8.0, 7.9), {(2048, 0.0): (100, 0.2)}, 7.5, 4.0)
    _folder(cand, (10.0, 7.5, 7.5), {(2048, 0.0): (100, 0.2)}, 7.5, 3.0, lm=(15, 12))
    rows = json.loads((cand / "fixedppl_val_short/fixedppl.json").read_text())
    rows["rows"] = [r for r in rows["rows"] if r["setting"]["context"] != 1024]  # 1K never ran
    (cand / "fixedppl_val_short/fixedppl.json").write_text(json.dumps(rows))
    absent = mod.missing(base, cand)
    assert absent == ["fixedppl_val_short (lacks 1 of the base's cells, e.g. ppl, context 1024)"]
    ok, line = mod.rule(mod.config_verdicts(mod.compare(base, cand, "cepe", 0.0)), absent)
    assert not ok and "not evaluated: fixedppl_val_short (lacks 1" in line


def test_a_candidate_computed_in_another_precision_rules_the_replacement_out(tmp_path):
    """Where both results record it, a candidate evaluated in another autocast than the base (fp32 on an
    AVX2 machine against the base's bf16) is not compared as if alike; results without it are compared."""
    mod = load_script("val_verdict")
    base, cand = tmp_path / "base", tmp_path / "cand"
    _folder(base, (10.0, 8.0, 7.9), {(2048, 0.0): (100, 0.2)}, 7.5, 4.0)
    _folder(cand, (10.0, 7.5, 7.5), {(2048, 0.0): (100, 0.2)}, 7.5, 3.0, lm=(15, 12))
    assert mod.missing(base, cand) == []
    for root, autocast in ((base, "bfloat16"), (cand, "none")):
        path = root / "qa_val/qa.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "dtype": "fp32", "autocast": autocast}))
    assert mod.missing(base, cand) == ["qa_val (computed with autocast none, the base with bfloat16)"]


def test_the_decoder_alone_differing_between_runs_is_reported_with_their_cpus(tmp_path, capsys):
    """The context-0 cell is the same model under either adapter, so a difference there is the machines'
    rounding: the report gives it and the CPUs the results record, and says nothing where the two agree;
    the rule is unchanged either way."""
    mod = load_script("val_verdict")
    base, cand = tmp_path / "base", tmp_path / "cand"
    _folder(base, (10.129, 8.219, 8.064), {(2048, 0.0): (100, 0.2)}, 7.5, 4.0)
    _folder(cand, (10.129, 8.210, 8.060), {(2048, 0.0): (100, 0.2)}, 7.5, 4.0)
    assert mod.main([str(cand), "--base", str(base)]) == 0
    alike = capsys.readouterr().out
    assert "decoder alone" not in alike and mod.machine_lines(mod.decoder_alone(base, cand)) == []
    _folder(cand, (10.125, 8.210, 8.060), {(2048, 0.0): (100, 0.2)}, 7.5, 4.0)
    for root, cpu in ((base, "Xeon (amx_bf16, avx512_bf16)"), (cand, "EPYC (avx512_bf16)")):
        path = root / "fixedppl_val_short/fixedppl.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "cpu": cpu}))
    out = tmp_path / "verdict"
    assert mod.main([str(cand), "--base", str(base), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "scores 10.129 in the base's fixedppl_val_short and 10.125 in the candidate's (-0.04 %)" in printed
    assert "candidate's (-0.04 %); CPU Xeon (amx_bf16, avx512_bf16) and EPYC (avx512_bf16)." in printed
    note = printed[printed.index("\n\nThe decoder alone") : printed.index("\n\nreplaces")]
    assert (
        printed.replace(note, "") == alike
        and printed.rstrip().splitlines()[-1] == alike.rstrip().splitlines()[-1]
    )
    meta = json.loads(out.with_suffix(".json").read_text())["meta"]
    assert meta["decoder_alone"] == [
        {
            "config": "fixedppl_val_short",
            "base": 10.129,
            "candidate": 10.125,
            "change": pytest.approx(-0.004 / 10.129),
            "base_cpu": "Xeon (amx_bf16, avx512_bf16)",
            "candidate_cpu": "EPYC (avx512_bf16)",
        }
    ]
    # a result that records no CPU says so
    path = base / "fixedppl_val_short/fixedppl.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "cpu"}))
    assert "; CPU not recorded and EPYC (avx512_bf16)." in "\n".join(
        mod.machine_lines(mod.decoder_alone(base, cand))
    )


def test_cpu_model_note_reads_the_model_and_its_bf16_units(tmp_path):
    from cepe.measure import cpu_model_note

    info = tmp_path / "cpuinfo"
    head = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f"
    info.write_text(head + " avx512_bf16\n\nprocessor\t: 1\nmodel name\t: other\n")
    assert cpu_model_note(str(info)) == "AMD EPYC (avx512_bf16)"
    info.write_text("model name\t: Intel(R) Xeon(R)\nflags\t: amx_bf16 avx2 avx512_bf16\n")
    assert cpu_model_note(str(info)) == "Intel(R) Xeon(R) (amx_bf16, avx512_bf16)"
    info.write_text(head + "\n")
    assert cpu_model_note(str(info)) == "AMD EPYC (avx2)"
    info.write_text("processor\t: 0\n")
    assert cpu_model_note(str(info)) is None
    assert cpu_model_note(str(tmp_path / "none")) is None


def _record_cpu(root, cpu, configs=None):
    for path in sorted(root.glob("*/*.json")):
        if configs is None or path.parent.name in configs:
            data = json.loads(path.read_text())
            path.write_text(json.dumps({**data, "cpu": cpu} if cpu else data))


def test_without_base_the_base_run_on_the_candidates_kind_of_cpu_is_chosen(tmp_path, capsys, monkeypatch):
    """CPUs of other kinds round bf16 differently, so a candidate is judged against the shipped adapter's
    run on the kind its results record; where that cannot be told, or no run of that kind exists, the
    default base is used and the report says why."""
    mod = load_script("val_verdict")
    amx, zen, cand = tmp_path / "amx", tmp_path / "zen", tmp_path / "cand"
    _folder(amx, (10.129, 8.0, 7.9), {(2048, 0.0): (100, 0.2)}, 7.5, 4.0)
    _folder(zen, (10.125, 8.3, 8.2), {(2048, 0.0): (100, 0.2)}, 7.5, 4.0)
    _folder(cand, (10.125, 8.1, 8.0), {(2048, 0.0): (100, 0.2)}, 7.5, 4.0)
    _record_cpu(zen, "AMD EPYC (avx512_bf16)")
    bases = {"amx_bf16": str(amx), "avx512_bf16": str(zen)}
    assert mod.cpu_kind("Intel(R) Xeon(R) (amx_bf16, avx512_bf16)") == "amx_bf16"
    assert mod.cpu_kind("AMD EPYC (avx2)") == "avx2" and mod.cpu_kind("AMD EPYC") is None
    assert mod.cpu_kind(None) is None
    # no record: the default, and why
    base, why = mod.choose_base(cand, bases, default=str(amx))
    assert base == str(amx) and why == f"base: the default {amx}, as its results record no CPU"
    # one kind recorded by every result: its run
    _record_cpu(cand, "AMD EPYC (avx512_bf16)")
    assert mod.choose_base(cand, bases, default=str(amx)) == (
        str(zen),
        f"base chosen by the candidate's CPU (avx512_bf16): {zen}",
    )
    # some results without a record, several kinds, or a kind with no run: the default, and why
    _record_cpu(cand, None)
    _folder(cand, (10.125, 8.1, 8.0), {(2048, 0.0): (100, 0.2)}, 7.5, 4.0)
    _record_cpu(cand, "AMD EPYC (avx512_bf16)", configs={"qa_val"})
    assert mod.choose_base(cand, bases, str(amx))[1].endswith(
        "some of its results record no CPU (the others avx512_bf16)"
    )
    _record_cpu(
        cand, "Intel Xeon (amx_bf16, avx512_bf16)", configs={"lm_val", "needle_val4", "fixedppl_val_short"}
    )
    assert mod.choose_base(cand, bases, str(amx))[1].endswith(
        "its results were computed on several kinds of CPU (amx_bf16, avx512_bf16)"
    )
    _record_cpu(cand, "AMD EPYC (avx2)")
    base, why = mod.choose_base(cand, bases, str(amx))
    assert base == str(amx) and "no validation run on avx2: make one with ONLY=" in why
    assert "bash scripts/eval_val.sh adapters/smollm2-135m-cepe OUT" in why
    # the command: without --base the chosen run is the base, and the report and the JSON say so
    _record_cpu(cand, "AMD EPYC (avx512_bf16)")
    monkeypatch.setattr(mod, "BASES", bases)
    out = tmp_path / "verdict"
    assert mod.main([str(cand), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"# validation: {cand} against {zen}\n\nbase chosen by the candidate's CPU")
    assert printed.rstrip().splitlines()[-1].endswith("yes (better on fixedppl_val_short)")
    meta = json.loads(out.with_suffix(".json").read_text())["meta"]
    assert meta["base"] == str(zen) and meta["base_chosen"].startswith("base chosen by the candidate's CPU")
    # given, --base wins and the report has no choice line
    assert mod.main([str(cand), "--base", str(amx)]) == 0
    printed = capsys.readouterr().out
    assert "base chosen" not in printed and printed.rstrip().splitlines()[-1].endswith("better on none)")
