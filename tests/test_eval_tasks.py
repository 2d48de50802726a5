"""Every task end to end on a tiny random model with a byte tokenizer (seconds each, CPU)."""

import json

import pytest

from cepe.eval.api import load_setup, run_task
from cepe.eval.report import write_report

ALL = ["cepe", "full", "truncated", "streamingllm", "replug"]
OPTS = {
    "streamingllm": {"sink_tokens": 4, "recent_tokens": 120, "stride": 64},
    "replug": {"temperature": 1.0},
}
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


def _docs(n, sentences=20, label=None):
    out = []
    for i in range(n):
        text = " ".join(
            f"{WORDS[(i + j) % len(WORDS)].capitalize()} {WORDS[(i * j) % len(WORDS)]} {j}."
            for j in range(sentences)
        )
        d = {"id": f"doc{i}", "text": text, "title": f"T{i}"}
        if label:
            d["label"] = label[i % len(label)]
        out.append(d)
    return out


@pytest.fixture(scope="module")
def setup():
    return load_setup("tiny", ALL, method_options=OPTS, progress=False)


def _check(result, tmp_path, metric):
    rows = result["rows"]
    assert {r["method"] for r in rows} == set(ALL)
    for r in rows:
        assert r["metric"].startswith(metric)
        if "tokens_per_s" in r:
            assert r["tokens_per_s"] > 0 and r["peak_memory_mb"] > 0
    paths = write_report({**result, "model": "tiny"}, tmp_path, x_key=result.get("plot_x"))
    assert json.loads(open(paths["json"]).read())["task"] == result["task"]
    lines = open(paths["markdown"]).read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []  # the rows' table: the first block of table lines (a task may add more tables below it)
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append(line)
    head = [c.strip() for c in table[0].strip("|").split("|")]
    assert head[-6:] == ["method", "metric", "value", "n", "tokens/s", "peak MB"]
    body = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    assert len(body) == len(rows)  # one table line per result row, in order, with its value
    for cells, r in zip(body, rows):
        assert cells[head.index("method")] == r["method"] and cells[head.index("metric")] == r["metric"]
        if isinstance(r["value"], float) and r["value"] == r["value"]:  # NaN is written "-"
            assert float(cells[head.index("value")]) == pytest.approx(r["value"], rel=1e-2, abs=1e-2)
    return paths


def test_lm(setup, tmp_path):
    cfg = {
        "sources": [{"name": "toy", "documents": _docs(3)}],
        "totals": [200, 300],
        "decoder_window": 128,
        "decoder_window_overrides": {200: 96},
        "eval_tokens": 32,
        "chunk_length": 32,
        "sequences_per_domain": 2,
    }
    r = run_task("lm", setup, cfg)
    paths = _check(r, tmp_path, "ppl")
    assert "plot" in paths
    assert any(row["setting"]["domain"] == "avg" for row in r["rows"])
    # CEPE with a zero-initialised cross-attention output equals the truncated decoder
    val = {(x["method"], x["setting"]["total"], x["setting"]["domain"]): x["value"] for x in r["rows"]}
    assert val[("cepe", 200, "toy")] == pytest.approx(val[("truncated", 200, "toy")], rel=1e-4)
    # deterministic
    r2 = run_task("lm", setup, cfg)
    assert [x["value"] for x in r2["rows"]] == [x["value"] for x in r["rows"]]


def test_ralm(setup, tmp_path):
    cfg = {
        "sources": [{"name": "toy", "documents": _docs(24)}],
        "test_fraction": 0.3,
        "retrieval_fraction": 0.7,
        "seq_length": 160,
        "query_tokens": 48,
        "passage_tokens": 40,
        "ks": [2],
        "sequences_per_domain": 2,
    }
    r = run_task("ralm", setup, cfg)
    _check(r, tmp_path, "ppl")


def test_ralm_retrieves_no_copy_of_a_test_document(setup):
    """A retrieval-split document whose text is a test document's (another id, other whitespace) is not a
    passage: it would hand the test sequence its own continuation."""
    from cepe.data.split import SplitFractions, assign_split
    from cepe.eval.tasks import ralm

    docs = _docs(24)
    fr = SplitFractions(test=0.3, retrieval=0.7)
    sides = [assign_split(d["id"], 1, fr) for d in docs]
    test_doc = next(d for d, s in zip(docs, sides) if s == "test")
    copy_at = next(i for i, s in enumerate(sides) if s == "retrieval")
    cfg = ralm.Config(
        sources=[{"name": "toy", "documents": docs}], test_fraction=0.3, retrieval_fraction=0.7, seq_length=16
    )
    _, passages = ralm._documents(setup, cfg)
    docs[copy_at] = {**docs[copy_at], "text": "\n".join(test_doc["text"].split(" "))}
    _, without = ralm._documents(setup, cfg)
    copied = setup.encode(docs[copy_at]["text"])[: cfg.passage_tokens]
    assert copied not in without and setup.encode(test_doc["text"])[: cfg.passage_tokens] not in without
    assert len(without) < len(passages)
    # a separate retrieval corpus holding the test document: the same
    own = ralm.Config(**{**cfg.__dict__, "retrieval_sources": [{"documents": [dict(test_doc, id="other")]}]})
    _, retrieved = ralm._documents(setup, own)
    assert retrieved == []
    # a test document that repeats a training document's text is no test
    docs, fr = _docs(24), SplitFractions(test=0.3, retrieval=0.3)
    sides = [assign_split(d["id"], 1, fr) for d in docs]
    trained = next(d for d, s in zip(docs, sides) if s == "train")
    at = next(i for i, s in enumerate(sides) if s == "test")
    cfg = ralm.Config(
        sources=[{"name": "toy", "documents": docs}], test_fraction=0.3, retrieval_fraction=0.3, seq_length=16
    )
    before = ralm._documents(setup, cfg)[0]["toy"]
    docs[at] = {**docs[at], "text": trained["text"] + "  "}
    after = ralm._documents(setup, cfg)[0]["toy"]
    assert len(after) == len(before) - 1 and setup.encode(trained["text"]) not in after


def test_qa(setup, tmp_path):
    cfg = {
        "synthetic": {"source": {"documents": _docs(6)}, "num_questions": 2, "passage_words": 15},
        "ks": [3],
        "decoder_passages": 1,
        "max_new_tokens": 3,
    }
    r = run_task("qa", setup, cfg)
    paths = _check(r, tmp_path, "em")
    for row in r["rows"]:  # every question counted once, in the place its passage has for the method
        n = row["n_by_place"]
        assert sum(n.values()) == row["n"] == 2 and row["answer_nll"] > 0
        assert set(n) <= {"decoder", "encoder", "absent"}
        assert ("encoder" in n) <= (row["method"] in ("cepe", "replug"))
        mean = sum(row["answer_nll_by_place"][p] * n[p] for p in n) / row["n"]
        assert mean == pytest.approx(row["answer_nll"], abs=1e-3)
    assert "Gold answers, teacher-forced" in open(paths["markdown"]).read()


def test_qa_demonstration_passage_choice():
    """``demo_passage: answer`` shows each demonstration the passage that holds its answer (the synthetic
    set plants it at a random rank); ``top`` its first passage, as recorded; anything else is refused."""
    from cepe.eval.tasks.qa import Config, demo_context, synthetic_qa

    data = synthetic_qa({"documents": _docs(12)}, 20, 5, passage_words=15)
    shown = [demo_context(d["ctxs"], "answer") for d in data]
    assert all(d["answers"][0] in c["text"] for d, c in zip(data, shown))
    top = [demo_context(d["ctxs"], "top") for d in data]
    assert top == [d["ctxs"][0] for d in data] and sum(c.get("has_answer", False) for c in top) < 20
    assert demo_context([{"text": "x"}], "answer") == {"text": "x"} and demo_context([], "top") is None
    with pytest.raises(ValueError, match="demo_passage must be 'top' or 'answer'"):
        Config(demo_passage="gold")


def test_qa_questions_do_not_depend_on_the_largest_k(setup):
    """``synthetic.num_passages`` fixes the questions whatever the ks (default: the largest k, as recorded);
    the synthetic passages carry no scores (REPLUG weighs its passes uniformly); a k beyond the passages
    and an unknown key are refused."""
    from cepe.eval.tasks import qa

    seen = []
    real = qa.synthetic_qa
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qa, "synthetic_qa", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1][:0])
        syn = {"source": {"documents": _docs(6)}, "num_questions": 3, "passage_words": 15}
        for ks, n in (([2, 4], None), ([2], 4), ([2], None)):
            extra = {} if n is None else {"num_passages": n}
            qa.run(setup, qa.Config(synthetic={**syn, **extra}, ks=ks, decoder_passages=1))
    assert seen[0] == seen[1] != seen[2]
    assert all("score" not in c for d in seen[0] for c in d["ctxs"])
    with pytest.raises(ValueError, match="more passages than synthetic.num_passages"):
        qa.run(setup, qa.Config(synthetic={**syn, "num_passages": 3}, ks=[2, 4]))
    with pytest.raises(ValueError, match="unknown synthetic QA key"):
        qa.run(setup, qa.Config(synthetic={**syn, "passages": 3}, ks=[2]))


def test_qa_answer_place_and_likelihood():
    """``answer_place`` puts the answer's passage where each method reads it; the forced answer NLL is
    the decoder's own cross-entropy of the gold answer after the prompt (truncated), and CEPE with its
    context switched off scores exactly that."""
    import torch

    from cepe.eval.tasks.qa import answer_place

    ctxs = [{"text": "a"}, {"text": "b"}, {"text": "c", "has_answer": True}, {"text": "d"}]
    ex = {"ctxs": ctxs}
    assert answer_place(ex, 4, 2, "cepe") == "encoder" and answer_place(ex, 4, 2, "truncated") == "absent"
    assert answer_place(ex, 4, 4, "full") == "decoder" and answer_place(ex, 2, 2, "cepe") == "absent"
    assert answer_place(ex, 4, 3, "cepe") == "decoder" and answer_place(ex, 4, 2, "replug") == "encoder"
    assert answer_place({"ctxs": ctxs[:2]}, 2, 1, "cepe") is None

    cfg = {
        "synthetic": {"source": {"documents": _docs(6)}, "num_questions": 1, "passage_words": 15},
        "ks": [3],
        "decoder_passages": 1,
        "max_new_tokens": 2,
    }
    tiny = load_setup("tiny", ["cepe", "truncated"], progress=False)
    tiny.cepe_model.cepe_config.context_scale = 0.0
    by = {row["method"]: row for row in run_task("qa", tiny, cfg)["rows"]}
    assert by["cepe"]["answer_nll"] == pytest.approx(by["truncated"]["answer_nll"], abs=1e-5)
    # the truncated row by hand: demonstrations, the first passage, the question, then the gold answer
    from cepe.eval.tasks.qa import Config, synthetic_qa

    c = Config(**cfg)
    demos, (ex,) = (lambda d: (d[:2], d[2:]))(synthetic_qa({"documents": _docs(6)}, 3, 3, 15, seed=0))
    text = "".join(
        c.passage_template.format(title=d["ctxs"][0]["title"], text=d["ctxs"][0]["text"])
        + c.question_template.format(question=d["question"])
        + c.demo_answer_template.format(answer=d["answers"][0])
        for d in demos
    )
    ids = tiny.encode(text) + tiny.encode(
        c.passage_template.format(title=ex["ctxs"][0]["title"], text=ex["ctxs"][0]["text"])
    )
    ids += tiny.encode(c.question_template.format(question=ex["question"]))
    gold = tiny.encode(" " + ex["answers"][0])
    with torch.no_grad():
        logits = tiny.cepe_model.decoder(input_ids=torch.tensor([ids + gold])).logits[0, -len(gold) - 1 : -1]
    nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(gold)).item()
    assert by["truncated"]["answer_nll"] == pytest.approx(nll, abs=1e-3)
    place = answer_place(ex, 3, 1, "truncated")
    assert by["truncated"]["n_by_place"] == {place: 1}


def test_icl(setup, tmp_path):
    cfg = {
        "source": {"documents": _docs(30, sentences=3, label=["sport", "tech", "arts"])},
        "test_fraction": 0.3,
        "encoder_demos": [3],
        "test_size": 3,
        "seeds": [0],
        "max_text_tokens": 24,
    }
    r = run_task("icl", setup, cfg)
    _check(r, tmp_path, "accuracy")
    assert set(r["rows"][0]["variants"]) == {"ll", "ll_norm", "pmi", "pmi_norm"}
    for row in r["rows"]:  # how often each label was predicted: one prediction per test input
        assert set(row["predicted"]) == {"arts", "sport", "tech"} and sum(row["predicted"].values()) == 3


def test_longdoc(setup, tmp_path):
    path = tmp_path / "docs.jsonl"
    with open(path, "w") as f:
        for d in _docs(2, sentences=30):
            f.write(
                json.dumps({"document": d["text"], "instruction": "Summarise.", "answers": ["alpha beta"]})
                + "\n"
            )
    cfg = {
        "path": str(path),
        "decoder_window": 96,
        "chunk_length": 32,
        "max_new_tokens": 4,
        "chat_template": False,
    }
    r = run_task("longdoc", setup, cfg)
    _check(r, tmp_path, "rouge_l")


def test_longdoc_sampling_does_not_depend_on_the_methods_run_before(tmp_path):
    """With ``do_sample`` a method's sampled answers are the same alone or after another method."""
    path = tmp_path / "docs.jsonl"
    path.write_text(
        "".join(
            json.dumps({"document": d["text"], "instruction": "Summarise.", "answers": ["alpha"]}) + "\n"
            for d in _docs(2, sentences=20)
        )
    )
    cfg = {
        "path": str(path),
        "decoder_window": 64,
        "chunk_length": 32,
        "max_new_tokens": 6,
        "chat_template": False,
        "sampling": {"do_sample": True, "top_p": 0.95, "temperature": 1.0},
    }
    answers = {}
    for methods in (["full"], ["truncated", "full"]):
        s = load_setup("tiny", methods, progress=False)
        said: list[str] = []
        decode = s.decode
        s.decode = lambda ids, _d=decode, _s=said: _s.append(_d(ids)) or _s[-1]
        run_task("longdoc", s, cfg)
        answers[len(methods)] = said[-2:]  # full's two answers
    assert answers[1] == answers[2]


def test_longdoc_zeroscrolls_records_keep_their_instructions(setup, tmp_path, monkeypatch):
    """A ZeroSCROLLS record's task instructions come before the document, its separator, query and answer
    opening after it, as the record has them (not the query alone with a second "Answer:")."""
    from cepe.eval.tasks import longdoc

    prompt, doc = (
        "Answer as concisely as you can; write unanswerable if you cannot.\n\nStory:\n",
        "DOC TEXT " * 20,
    )
    tail = "\n\nQuestion:\nWhat is X?\n\nAnswer:"
    text = prompt + doc + tail
    record = {
        "input": text,
        "output": "X",
        "document_start_index": len(prompt),
        "document_end_index": len(prompt) + len(doc),
        "query_start_index": len(prompt) + len(doc) + len("\n\nQuestion:\n"),
    }
    path = tmp_path / "zs.jsonl"
    path.write_text(json.dumps(record) + "\n")
    (ex,) = longdoc.read_longdoc(path)
    assert (ex["prefix"], ex["document"], ex["instruction"]) == (prompt, doc, tail)
    seen = []
    real = longdoc.longdoc_request

    def spy(method, pre, d, suf, cfg):
        seen.append((setup.decode(pre), setup.decode(suf)))
        return real(method, pre, d, suf, cfg)

    monkeypatch.setattr(longdoc, "longdoc_request", spy)
    cfg = {
        "path": str(path),
        "decoder_window": 128,
        "chunk_length": 32,
        "max_new_tokens": 2,
        "chat_template": False,
    }
    run_task("longdoc", setup, cfg)
    assert seen and all(p == prompt and s == tail for p, s in seen)


def test_needle(setup, tmp_path):
    cfg = {
        "haystack": {"documents": _docs(4, sentences=40)},
        "totals": [200, 300],
        "depths": [0.0, 1.0],
        "decoder_window": 96,
        "chunk_length": 32,
        "max_new_tokens": 4,
        "chat_template": False,
        "score_scaling": "yarn",
        "train_context_tokens": 100,
    }
    r = run_task("needle", setup, cfg)
    paths = _check(r, tmp_path, "accuracy")
    assert "heatmap_cepe" in paths
    assert len(r["grids"]["cepe"]) == 2 and len(r["grids"]["cepe"][0]) == 2
    assert setup.cepe_model.cepe_config.score_scaling == "none"  # restored
    for row in r["rows"]:  # the generated answer is kept, and it is what was scored
        assert isinstance(row["answer"], str)
        keys = [k.lower() for k in cfg.get("answer_keywords", ["sandwich", "Dolores Park"])]
        assert row["value"] == 100.0 * sum(k in row["answer"].lower() for k in keys) / len(keys)


def test_bad_settings_leave_the_model_as_it_was(setup):
    """A needle run with score scaling but no training length is refused before the shared model's config
    changes; an ICL template without {text} before {label} is refused with a message that says so."""
    cc = setup.cepe_model.cepe_config
    before = (cc.score_scaling, cc.train_context_tokens)
    assert not cc.train_context_tokens
    base = {"haystack": {"documents": _docs(2, sentences=10)}, "totals": [200], "depths": [0.0]}
    with pytest.raises(ValueError, match="train_context_tokens"):
        run_task("needle", setup, {**base, "decoder_window": 96, "chunk_length": 32, "score_scaling": "yarn"})
    assert (cc.score_scaling, cc.train_context_tokens) == before
    icl = {
        "source": {"documents": _docs(30, sentences=3, label=["sport", "tech"])},
        "test_size": 2,
        "seeds": [0],
    }
    for bad in ("Topic: {label}\nArticle: {text}", "Article: {text}", "Topic: {label}"):
        with pytest.raises(ValueError, match="must hold {text} once and then {label} once"):
            run_task("icl", setup, {**icl, "template": bad})


def test_cli_end_to_end(tmp_path, capsys):
    import yaml

    from cepe.cli import main

    cfg = tmp_path / "lm.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "sources": [{"name": "toy", "documents": _docs(2)}],
                "totals": [160],
                "decoder_window": 96,
                "decoder_window_overrides": {},
                "eval_tokens": 16,
                "chunk_length": 32,
                "sequences_per_domain": 1,
                "methods": {"streamingllm": {"recent_tokens": 64, "stride": 32}},
            }
        )
    )
    rc = main(
        [
            "eval",
            "lm",
            "--model",
            "tiny",
            "--config",
            str(cfg),
            "--methods",
            "cepe,truncated,streamingllm",
            "--out",
            str(tmp_path / "out"),
            "--no-progress",
        ]
    )
    assert rc == 0
    assert (tmp_path / "out" / "lm.json").exists() and (tmp_path / "out" / "lm.png").exists()
    written = json.loads((tmp_path / "out" / "lm.json").read_text())
    assert (written["dtype"], written["autocast"]) == ("fp32", "none")  # what the numbers were computed in
    assert main(["eval", "lm", "--model", "tiny", "--config", str(tmp_path / "missing.yaml")]) == 2


def test_shipped_configs_parse():
    import glob
    import importlib

    from cepe.configio import build, read_config_file

    files = sorted(glob.glob("configs/eval/*.yaml"))
    assert files
    for f in files:
        data = read_config_file(f)
        data.pop("methods", None)
        task = f.split("/")[-1].split(".")[0].split("_")[0]  # lm_paper, fixedppl_long -> the task
        build(importlib.import_module(f"cepe.eval.tasks.{task}").Config, data, f)
    with pytest.raises(ValueError, match=r"unknown lm config keys \['totalz'\]"):
        build(importlib.import_module("cepe.eval.tasks.lm").Config, {"totalz": [1]}, "lm config")


def test_needle_forced_answer(setup):
    """``answer_nll`` is the teacher-forced NLL of the forced answer after the prompt and forced prefix:
    for the truncated decoder it equals the decoder's own cross-entropy on the same tokens."""
    import torch

    from cepe.eval.tasks.needle import Config, build_haystack, needle_request, wrap_prompt

    docs = _docs(4, sentences=40)
    cfg = {
        "haystack": {"documents": docs},
        "totals": [200],
        "depths": [0.5],
        "decoder_window": 96,
        "chunk_length": 32,
        "max_new_tokens": 2,
        "chat_template": False,
        "forced_prefix": " The best thing",
        "forced_answer": " is eat a sandwich.",
    }
    r = run_task("needle", setup, cfg)
    rows = {row["method"]: row for row in r["rows"]}
    assert all(row["answer_nll"] > 0 for row in rows.values())
    # recompute the truncated row by hand
    from cepe.eval.common import split_sentences

    c = Config(**cfg)
    sentences = [setup.encode(s) for d in docs for s in split_sentences(d["text"])]
    needle = setup.encode(c.needle.strip() + " ")
    before, _ = wrap_prompt(setup, False)
    suf = setup.encode(f"\n\n{c.question}\n{c.answer_prefix}")
    req = needle_request(
        "truncated", build_haystack(sentences, needle, 200, 0.5), setup.encode(before), suf, c
    )
    target = setup.encode(c.forced_answer)
    ids = torch.tensor([req.input_ids + setup.encode(c.forced_prefix) + target])
    with torch.no_grad():
        logits = setup.cepe_model.decoder(input_ids=ids).logits[0, -len(target) - 1 : -1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(target)).item()
    assert rows["truncated"]["answer_nll"] == pytest.approx(nll, abs=1e-3)


def test_icl_validation_split_never_reads_the_test_part():
    """split val: queries from a part of the training documents, demonstrations from the rest; the test
    split's demonstrations stay the whole training part in source order."""
    from cepe.eval.tasks.icl import Config, _load

    docs = [{"id": f"d{i}", "text": f"document number {i}", "label": "abc"[i % 3]} for i in range(60)]
    base = {"source": {"documents": docs}, "test_fraction": 0.3, "val_fraction": 0.3}
    train, test = _load(Config(**base))
    rest, val = _load(Config(**base, split="val"))
    key = lambda rows: {r["text"] for r in rows}  # noqa: E731
    assert val and rest and not key(val) & key(test) and not key(val) & key(rest)
    assert key(rest) | key(val) == key(train) and len(train) + len(test) == 60
    assert [r for r in train if r["text"] in key(rest)] == rest
    with pytest.raises(ValueError, match="split"):
        _load(Config(**base, split="dev"))


def test_icl_demonstrations_never_repeat_a_query():
    """A source holding one article under two ids (one in the test part, one in the demonstrations) does
    not show a query its own text as a demonstration; with nothing to pass over the draws are unchanged."""
    from cepe.eval.common import text_key
    from cepe.eval.tasks.icl import balanced_demos

    train = [{"text": f"article {i}", "label": "ab"[i % 2]} for i in range(20)]
    drawn = balanced_demos(train, 6, seed=3)
    assert balanced_demos(train, 6, seed=3, exclude={text_key("no such article")}) == drawn
    twice = {text_key("  " + drawn[0]["text"].replace(" ", "\n"))}  # the same text laid out differently
    again = balanced_demos(train, 6, seed=3, exclude=twice)
    assert drawn[0] not in again and len(again) == 6 and again[0]["label"] == drawn[0]["label"]


def test_eval_context_scale_overrides_the_adapter(tmp_path, monkeypatch):
    """``cepe eval ... --context-scale`` sets the adapter's multiplier for the run and records it; 0 makes
    CEPE score exactly what the truncated decoder scores; a negative value is refused."""
    from conftest import randomize_cross

    import cepe.tiny
    from cepe.cli import main

    plain_tiny_cepe = cepe.tiny.tiny_cepe

    def reading_tiny_cepe(decoder):  # cross-attention that changes the output (o_proj is zero at init)
        model = plain_tiny_cepe(decoder)
        randomize_cross(model)
        return model

    monkeypatch.setattr(cepe.tiny, "tiny_cepe", reading_tiny_cepe)

    cfg = tmp_path / "lm.yaml"
    cfg.write_text(
        json.dumps(
            {
                "sources": [{"name": "toy", "documents": _docs(3)}],
                "totals": [200],
                "decoder_window": 96,
                "eval_tokens": 32,
                "chunk_length": 32,
                "sequences_per_domain": 1,
            }
        )
    )

    def run(out, *extra):
        argv = ["eval", "lm", "--model", "tiny", "--config", str(cfg), "--methods", "cepe,truncated"]
        assert main([*argv, "--out", str(tmp_path / out), "--no-progress", *extra]) == 0
        res = json.loads((tmp_path / out / "lm.json").read_text())
        return res, {r["method"]: r["value"] for r in res["rows"]}

    res0, ppl0 = run("zero", "--context-scale", "0")
    res1, ppl1 = run("plain")
    assert res0["context_scale"] == 0.0 and "context_scale" not in res1
    assert ppl0["cepe"] == ppl0["truncated"] == ppl1["truncated"]
    assert ppl1["cepe"] != ppl0["cepe"]
    assert main(["eval", "lm", "--model", "tiny", "--config", str(cfg), "--context-scale", "-0.5"]) == 2


def test_qa_validation_set_reads_only_its_split():
    """A synthetic QA source with ``split`` (configs/eval/qa_val.yaml) cuts every passage, the planted
    fact's host included, from documents of that split only."""
    from cepe.data.split import SplitFractions, assign_split
    from cepe.eval.tasks.qa import synthetic_qa

    docs = [{"id": f"d{i}", "text": " ".join(f"w{i}x{j}." for j in range(40))} for i in range(80)]
    spec = {"split": "retrieval", "split_seed": 1, "test_fraction": 0.3, "retrieval_fraction": 0.3}
    fr = SplitFractions(test=0.3, retrieval=0.3)
    held = {d["id"] for d in docs if assign_split(d["id"], 1, fr) == "retrieval"}
    assert 0 < len(held) < len(docs)
    data = synthetic_qa(
        {"documents": docs, **spec}, num_questions=6, num_passages=4, passage_words=10, seed=1
    )
    sources = {
        w.split("x")[0] for ex in data for c in ex["ctxs"] for w in c["text"].split() if w.startswith("w")
    }
    assert sources and sources <= {"w" + h[1:] for h in held}
    assert all(ex["ctxs"][ex["gold_rank"]].get("has_answer") for ex in data)


def test_each_item_returns_the_allocators_kept_pages(setup, monkeypatch):
    """On a CPU, run_examples purges jemalloc's kept pages after every item (cepe.alloc.purge; a no-op
    under another malloc), so an evaluation under scripts/fast_alloc.sh keeps one item's footprint."""
    import cepe.eval.common as common

    purged = []
    monkeypatch.setattr(common, "purge", lambda: purged.append(len(purged)) or True)
    values, cost = common.run_examples(setup, "truncated", [3, 1, 2], lambda m, x: (float(x), x), "items")
    assert values == [3.0, 1.0, 2.0] and cost["tokens"] == 6 and purged == [0, 1, 2]


def test_replug_passes_read_the_piece_inside_the_prompt():
    """REPLUG's passes read ``pre + piece + tail + suf``, as full context reads ``pre + document + suf``
    (before, the piece came before the chat template's opening); without earlier context, or for the
    other methods, the requests are as before. A total cap at or below the prompt keeps no document."""
    from cepe.eval.tasks.longdoc import Config as DocConfig
    from cepe.eval.tasks.longdoc import longdoc_request
    from cepe.eval.tasks.needle import Config as NeedleConfig
    from cepe.eval.tasks.needle import needle_request

    pre, suf = [900, 901], [902, 903, 904]
    hay = [[i * 10 + j for j in range(5)] for i in range(12)]  # 12 sentences of 5 tokens
    cfg = NeedleConfig(haystack={"documents": []}, decoder_window=20, chunk_length=10)
    full = needle_request("full", hay, pre, suf, cfg).input_ids
    rep = needle_request("replug", hay, pre, suf, cfg)
    assert rep.context and all(p[:2] == pre for p in rep.context)
    assert [t for p in rep.context for t in p[2:]] + rep.input_ids == full[2:]
    cepe = needle_request("cepe", hay, pre, suf, cfg)
    assert cepe.input_ids == pre + rep.input_ids  # CEPE's decoder input keeps the opening
    assert not needle_request("replug", hay[:3], pre, suf, cfg).context  # all of it in the window
    doc = list(range(100))
    dcfg = DocConfig(path="x", decoder_window=25, chunk_length=10)
    full = longdoc_request("full", pre, doc, suf, dcfg).input_ids
    rep = longdoc_request("replug", pre, doc, suf, dcfg)
    assert all(p[:2] == pre for p in rep.context) and len(rep.context) == 8
    assert [t for p in rep.context for t in p[2:]] + rep.input_ids == full[2:]
    assert longdoc_request("cepe", pre, doc, suf, dcfg).input_ids == pre + rep.input_ids
    for cap, kept in ((5, 0), (4, 0), (10, 5), (1000, 100)):
        capped = DocConfig(path="x", decoder_window=25, chunk_length=10, max_total_tokens=cap)
        assert longdoc_request("full", pre, doc, suf, capped).input_ids == pre + doc[100 - kept :] + suf


def test_icl_auto_scoring_does_not_depend_on_the_methods_run(monkeypatch):
    """``scoring: auto`` takes the truncated decoder's best variant; a run without ``truncated`` runs it
    too (before, it fell back to ``ll``), so CEPE's row is the same whichever methods a run names."""
    import torch

    import cepe.eval.tasks.icl as icl
    from cepe.data.split import doc_hash

    def only_pmi_right(scores, domain):  # pmi picks the gold label's column 0, every other variant the last
        n = len(scores)
        first, last = torch.zeros(n), torch.zeros(n)
        first[0], last[-1] = 1.0, 1.0
        return {v: first if v == "pmi" else last for v in icl.SCORING_VARIANTS}

    monkeypatch.setattr(icl, "label_scores", lambda s, d: only_pmi_right(s, d))
    docs = _docs(30, sentences=3, label=["arts", "sport"])
    for d in docs:  # every query is "arts", the first label; demonstrations of both labels
        if doc_hash(d["id"], 0) < 0.3:
            d["label"] = "arts"
    cfg = {
        "source": {"documents": docs},
        "test_fraction": 0.3,
        "encoder_demos": [2],
        "test_size": 3,
        "seeds": [0],
        "max_text_tokens": 24,
    }
    rows = {}
    for methods in (["cepe"], ["cepe", "truncated"]):
        r = run_task("icl", load_setup("tiny", methods, progress=False), cfg)
        rows[len(methods)] = {x["method"]: x for x in r["rows"]}
    assert set(rows[1]) == set(rows[2]) == {"cepe", "truncated"}
    for n in (1, 2):
        assert rows[n]["cepe"]["metric"] == "accuracy[pmi]" and rows[n]["cepe"]["value"] == 100.0


def test_longdoc_acl_papers_are_held_out_by_default():
    """The ACL long-document examples keep only papers outside the training part of the training data's
    document split (11 of aclsum's 100 test papers); ``held_out: false`` gives all of them."""
    from cepe.data.split import SplitFractions, assign_split
    from cepe.eval.tasks.longdoc import acl_examples

    held = acl_examples("test", "challenge", "Why?", None)
    every = acl_examples("test", "challenge", "Why?", None, held_out=False)
    assert len(every) == 100 and 0 < len(held) < len(every)
    fr = SplitFractions(test=0.1, retrieval=0.05)
    docs = {e["document"] for e in held}
    from cepe.data.corpora import acl_papers

    for d in acl_papers():
        if d["text"] in docs:
            assert assign_split(d["id"], 1, fr) != "train"
