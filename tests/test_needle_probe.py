"""scripts/needle_probe.py: attention mass on a needle, read from every cross-attention layer (tiny model)."""

from __future__ import annotations

import pytest
from conftest import load_script


def _module():
    return load_script("needle_probe")


def test_find_locates_the_needle_and_a_merged_first_token():
    find = _module().find
    assert find([5, 1, 2, 3, 9], [1, 2, 3]) == [1, 2, 3]
    assert find([5, 7, 2, 3, 4, 9], [1, 2, 3, 4]) == [2, 3, 4]  # first token merged with the text before
    assert find([5, 6, 7], [1, 2, 3]) == []
    assert find([5, 6, 7], [6]) == [1] and find([5, 6, 7], [8]) == []  # one token: found whole or not


@pytest.mark.parametrize("variant", ["plain", "null_key", "output_mix"])
def test_probe_reads_each_layer_softmax_over_the_encoder(variant):
    from cepe.tiny import tiny_model

    mod = _module()
    model, tok = tiny_model(chunk_length=32)
    null_key = variant == "null_key"
    if null_key:
        model.enable_null_key()
    if variant == "output_mix":  # two decoder rows per call, the context's own cache
        model.enable_output_mix(match=4, hidden=False, length=True)
        model.enable_output_copy(sure=True)
    cfg = _needle_config()
    rows = mod.probe(model, tok, cfg, bf16=False, forced="The special magic")
    assert {(r["total"], r["depth"]) for r in rows} == {(t, d) for t in (400, 800) for d in (0.0, 0.5)}
    layers = len(model.cross_attention_modules())
    for r in rows:
        text = "".join(r["needle_text"])  # the tokens found are the needle's (all but a merged first one)
        assert text in cfg.needle.strip() + " " and len(text) >= len(cfg.needle) // 2
        assert r["uniform"] == pytest.approx(r["needle_tokens"] / r["encoder_tokens"])
        assert len(r["layers"]) == layers
        for v in r["layers"].values():
            assert 0.0 <= v["needle"] <= v["best_head"] <= 1.0 + 1e-6
            rounding = 5e-5 * len(v["by_token"])  # by_token is rounded to 4 decimals
            assert sum(v["by_token"]) == pytest.approx(v["best_head"], abs=rounding + 1e-6)
            assert (v["null"] > 0) == null_key
        for key in ("next", "alone"):  # the model's top 5 next tokens and the decoder alone's
            probs = [q for _, q in r[key]]
            assert len(probs) == 5 and probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-3
    if variant == "plain":  # the cross-attention's output projection zeroed: the model is the decoder alone
        model.init_cross_attention("zero")
        for r in mod.probe(model, tok, cfg, bf16=False, forced="The special magic"):
            assert r["next"] == r["alone"]
    lines = mod.summary(rows)
    assert len(lines) == 2 + 2 + 3 + len(rows) and lines[2].startswith("| 400 |")
    assert lines[7].startswith(f"| {rows[0]['total']} | {rows[0]['depth']} | {rows[0]['next'][0][0]!r}")


def test_find_text_says_where_a_line_stands_in_each_prompt():
    """--find: the 400-token haystack's last sentence stands in its decoder window at every depth and in
    the encoder of the 800-token prompts; the haystack's first sentence only ever in an encoder; one
    decoder window per total while the needle stays out of it."""
    from cepe.eval.tasks.needle import Config, build_haystack, prompt_parts
    from cepe.tiny import tiny_model

    mod = _module()
    _, tok = tiny_model(chunk_length=32)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    text = " ".join(f"{words[j % 10].capitalize()} {words[(3 * j) % 7]} {j}." for j in range(400))
    cfg = Config(
        haystack={"documents": [{"text": text}]},
        totals=[400, 800],
        depths=[0.0, 0.5],
        decoder_window=64,
        chunk_length=32,
        chat_template=False,
    )
    sentences, needle, _, _ = prompt_parts(mod._Setup(tok), cfg)
    last = tok.decode(build_haystack(sentences, needle, 400, 0.0)[-1]).strip()
    rows = mod.find_text(tok, cfg, last)
    assert rows[2:6] == [
        "| 400 | 0.0 | True | False |",
        "| 400 | 0.5 | True | False |",
        "| 800 | 0.0 | False | True |",
        "| 800 | 0.5 | False | True |",
    ]
    first = mod.find_text(tok, cfg, tok.decode(sentences[0]).strip())
    assert all(row.endswith("| False | True |") for row in first[2:6])
    assert rows[-2:] == [
        "400: 1 distinct decoder window(s) over the depths",
        "800: 1 distinct decoder window(s) over the depths",
    ]


def _needle_config():
    from cepe.eval.tasks.needle import Config

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    docs = [
        {"text": " ".join(f"{words[(i * j) % 10].capitalize()} {words[j % 10]} {j}." for j in range(60))}
        for i in range(3)
    ]
    return Config(
        haystack={"documents": docs},
        totals=[400, 800],
        depths=[0.0, 0.5],
        decoder_window=64,
        chunk_length=32,
        chat_template=False,
    )


def test_probe_reads_the_softmax_the_layer_computes_with_length_exponents(monkeypatch):
    """The null key's mass in each layer is the one in the softmax the cross-attention kernel computes,
    with the context-length exponents scaling the scores (heads' exponents far from zero)."""
    import torch

    import cepe.cross_attention as ca
    from cepe.layers import repeat_kv
    from cepe.tiny import tiny_model

    mod = _module()
    model, tok = tiny_model(chunk_length=32)
    model.enable_null_key()
    model.enable_length_scale(64)
    with torch.no_grad():
        for m in model.cross_attention_modules():
            m.length_exp.copy_(torch.linspace(-1.5, 2.0, m.num_heads))
    kernels = dict(ca.ATTENTION_KERNELS)
    seen: list[torch.Tensor] = []

    def spy(q, k, v, key_mask, scale, bias=None):  # the softmax of the last query of the first row
        s = (q.float() @ repeat_kv(k, q.shape[1] // k.shape[1]).float().transpose(-1, -2)) * scale
        if key_mask is not None:
            s = s.masked_fill(~key_mask[:, None, None, :], float("-inf"))
        seen.append(s[0, :, -1].softmax(-1))
        return kernels["eager"](q, k, v, key_mask, scale, bias)

    monkeypatch.setattr(ca, "ATTENTION_KERNELS", {"eager": spy, "sdpa": spy})
    rows = mod.probe(model, tok, _needle_config(), bf16=False)
    layers = len(model.cross_attention_modules())
    assert rows and len(seen) == layers * len(rows)
    for i, r in enumerate(rows):
        got = [v["null"] for _, v in sorted(r["layers"].items())]
        want = [float(p[:, 0].mean()) for p in seen[i * layers : (i + 1) * layers]]
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_probe_refuses_an_adapter_with_run_biases():
    from cepe.tiny import tiny_model

    model, tok = tiny_model(chunk_length=32)
    model.enable_run_bias()
    with pytest.raises(SystemExit, match="run_bias"):
        _module().probe(model, tok, _needle_config(), bf16=False)
