"""``cepe generate``, ``cepe info`` and the main job's pieces on a tiny random model with a byte tokenizer."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from conftest import randomize_cross

from cepe import CepeConfig, CepeForCausalLM, EncoderConfig
from cepe.chunking import chunk_ids
from cepe.cli import main
from cepe.tiny import ByteTokenizer
from cepe.tiny import tiny_decoder as byte_decoder


@pytest.fixture
def adapter(tmp_path, monkeypatch):
    """A saved tiny adapter over a saved byte-vocabulary decoder; tokenizers load as ByteTokenizer."""
    import cepe.assets

    monkeypatch.setattr(cepe.assets, "load_tokenizer", lambda name="default": ByteTokenizer())
    dec_dir = tmp_path / "decoder"
    byte_decoder(seed=3).save_pretrained(dec_dir)
    enc = EncoderConfig(vocab_size=259, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    model = CepeForCausalLM.from_decoder(str(dec_dir), CepeConfig(encoder=enc, chunk_length=16)).eval()
    randomize_cross(model, std=0.5)
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter", dec_dir, model


def test_generate_refuses_what_it_cannot_answer(adapter):
    """A negative ``decoder_tokens`` (before: silently the first tokens to the encoder, the rest to the
    decoder), no new tokens, or an empty prompt get a clear error."""
    from cepe.generation import generate_from_context

    _, _, model = adapter
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="decoder_tokens must be 0 or more.*got -5"):
        generate_from_context(model, tok, "some context " * 4, "Why?", decoder_tokens=-5)
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1"):
        generate_from_context(model, tok, "some context", "Why?", max_new_tokens=0)
    with pytest.raises(ValueError, match="the prompt is empty"):
        generate_from_context(model, tok, "some context", "", chat=False)


def test_cepe_generate_answers_from_the_context_file(adapter, tmp_path, capsys):
    path, _, model = adapter
    context = "The key is hidden under the blue stone near the old well. " * 3
    (tmp_path / "ctx.txt").write_text(context)
    rc = main(
        [
            "generate",
            "--model",
            str(path),
            "--context",
            str(tmp_path / "ctx.txt"),
            "--prompt",
            "Where is the key?",
            "--max-new-tokens",
            "6",
            "--decoder-tokens",
            "10",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    # the same answer built by hand: all but the last 10 context bytes to the encoder, in 16-byte chunks
    tok = ByteTokenizer()
    ids = tok.encode(context)
    chunks, mask = chunk_ids(ids[:-10], 16, pad_id=tok.pad_token_id)
    prompt = torch.tensor([ids[-10:] + tok.encode("Where is the key?")])
    out = model.generate(
        prompt,
        encoder_input_ids=chunks[None],
        encoder_attention_mask=mask[None],
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
    )
    new = out[0, prompt.shape[1] :].tolist()
    assert printed == tok.decode(new) + "\n"
    assert len(new) == 6


def test_cepe_info_describes_the_model(adapter, capsys):
    path, dec_dir, model = adapter
    assert main(["info", "--model", str(path)]) == 0
    info = json.loads(capsys.readouterr().out)
    n_encoder = sum(p.numel() for p in model.encoder.parameters())
    n_cross = sum(p.numel() for m in model.cross_attention_modules() for p in m.parameters())
    n_decoder = sum(p.numel() for p in byte_decoder().parameters())
    assert info["decoder"] == str(dec_dir)
    assert info["decoder_layers_with_cross_attention"] == [0, 1]
    assert info["trainable_parameters"] == n_encoder + n_cross
    assert info["total_parameters"] == n_encoder + n_cross + n_decoder
    assert info["chunk_length"] == 16 and info["encoder"]["hidden_size"] == 16
    assert info["untrained_encoder"] is False and info["output_mixture"] is None
    # a plain decoder gets a fresh encoder, and says so
    assert main(["info", "--model", str(dec_dir)]) == 0
    assert json.loads(capsys.readouterr().out)["untrained_encoder"] is True
    # an adapter with the output mixture and its copy says what it mixes
    mixed = copy.deepcopy(model)
    mixed.enable_output_mix(3, hidden=False, agree=True)
    mixed.enable_output_copy(near=True)
    mixed.save_pretrained(path.parent / "mixed")
    assert main(["info", "--model", str(path.parent / "mixed")]) == 0
    mix = json.loads(capsys.readouterr().out)["output_mixture"]
    assert mix == {
        "suffix_match_orders": 3,
        "hidden_states_as_inputs": False,
        "context_length_input": False,
        "context_length_cap": None,
        "successor_agreements": True,
        "copy": True,
        "copy_probability_input": False,
        "copy_recency_input": True,
        "copy_reader_sure_input": False,
        "copy_top_share_input": False,
        "copy_reader_agreement_input": False,
        "copy_count_input": False,
        "copy_vote_decay": 0.0,
        "decoder_passes_per_call": 2,
    }


# ----------------------------------------------------------------------------- the main job
def test_lm_and_needle_tables():
    from cepe.main_job import lm_table, needle_table

    rows = [
        {"method": m, "setting": {"domain": d, "total": t}, "value": v}
        for m, d, t, v in [
            ("cepe", "books", 1024, 10.0),
            ("truncated", "books", 1024, 12.5),
            ("cepe", "avg", 1024, 11.0),
            ("truncated", "avg", 1024, 13.25),
            ("cepe", "books", 2048, 9.0),
        ]
    ]
    assert lm_table({"rows": rows}).splitlines() == [
        "| domain | total | cepe | truncated |",
        "|---|---|---|---|",
        "| books | 1024 | 10.00 | 12.50 |",
        "| books | 2048 | 9.00 | nan |",
        "| avg | 1024 | 11.00 | 13.25 |",  # the average comes last
    ]
    needle = [
        {"method": "cepe", "setting": {"total": 1024, "depth": d}, "value": v}
        for d, v in [(0.0, 100.0), (0.5, 0.0), (1.0, 100.0)]
    ]
    assert needle_table({"rows": needle}).splitlines()[2] == "| cepe | 1024 | 67 |"


def test_main_job_end_to_end_on_a_tiny_setup(tmp_path, monkeypatch, capsys):
    """``run_main`` with the model bundle and the corpora swapped for tiny ones: every report is written,
    the printed tables are the results', and an untrained adapter is announced (zero o_proj: cepe equals
    truncated)."""
    import yaml

    import cepe.eval.api as eval_api
    import cepe.eval.common as common
    import cepe.main_job as job

    real_load = eval_api.load_setup
    monkeypatch.setattr(eval_api, "load_setup", lambda model, methods, **kw: real_load("tiny", methods, **kw))
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    docs = [
        {"id": f"d{i}", "text": " ".join(f"{words[(i + j) % 10]} {j}." for j in range(120)), "title": "t"}
        for i in range(3)
    ]
    paper = {"id": "p1", "text": "We propose a method. " * 200}  # 4200 bytes: inside (3000, 6000)
    real_source = common.iter_source
    monkeypatch.setattr(
        common, "iter_source", lambda src: iter([paper]) if src.get("corpus") == "acl" else real_source(src)
    )
    conf = tmp_path / "conf"
    conf.mkdir()
    lm = {
        "sources": [{"name": "toy", "documents": docs}],
        "totals": [200, 300],
        "decoder_window": 96,
        "decoder_window_overrides": {},
        "eval_tokens": 32,
        "chunk_length": 32,
        "sequences_per_domain": 1,
        "methods": {"streamingllm": {"sink_tokens": 4, "recent_tokens": 60, "stride": 32}},
    }
    (conf / "lm.yaml").write_text(yaml.safe_dump(lm))
    needle = {"haystack": {"name": "toy", "documents": docs}, "totals": [200], "depths": [0.0, 1.0]}
    (conf / "needle.yaml").write_text(yaml.safe_dump(needle))
    copy = {"sources": [{"name": "toy", "documents": docs}], "passage_tokens": 64, "prefix_tokens": 8}
    (conf / "copy.yaml").write_text(yaml.safe_dump({**copy, "chunk_length": 32, "passages_per_domain": 1}))
    fixed = {"contexts": [0, 64], "decoder_window": 96, "eval_tokens": 32, "chunk_length": 32, "sequences": 1}
    (conf / "fixedppl.yaml").write_text(yaml.safe_dump({"sources": copy["sources"], **fixed}))
    with pytest.raises(ValueError, match="no cepe adapter"):  # a given path must hold a model
        job.run_main(adapter=tmp_path / "no-adapter", out=tmp_path / "out", config_dir=conf)
    monkeypatch.setattr(job, "DEFAULT_ADAPTER", tmp_path / "no-adapter")  # a clone without the adapter
    res = job.run_main(out=tmp_path / "out", config_dir=conf)
    printed = capsys.readouterr().out
    assert res["trained"] is False and "NOTE: no trained adapter" in printed
    assert job.lm_table(res["lm"]) in printed and job.needle_table(res["needle"]) in printed
    assert job.method_table(res["copy"], "order") in printed and job.method_table(res["fixedppl"]) in printed
    assert {r["setting"]["order"] for r in res["copy"]["rows"]} == {"natural", "shuffled"}
    curve = {(r["method"], r["setting"]["context"]): r["value"] for r in res["fixedppl"]["rows"]}
    assert set(curve) == {(m, c) for m in job.METHODS for c in (0, 64)}
    for c in (0, 64):  # zero o_proj: cepe is the decoder alone, with or without context
        assert curve[("cepe", c)] == pytest.approx(curve[("truncated", 0)], rel=1e-4)
    for f in (
        "main.json",
        "lm/lm.json",
        "lm/lm.md",
        "needle/needle.json",
        "copy/copy.json",
        "fixedppl/fixedppl.json",
    ):
        assert (tmp_path / "out" / f).is_file(), f
    saved = json.loads((tmp_path / "out" / "main.json").read_text())
    assert saved["compute_dtype"] in ("bf16", "fp32") and saved["generation"]["doc"] == "p1"
    val = {
        (r["method"], r["setting"]["total"]): r["value"]
        for r in res["lm"]["rows"]
        if r["setting"]["domain"] == "toy"
    }
    for total in (200, 300):
        assert val[("cepe", total)] == pytest.approx(val[("truncated", total)], rel=1e-4)
        assert math.isfinite(val[("full", total)])
    answers = res["generation"]["answers"]
    assert set(answers) == {"cepe", "truncated"}
