"""scripts/fixedppl_by_source.py: fixed-target perplexity split by source, from result JSONs (no model)."""

from __future__ import annotations

import json
import math

import pytest
from conftest import load_script

SEQS = [
    {"source": "code", "document": "a", "offset": 0},
    {"source": "code", "document": "b", "offset": 0},
    {"source": "books", "document": "c", "offset": 0},
]


def _result(tmp_path, name, per_context, seqs=SEQS, task="fixedppl"):
    rows = [
        {"method": "cepe", "setting": {"context": c, "decoder_window": 8}, "nll_per_sequence": nll}
        for c, nll in per_context.items()
    ]
    rows.append({"method": "truncated", "setting": {"context": 0}, "nll_per_sequence": [9.0, 9.0, 9.0]})
    path = tmp_path / name / "fixedppl.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"task": task, "rows": rows, "sequences": seqs}))
    return str(path)


def test_splits_each_context_by_source_and_counts_the_sequences_each_result_wins(tmp_path, capsys):
    mod = load_script("fixedppl_by_source")
    a = _result(tmp_path, "a", {0: [1.0, 2.0, 3.0], 512: [1.0, 1.0, 2.0]})
    b = _result(tmp_path, "b", {0: [1.0, 2.0, 3.0], 512: [0.5, 1.5, 1.0]})
    out = tmp_path / "t.md"
    assert mod.main([a, b, "--out", str(out)]) == 0
    rows = mod.by_source([mod.load(a, "cepe"), mod.load(b, "cepe")])
    r = {(x["context"], x["source"]): x for x in rows}
    assert r[512, "code"]["n"] == 2 and r[512, "books"]["n"] == 1 and r[512, "all"]["n"] == 3
    assert r[512, "code"]["ppl"] == pytest.approx([math.exp(1.0), math.exp(1.0)])  # one better, one worse
    assert r[512, "code"]["beats_first"] == [0, 1]
    assert r[512, "books"]["ppl"] == pytest.approx([math.exp(2.0), math.exp(1.0)])
    assert r[512, "all"]["ppl"] == pytest.approx([math.exp(4 / 3), math.exp(1.0)])
    assert r[0, "all"]["beats_first"] == [0, 0]  # ties are not wins
    printed = capsys.readouterr().out
    assert out.read_text() == printed and "| 512 | books | 1 | 7.389 | 2.718 | -63.2 %, 1 of 1 |" in printed


def test_refuses_results_of_other_sequences_old_results_and_other_tasks(tmp_path):
    mod = load_script("fixedppl_by_source")
    a = _result(tmp_path, "a", {0: [1.0, 2.0, 3.0]})
    other = _result(
        tmp_path, "b", {0: [1.0, 2.0, 3.0]}, seqs=[*SEQS[:2], {"source": "books", "document": "d"}]
    )
    with pytest.raises(SystemExit, match="other sequences"):
        mod.by_source([mod.load(a, "cepe"), mod.load(other, "cepe")])
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"task": "fixedppl", "rows": [{"method": "cepe", "setting": {"context": 0}}]}))
    with pytest.raises(SystemExit, match="no per-sequence NLLs"):
        mod.load(old, "cepe")
    needle = _result(tmp_path, "c", {0: [1.0, 2.0, 3.0]}, task="needle")
    with pytest.raises(SystemExit, match="not fixedppl"):
        mod.load(needle, "cepe")
    with pytest.raises(SystemExit, match="no rows for method 'replug'"):
        mod.load(a, "replug")
