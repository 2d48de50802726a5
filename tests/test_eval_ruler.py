"""RULER-style tasks: prompt construction, lengths, metrics and the method split, on a tiny random model
with a byte tokenizer (seconds, CPU)."""

import json
import random
import re
from collections import Counter

import pytest

from cepe.eval.api import load_setup, run_task
from cepe.eval.report import write_report
from cepe.eval.tasks import ruler

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


def _docs(n, sentences=60):
    return [
        {
            "id": f"d{i}",
            "text": " ".join(
                f"{WORDS[(i + j) % len(WORDS)].capitalize()} {WORDS[(i * j) % len(WORDS)]} went {j}. Then home."
                for j in range(sentences)
            ),
        }
        for i in range(n)
    ]


def _vocab_docs():
    rng = random.Random(0)
    return [{"text": " ".join("".join(rng.choices("abcdefghij", k=5)) for _ in range(400))}]


def _cfg(**kw):
    cfg = {
        "totals": [1800],
        "samples": 1,
        "decoder_window": 160,
        "chunk_length": 64,
        "replug_piece_length": 256,
        "essays": {"documents": _docs(6)},
        "words": {"documents": _vocab_docs()},
        "qa_source": {"documents": _docs(6)},
        "qa_passage_words": 30,
        "chat_template": False,
        "max_new_tokens": {"niah": 4, "vt": 4, "cwe": 4, "fwe": 4, "qa": 4},
    }
    cfg.update(kw)
    return cfg


@pytest.fixture(scope="module")
def setup():
    pytest.importorskip("cepe.modeling")
    opts = {"streamingllm": {"sink_tokens": 4, "recent_tokens": 120, "stride": 64}}
    return load_setup(
        "tiny", ["cepe", "full", "truncated", "streamingllm", "replug"], method_options=opts, progress=False
    )


@pytest.fixture(scope="module")
def builder(setup):
    from cepe.configio import build

    return ruler.Builder(setup, build(ruler.Config, _cfg()))


@pytest.mark.parametrize("task", ruler.TASK_NAMES)
def test_examples_fit_and_hold_their_answers(builder, task):
    total = 1800
    ex = builder.build(task, total, 0)
    budget = builder.cfg.budget(task, total)  # RULER's: total - its tokens_to_generate
    assert budget == total - ruler.GEN_TOKENS[task.split("_")[0]]
    assert 0.8 * budget <= ex.num_tokens <= budget  # filled up to the budget, never over
    flat = ex.header + [t for u in ex.units for t in u] + ex.question
    assert builder.setup.decode(flat) == ex.text  # the units are the prompt's tokens
    text = ex.text
    if task.startswith("niah"):
        for a in ex.answers:
            assert re.search(rf"for \S+ is: {re.escape(a)}\.", text)
        assert text.count("special magic") >= len(ex.answers) + 2
        if task == "niah_single_1":
            assert text.count(ruler.NOISE) >= 5
    elif task == "vt":
        names = ex.answers
        assert len(names) == 5 and all(re.fullmatch("[A-Z]{5}", n) for n in names)
        value = re.search(rf"VAR {names[0]} = (\d+)", text).group(1)
        for a, b in zip(names, names[1:]):
            assert f"VAR {b} = VAR {a}" in text
        assert f"assigned the value {value} in the text above" in text
    elif task == "cwe":
        main = text[text.rindex("Memorize the ones") :]
        counts = Counter(re.findall(r"\d+\. ([a-z]+)", main.split("Question:")[0]))
        common = {w for w, _ in counts.most_common(10)}
        assert common == set(ex.answers)
        assert min(counts[w] for w in common) > max(c for w, c in counts.items() if w not in common)
    elif task == "fwe":
        body = text.split("coded words. ", 1)[1].split("\nQuestion:")[0]
        counts = Counter(body.split())
        top = [w for w, _ in counts.most_common(4)]
        assert top[0] == "..." and top[1:] == ex.answers
    else:
        assert ex.metric == "part"
        assert ex.answers[0] in text and "Document 1:" in text
        if task == "qa_2":
            person = re.search(r"(\w+) is the \w+ of the \w+ [\w ]+?\.", text).group(1)
            assert f"of {person} is {ex.answers[0]}" in text


def test_examples_are_deterministic_and_differ_by_index(builder):
    a, b, c = (builder.build("niah_single_2", 1800, i) for i in (0, 0, 1))
    assert a.text == b.text and a.answers == b.answers
    assert a.answers != c.answers


def test_metrics():
    assert ruler.string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(
        2 / 3
    )
    assert ruler.string_match_part("it is Leeds", ["leeds", "york"]) == 1.0
    assert ruler.string_match_part("no idea", ["leeds"]) == 0.0
    assert ruler.postprocess("  a\tb\x01c ") == "a\nb\nc"
    assert ruler.cut_at("1234.\n\nMore 5678", ["\n\n"]) == "1234." and ruler.cut_at("x", []) == "x"
    ex = ruler.Example([], [], [], ["ABCDE", "FGHIJ"])
    assert ruler.score(" abcde, fghij", ex) == 1.0 and ruler.score("ABCDE", ex) == 0.5


def test_methods_read_the_same_prompt(builder):
    cfg = builder.cfg
    ex = builder.build("niah_multikey_1", 1800, 0)
    h = len(ex.header)
    full = ruler.make_request("full", ex, cfg).input_ids
    assert full == ex.header + [t for u in ex.units for t in u] + ex.question
    trunc = ruler.make_request("truncated", ex, cfg)
    cepe = ruler.make_request("cepe", ex, cfg)
    assert cepe.input_ids == trunc.input_ids and not trunc.context
    assert len(cepe.input_ids) - h - len(ex.question) <= cfg.decoder_window
    assert all(len(c) <= cfg.chunk_length for c in cepe.context)
    # encoder chunks + the decoder's context tail = the whole context, in order
    assert [t for c in cepe.context for t in c] + cepe.input_ids[h:] == full[h:]
    rep = ruler.make_request("replug", ex, cfg)
    assert all(p[:h] == ex.header for p in rep.context)
    assert [t for p in rep.context for t in p[h:]] + rep.input_ids == full[h:]


def test_run_report_and_oracle(setup, tmp_path, monkeypatch):
    cfg = _cfg(tasks=["niah_single_1", "qa_1"], totals=[1200, 1800])
    r = run_task("ruler", setup, cfg)
    rows = [x for x in r["rows"] if x["setting"]["task"] != "avg"]
    assert len(rows) == 5 * 2 * 2 and all(0 <= x["value"] <= 100 for x in rows)
    assert all(x["tokens_per_s"] > 0 for x in rows)
    assert set(r["heatmaps"]) == set(setup.methods)
    assert len(r["heatmaps"]["cepe"]) == 3 and len(r["heatmaps"]["cepe"][0]) == 2
    paths = write_report({**r, "model": "tiny"}, tmp_path)
    assert json.loads(open(paths["json"]).read())["task"] == "ruler"
    md = open(paths["markdown"]).read()
    assert "| niah_single_1 |" in md and "cepe 1800" in md
    assert open(paths["heatmap"], "rb").read(4) == b"\x89PNG"
    # an oracle that answers with the references scores 100 everywhere: the metric path works
    from cepe.eval.methods import DecoderMethod

    answers = {}
    orig = ruler.make_request

    def spy(method, ex, c):
        req = orig(method, ex, c)
        answers[id(req)] = ex.answers
        return req

    monkeypatch.setattr(ruler, "make_request", spy)
    monkeypatch.setattr(
        DecoderMethod, "generate", lambda self, req, **k: setup.encode(" ".join(answers[id(req)]))
    )
    setup2 = load_setup("tiny", ["cepe", "truncated"], progress=False)
    r2 = run_task("ruler", setup2, cfg)
    assert all(x["value"] == 100.0 for x in r2["rows"])


def test_bad_config(setup):
    with pytest.raises(ValueError, match="unknown task"):
        run_task("ruler", setup, _cfg(tasks=["niah_single_9"]))
    with pytest.raises(ValueError, match="raise the length"):
        run_task("ruler", setup, _cfg(tasks=["vt"], totals=[200]))
    with pytest.raises(ValueError, match="max_new_tokens keys"):
        run_task("ruler", setup, _cfg(max_new_tokens={"needle": 3}))


def test_merge_equals_one_run(setup):
    """Runs of different methods on the same prompts merge into what one run of all of them gives;
    runs of other settings or a repeated method are refused."""
    cfg = _cfg(tasks=["niah_single_1", "vt"], totals=[1800])
    both = run_task("ruler", setup, cfg)
    parts = []
    for method in setup.methods:
        one = load_setup("tiny", [method], method_options=setup.method_options, progress=False)
        parts.append({**run_task("ruler", one, cfg), "methods": [method], "config": cfg, "model": "tiny"})
    merged = ruler.merge(parts)
    key = lambda r: (r["method"], r["setting"]["task"], r["setting"]["total"])  # noqa: E731
    assert {key(r): r["value"] for r in merged["rows"]} == {key(r): r["value"] for r in both["rows"]}
    assert merged["heatmaps"] == both["heatmaps"] and merged["extra_markdown"] == both["extra_markdown"]
    with pytest.raises(ValueError, match="repeats method"):
        ruler.merge([parts[0], parts[0]])
    with pytest.raises(ValueError, match="differs from run 1 in 'config'"):
        ruler.merge([parts[0], {**parts[1], "config": {**cfg, "samples": 2}}])
    # numerics: a reader switched off, or another dtype where both runs record one, is not the same run
    with pytest.raises(ValueError, match="differs from run 1 in 'context_scale'"):
        ruler.merge([parts[0], {**parts[1], "context_scale": 0.0}])
    bf16, fp32 = {"dtype": "bf16", "autocast": "none"}, {"dtype": "fp32", "autocast": "none"}
    with pytest.raises(ValueError, match="differs from run 1 in 'dtype'"):
        ruler.merge([{**parts[0], **fp32}, {**parts[1], **bf16}])
    old_run = ruler.merge([parts[0], {**parts[1], **bf16}])  # the first run recorded none: kept, said
    assert (old_run["dtype"], old_run["autocast"]) == ("bf16", "none")


def test_planted_values_do_not_contain_each_other():
    """QA is scored by containment: a value inside another (7 in 77) would count a wrong answer right."""
    values = [v.lower() for _, vs in ruler._ATTRIBUTES for v in vs]
    assert len(set(values)) == len(values)
    assert not [(a, b) for a in values for b in values if a != b and a in b]
