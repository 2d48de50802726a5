"""The copy probe and the fixed-target perplexity curve on a tiny random model (CPU, seconds)."""

import json
import math

import pytest
import torch

from cepe.eval.api import load_setup, run_task
from cepe.eval.tasks.copy import Config as CopyConfig
from cepe.eval.tasks.copy import passages
from cepe.eval.tasks.fixedppl import Config as FixedConfig

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


def _docs(n, sentences=60):
    return [
        {"id": f"d{i}", "text": " ".join(f"{WORDS[(i * j + j) % len(WORDS)]} {j}." for j in range(sentences))}
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def setup():
    s = load_setup("tiny", ["cepe", "full", "truncated"], progress=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # an untrained adapter has a zero o_proj: give the context an effect
        for m in s.cepe_model.cross_attention_modules():
            m.o_proj.weight.copy_(torch.randn(m.o_proj.weight.shape, generator=g) * 0.5)
    return s


def _fixed(sources, contexts, window, scored, chunk, sequences):
    """A fixedppl task config."""
    return {
        "sources": sources,
        "contexts": contexts,
        "decoder_window": window,
        "eval_tokens": scored,
        "chunk_length": chunk,
        "sequences": sequences,
    }


def _by(rows, **setting):
    return {r["method"]: r["value"] for r in rows if all(r["setting"][k] == v for k, v in setting.items())}


def test_fixedppl_targets_do_not_move(setup):
    cfg = {
        "sources": [{"documents": _docs(3)}],
        "contexts": [0, 64, 128],
        "decoder_window": 48,
        "eval_tokens": 16,
        "chunk_length": 32,
        "sequences": 2,
    }
    rows = run_task("fixedppl", setup, cfg)["rows"]
    assert len(rows) == 9
    at0 = _by(rows, context=0)
    # with no earlier text every method reads exactly the window
    assert at0["cepe"] == pytest.approx(at0["truncated"], rel=1e-5)
    assert at0["full"] == pytest.approx(at0["truncated"], rel=1e-5)
    truncated = [r["value"] for r in rows if r["method"] == "truncated"]
    assert max(truncated) == pytest.approx(min(truncated), rel=1e-6)  # same targets at every length
    assert _by(rows, context=128)["cepe"] != pytest.approx(at0["cepe"], rel=1e-4)  # the context is read


def test_fixedppl_steps_are_paired_over_sequences(setup):
    """Per-sequence NLLs give back each row's perplexity; the steps pair them between context lengths."""
    cfg = {
        "sources": [{"documents": _docs(4)}],
        "contexts": [0, 64, 128],
        "decoder_window": 48,
        "eval_tokens": 16,
        "chunk_length": 32,
        "sequences": 3,
    }
    result = run_task("fixedppl", setup, cfg)
    for r in result["rows"]:
        per = r["nll_per_sequence"]
        assert len(per) == r["n"] == 3
        assert math.exp(sum(per) / len(per)) == pytest.approx(r["value"], rel=1e-12)
    # which document and offset each sequence comes from, in the rows' order: the same draw as the scoring
    from cepe.eval.tasks.fixedppl import fixed_sequences

    docs = {d["id"]: setup.encode(d["text"]) for d in cfg["sources"][0]["documents"]}
    seqs = fixed_sequences(
        list(docs.values()), FixedConfig(**{k: v for k, v in cfg.items() if k != "sources"})
    )
    origin = result["sequences"]
    assert len(origin) == 3 and len({q["document"] for q in origin}) == 3
    assert all(q["source"] == "inline" for q in origin)
    for q, seq in zip(origin, seqs):
        assert docs[q["document"]][q["offset"] : q["offset"] + len(seq)] == seq
    steps = result["steps"]
    assert [(s["method"], s["from"], s["to"]) for s in steps if s["method"] == "cepe"] == [
        ("cepe", 0, 64),
        ("cepe", 64, 128),
    ]
    rows = {(r["method"], r["setting"]["context"]): r for r in result["rows"]}
    for s in steps:
        a, b = rows[(s["method"], s["from"])], rows[(s["method"], s["to"])]
        assert s["delta_nll"] == pytest.approx(math.log(b["value"]) - math.log(a["value"]), abs=1e-12)
        assert s["low"] <= s["delta_nll"] <= s["high"]
        assert s["verdict"] == ("falls" if s["high"] < 0 else "rises" if s["low"] > 0 else "unresolved")
    # truncated never reads the context: every step is exactly zero
    assert all(s["delta_nll"] == s["low"] == s["high"] == 0.0 for s in steps if s["method"] == "truncated")
    assert "paired bootstrap" in result["extra_markdown"] and "| cepe | 0 → 64 |" in result["extra_markdown"]


def test_paired_bootstrap_interval():
    from cepe.eval.metrics import paired_bootstrap

    before = [2.0, 3.0, 1.5, 2.5, 4.0, 3.5]
    after = [b - 0.5 for b in before]  # the same change on every item: the interval is that point
    assert paired_bootstrap(before, after) == pytest.approx((-0.5, -0.5, -0.5))
    after = [1.0, 3.5, 1.0, 2.9, 3.0, 3.6]
    mean, lo, hi = paired_bootstrap(before, after, resamples=4000, seed=3)
    diffs = [b - a for a, b in zip(before, after)]
    assert mean == pytest.approx(sum(diffs) / len(diffs))
    assert min(diffs) < lo < mean < hi < max(diffs)
    assert paired_bootstrap(before, after, resamples=4000, seed=3) == (mean, lo, hi)  # seeded
    narrow = paired_bootstrap(before, after, resamples=4000, seed=3, level=0.5)
    assert lo < narrow[1] <= narrow[2] < hi
    # a normal approximation: the 95 % interval is about mean ± 1.96 sd / sqrt(n)
    import random

    rng = random.Random(0)
    xs = [rng.gauss(0.0, 1.0) for _ in range(400)]
    ys = [x + rng.gauss(0.3, 1.0) for x in xs]
    m, lo, hi = paired_bootstrap(xs, ys, resamples=2000)
    sd = (sum((y - x - m) ** 2 for x, y in zip(xs, ys)) / (len(xs) - 1)) ** 0.5
    assert hi - lo == pytest.approx(2 * 1.96 * sd / len(xs) ** 0.5, rel=0.1)
    with pytest.raises(ValueError, match="match in number"):
        paired_bootstrap([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="at least one"):
        paired_bootstrap([], [])
    with pytest.raises(ValueError, match="level"):
        paired_bootstrap([1.0], [1.0], level=1.0)


def test_copy_probe_matches_hand_computation(setup):
    docs = _docs(2)
    cfg = {
        "sources": [{"documents": docs}],
        "passage_tokens": 40,
        "prefix_tokens": 8,
        "chunk_length": 16,
        "passages_per_domain": 2,
        "shuffle": True,
    }
    rows = run_task("copy", setup, cfg)["rows"]
    assert {(r["setting"]["order"], r["method"]) for r in rows} == {
        (o, m) for o in ("natural", "shuffled") for m in ("cepe", "full", "truncated")
    }
    # the cepe row by hand: passage in the encoder, the passage in the decoder, score after the prefix
    c = CopyConfig(**cfg)
    tokens = [setup.encode(d["text"]) for d in docs]
    model = setup.cepe_model
    nll = 0.0
    for p in passages(tokens, c, shuffled=False):
        ids = torch.tensor([p])
        chunks = torch.tensor([[p[i : i + 16] for i in range(0, 32, 16)]])
        rest = torch.tensor([[p[32:] + [0] * 8]])
        mask = torch.ones(1, 3, 16, dtype=torch.bool)
        mask[0, 2, 8:] = False
        with torch.no_grad():
            logits = model(
                ids, encoder_input_ids=torch.cat([chunks, rest], 1), encoder_attention_mask=mask
            ).logits
        lp = torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        nll -= float(lp[-32:].sum())
    assert _by(rows, order="natural", domain="inline")["cepe"] == pytest.approx(math.exp(nll / 64), rel=1e-4)


def test_configs_reject_bad_sizes():
    with pytest.raises(ValueError, match="prefix_tokens"):
        CopyConfig(passage_tokens=16, prefix_tokens=16)
    for scored in (8, 9):  # the window's first token has no prediction at context 0
        with pytest.raises(ValueError, match="eval_tokens"):
            FixedConfig(decoder_window=8, eval_tokens=scored)


def test_reports_are_written(setup, tmp_path):
    from cepe.eval.report import write_report

    cfg = {"sources": [{"documents": _docs(1)}], "passage_tokens": 24, "prefix_tokens": 4, "chunk_length": 8}
    result = run_task("copy", setup, cfg)
    paths = write_report({**result, "model": "tiny"}, tmp_path, x_key=result.get("plot_x"))
    assert "| cepe |" in open(paths["markdown"]).read()
    cfg = _fixed([{"documents": _docs(1)}], [0, 32], window=24, scored=8, chunk=8, sequences=1)
    result = run_task("fixedppl", setup, cfg)
    paths = write_report({**result, "model": "tiny"}, tmp_path, x_key=result.get("plot_x"))
    assert paths.get("plot") and open(paths["plot"], "rb").read(4) == b"\x89PNG"


def test_fixed_sequences_per_document_do_not_overlap():
    """per_document: several sequences from one long document, disjoint, in order; 1 keeps the old draws."""
    from cepe.eval.tasks.fixedppl import fixed_sequences

    docs = [list(range(1000)), list(range(5000, 5300)), list(range(9000, 9050))]
    one = fixed_sequences(
        docs, FixedConfig(contexts=[0, 200], decoder_window=50, eval_tokens=10, sequences=8)
    )
    assert len(one) == 2 and all(len(s) == 250 for s in one)  # one per long-enough document
    many = fixed_sequences(
        docs, FixedConfig(contexts=[0, 200], decoder_window=50, eval_tokens=10, sequences=8, per_document=3)
    )
    assert len(many) == 4 and all(len(s) == 250 for s in many)  # 3 from the first, 1 from the second
    spans = sorted((s[0], s[-1]) for s in many if s[0] < 1000)
    assert len(spans) == 3 and all(a[1] < b[0] for a, b in zip(spans, spans[1:]))
    assert all(s == list(range(s[0], s[0] + 250)) for s in many)  # contiguous text
    capped = fixed_sequences(
        docs, FixedConfig(contexts=[0, 200], decoder_window=50, eval_tokens=10, sequences=2, per_document=3)
    )
    assert len(capped) == 2
    with pytest.raises(ValueError, match="per_document"):
        FixedConfig(per_document=0)


def test_cepe_chunks_each_piece_at_the_adapters_chunk_length():
    """A task's ``chunk_length`` cuts the context into pieces; CEPE encodes each piece in chunks of its
    adapter's ``chunk_length`` (a longer piece split further, a shorter one padded), unless the method's
    own option overrides it."""
    from types import SimpleNamespace

    from cepe.eval.methods import CepeMethod, Request

    model = torch.nn.Linear(2, 2)
    model.cepe_config = SimpleNamespace(chunk_length=4)
    req = Request(input_ids=[1, 2, 3], context=[list(range(1, 11)), [7, 8]], max_new_tokens=1)
    ids, mask = CepeMethod(model, pad_token_id=0).encoder_inputs([req])
    assert ids.shape == (1, 4, 4)  # 10 tokens -> 3 chunks of 4 (the last padded), 2 tokens -> 1 padded chunk
    assert mask.sum(-1).tolist() == [[4, 4, 2, 2]]
    assert ids[mask].tolist() == list(range(1, 11)) + [7, 8]
    ids, mask = CepeMethod(model, chunk_length=16, pad_token_id=0).encoder_inputs([req])
    assert ids.shape == (1, 2, 16) and mask.sum(-1).tolist() == [[10, 2]]


def test_foreign_context_reads_another_documents_text(setup):
    """``foreign_context`` keeps every sequence's window and targets and gives it the context of the next
    sequence of its source from another document: the decoder alone scores the same, full context
    scores what the donor's text before the window gives, and with a 0-token context nothing changes."""
    from cepe.eval.tasks.fixedppl import foreign_donors

    sources = [{"documents": _docs(3), "name": "a"}, {"documents": _docs(2, 70), "name": "b"}]
    base = _fixed(sources, [0, 64], window=48, scored=16, chunk=32, sequences=5)
    own = run_task("fixedppl", setup, base)
    foreign = run_task("fixedppl", setup, {**base, "foreign_context": True})
    assert foreign["sequences"] == own["sequences"]  # the same targets
    donors = foreign["context_from"]
    seqs = own["sequences"]
    for i, d in enumerate(donors):
        assert (
            d != i and seqs[d]["source"] == seqs[i]["source"] and seqs[d]["document"] != seqs[i]["document"]
        )
    assert "context_from" not in own
    for method in ("truncated", "cepe", "full"):
        assert _by(foreign["rows"], context=0)[method] == pytest.approx(_by(own["rows"], context=0)[method])
    assert _by(foreign["rows"], context=64)["truncated"] == pytest.approx(
        _by(own["rows"], context=64)["truncated"]
    )
    for method in ("cepe", "full"):
        assert _by(foreign["rows"], context=64)[method] != pytest.approx(_by(own["rows"], context=64)[method])
    order = [("a", "x"), ("a", "y"), ("b", "z"), ("b", "z"), ("a", "x")]
    donors, notes = foreign_donors([{"source": s, "document": d} for s, d in order])
    assert donors == [1, 4, 3, 2, 1]  # b's sequences share one document: each takes the other part
    assert len(notes) == 1 and "'b'" in notes[0]
    with pytest.raises(ValueError, match="single sequence"):
        foreign_donors([{"source": "a", "document": "x"}, {"source": "b", "document": "x"}])


def test_a_report_whose_plot_fails_keeps_its_numbers(setup, tmp_path, monkeypatch):
    """A plot that fails while being written (a full disk) leaves no partial PNG (written atomically) and
    costs no result: the markdown and the JSON, which scripts take as the evaluation's being done, are
    written after it, with a warning."""
    import matplotlib.figure

    from cepe.eval.report import write_report

    cfg = _fixed([{"documents": _docs(1)}], [0, 32], window=24, scored=8, chunk=8, sequences=1)
    result = {**run_task("fixedppl", setup, cfg), "model": "tiny"}

    def broken(self, fname, **kw):
        open(fname, "wb").write(b"\x89PNG half")
        raise OSError("disk full")

    (tmp_path / "fixedppl.png").write_bytes(b"\x89PNG an earlier run's")  # not left beside new numbers
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", broken)
    with pytest.warns(UserWarning, match="not written: OSError: disk full"):
        paths = write_report(result, tmp_path, x_key=result.get("plot_x"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fixedppl.json", "fixedppl.md"]
    assert "plot" not in paths and json.loads(open(paths["json"]).read())["task"] == "fixedppl"


def test_report_leaves_no_plot_of_an_earlier_run(tmp_path):
    """Plots this run does not draw (a method no longer in it, a result with nothing to plot) are removed,
    so no plot in a results folder disagrees with the JSON beside it; other files stay."""
    from cepe.eval.report import write_report

    grid = [[1.0, 0.0], [0.5, 1.0]]
    needle = {"task": "needle", "rows": [], "totals": [64, 128], "depths": [0.0, 0.5]}
    write_report({**needle, "grids": {"cepe": grid, "full": grid}}, tmp_path)
    (tmp_path / "notes.png").write_bytes(b"\x89PNG mine")
    assert (tmp_path / "needle_full.png").exists()
    write_report({**needle, "grids": {"cepe": grid}}, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["needle_cepe.png", "notes.png"]
    row = {"method": "cepe", "setting": {"total": 64}, "metric": "ppl", "value": 3.0}
    write_report({"task": "lm", "rows": [row]}, tmp_path, x_key="total")
    assert (tmp_path / "lm.png").exists()
    write_report({"task": "lm", "rows": []}, tmp_path, x_key="total")
    assert not (tmp_path / "lm.png").exists()


def test_lm_plot_draws_one_line_per_method_and_domain():
    """lm's decoder window follows from the total (``decoder_window_overrides``): it splits no line."""
    from cepe.eval.report import line_series

    rows = [
        {
            "method": "cepe",
            "setting": {"total": t, "domain": "acl", "decoder_window": w},
            "metric": "ppl",
            "value": v,
        }
        for t, w, v in ((1024, 512, 9.0), (2048, 512, 8.0), (4096, 1024, 7.0))
    ]
    result = {"task": "lm", "rows": rows, "plot_ignore": ["decoder_window"]}
    series, ylabel = line_series(result, "total", ignore=result["plot_ignore"])
    assert series == {"cepe (domain=acl)": [(1024.0, 9.0), (2048.0, 8.0), (4096.0, 7.0)]} and ylabel == "ppl"
    assert len(line_series(result, "total")[0]) == 2  # without: one series per window
