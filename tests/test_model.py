"""Core model invariants, reference agreement, cache modes and input validation (tiny random configs)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import VOCAB, random_context, randomize_cross, tiny_cepe_config, tiny_decoder
from transformers import LlamaConfig, LlamaModel

from cepe import CepeForCausalLM, EncoderConfig
from cepe.encoder import ContextEncoder
from cepe.layers import (
    attention_ref,
    attention_sdpa,
    attention_sdpa_lse,
    attention_split_keys,
    split_keys_parts,
)
from cepe.wrapping import decoder_layers

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text"]


def _ids(b=2, t=11, seed=3):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- invariants
@pytest.mark.parametrize("family", FAMILIES)
def test_no_context_equals_decoder(family):
    dec = tiny_decoder(family)
    ids = _ids()
    with torch.no_grad():
        ref = dec(ids).logits
        model = CepeForCausalLM.from_decoder(dec, tiny_cepe_config()).eval()
        randomize_cross(model)
        out = model(ids).logits
    assert (out - ref).abs().max().item() <= 1e-6


@pytest.mark.parametrize("family", FAMILIES)
def test_zero_o_proj_equals_decoder_with_context(family):
    dec = tiny_decoder(family)
    ids = _ids()
    with torch.no_grad():
        ref = dec(ids).logits
        model = CepeForCausalLM.from_decoder(dec, tiny_cepe_config(init_mode="zero")).eval()
        enc_ids, enc_mask = random_context(2, 3)
        out = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert torch.equal(out, ref)


def _reference_layer_check(model: CepeForCausalLM, ids, enc_ids, enc_mask, gemma: bool):
    """Recompute every decoder layer in the released order from its recorded input and compare."""
    records = []
    layers = decoder_layers(model.decoder)
    # the score scale of the layers' own attention: 1/sqrt(head_dim), 1/sqrt(query_pre_attn_scalar) for Gemma 2/3
    score_dim = getattr(model.config, "query_pre_attn_scalar", None)

    def pre(mod, args, kwargs):
        records.append(
            {"layer": mod, "input": args[0] if args else kwargs["hidden_states"], "kwargs": kwargs}
        )

    def post(mod, args, kwargs, output):
        records[-1]["output"] = output[0] if isinstance(output, tuple) else output

    handles = [lay.register_forward_pre_hook(pre, with_kwargs=True) for lay in layers]
    handles += [lay.register_forward_hook(post, with_kwargs=True) for lay in layers]
    with torch.no_grad():
        states, key_mask = model.encode_context(enc_ids, enc_mask)
        model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask, use_cache=False)
        for h in handles:
            h.remove()
        for rec in records:
            lay, h_in = rec["layer"], rec["input"]
            kwargs = {k: v for k, v in rec["kwargs"].items() if k != "hidden_states"}
            with model.use_context(None):
                a, _ = lay.self_attn(hidden_states=lay.input_layernorm(h_in), **kwargs)
                h1 = h_in + (lay.post_attention_layernorm(a) if gemma else a)
                h2 = h1 + _cross_ref(lay.cross_attn, h1, states, key_mask, score_dim)
                if gemma:
                    out = h2 + lay.post_feedforward_layernorm(lay.mlp(lay.pre_feedforward_layernorm(h2)))
                else:
                    out = h2 + lay.mlp(lay.post_attention_layernorm(h2))
            assert (out - rec["output"]).abs().max().item() < 1e-5


def _cross_ref(cross, h, states, key_mask, score_dim=None):
    """The released computation written out: norm, projections, repeat KV, fp32 softmax, o_proj; for
    families whose self-attention normalises each q/k head (Qwen 3, Gemma 3), the same per-head RMS norms
    (cepe's one deliberate addition to the released layer)."""
    b, t, _ = h.shape
    hq = cross.layernorm(h)

    def head_norm(x, norm):
        if norm is None:
            return x
        return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))

    q = head_norm((hq @ cross.q_proj.weight.T).view(b, t, cross.num_heads, cross.head_dim), cross.q_norm)
    k = head_norm((states @ cross.k_proj.weight.T).view(b, -1, cross.num_kv, cross.head_dim), cross.k_norm)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = (states @ cross.v_proj.weight.T).view(b, -1, cross.num_kv, cross.head_dim).transpose(1, 2)
    rep = cross.num_heads // cross.num_kv
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(score_dim or cross.head_dim)
    scores = scores + torch.where(key_mask, 0.0, torch.finfo(scores.dtype).min)[:, None, None, :]
    p = torch.softmax(scores.float(), -1).to(q.dtype)
    return (p @ v).transpose(1, 2).reshape(b, t, -1) @ cross.o_proj.weight.T


@pytest.mark.parametrize("family", FAMILIES)
def test_layers_compute_the_released_order(family):
    model = CepeForCausalLM.from_decoder(tiny_decoder(family), tiny_cepe_config(pack_keys=False)).eval()
    randomize_cross(model)
    enc_ids, enc_mask = random_context(2, 3)
    enc_mask[0, 2, 3:] = False
    _reference_layer_check(model, _ids(), enc_ids, enc_mask, gemma=family.startswith("gemma"))


def test_context_changes_output(tiny_model):
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    with torch.no_grad():
        a = tiny_model(ids).logits
        b = tiny_model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert (a - b).abs().max() > 1e-3


def test_chunk_permutation_invariance(tiny_model):
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 4)
    enc_mask[1, 3, 5:] = False
    perm = torch.tensor([2, 0, 3, 1])
    with torch.no_grad():
        a = tiny_model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        b = tiny_model(
            ids, encoder_input_ids=enc_ids[:, perm], encoder_attention_mask=enc_mask[:, perm]
        ).logits
    assert (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("pack", [True, False])
def test_padding_chunk_changes_nothing(pack):
    model = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(pack_keys=pack)).eval()
    randomize_cross(model)
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    pad_ids = torch.cat([enc_ids, torch.randint(0, VOCAB, (2, 1, 8))], 1)
    pad_mask = torch.cat([enc_mask, torch.zeros(2, 1, 8, dtype=torch.bool)], 1)
    with torch.no_grad():
        a = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        b = model(ids, encoder_input_ids=pad_ids, encoder_attention_mask=pad_mask).logits
    assert (a - b).abs().max().item() < 1e-5


def test_batch_equals_single_with_different_chunk_counts(tiny_model):
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 4)
    enc_mask[1, 2:] = False  # example 1 has only 2 real chunks
    enc_mask[1, 1, 6:] = False
    with torch.no_grad():
        both = tiny_model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        a = tiny_model(ids[:1], encoder_input_ids=enc_ids[:1], encoder_attention_mask=enc_mask[:1]).logits
        b = tiny_model(
            ids[1:], encoder_input_ids=enc_ids[1:, :2], encoder_attention_mask=enc_mask[1:, :2]
        ).logits
    assert (both[0] - a[0]).abs().max().item() < 1e-5
    assert (both[1] - b[0]).abs().max().item() < 1e-5


def test_fully_padded_context_is_exactly_decoder(tiny_model):
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    with torch.no_grad():
        ref = tiny_model(ids).logits
        enc_mask[1] = False  # example 1: no real context token
        out = tiny_model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        assert torch.isfinite(out).all()
        assert torch.equal(out[1], ref[1])
        enc_mask[:] = False
        out = tiny_model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert torch.equal(out, ref)


def test_fully_padded_example_has_finite_gradients():
    model = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config()).train()
    randomize_cross(model)
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    enc_mask[1] = False
    loss = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask, labels=ids).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert any(g.abs().max() > 0 for n, g in grads.items() if ".cross_attn." in n)


# ----------------------------------------------------------------------------- reference paths
def test_attention_kernels_agree():
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(3, 6, 5, 8, generator=g),
        torch.randn(3, 2, 9, 8, generator=g),
        torch.randn(3, 2, 9, 8, generator=g),
    )
    mask = torch.rand(3, 9, generator=g) > 0.3
    mask[:, 0] = True
    for m in (None, mask):
        a, b = attention_ref(q, k, v, m, 0.3), attention_sdpa(q, k, v, m, 0.3)
        assert (a - b).abs().max().item() < 1e-5


def test_encoder_matches_bidirectional_llama():
    torch.manual_seed(0)
    ec = EncoderConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
    )
    enc = ContextEncoder(ec).eval()
    lc = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=ec.intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        attn_implementation="eager",
    )
    hf = LlamaModel(lc).eval()
    hf.load_state_dict(enc.state_dict(), strict=True)
    ids = torch.randint(0, 50, (3, 7))
    m = torch.ones(3, 7, dtype=torch.bool)
    m[1, 4:] = False
    mask4 = torch.zeros(3, 1, 7, 7).masked_fill(~m[:, None, None, :], torch.finfo(torch.float32).min)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask4).last_hidden_state
        for impl in ("eager", "sdpa"):
            enc.attn_implementation = impl
            assert (enc(ids, m) - ref)[m].abs().max().item() < 1e-5


def test_micro_batched_encoding_matches_one_call():
    torch.manual_seed(0)
    enc = ContextEncoder(
        EncoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    ).eval()
    ids = torch.randint(0, 50, (2, 5, 6))
    mask = torch.ones(2, 5, 6, dtype=torch.bool)
    mask[0, 4] = False
    mask[1, 1, 2:] = False
    with torch.no_grad():
        a, ma = enc.encode_chunks(ids, mask, micro_batch=100)
        b, mb = enc.encode_chunks(ids, mask, micro_batch=3)
        direct = enc(ids.view(10, 6), mask.view(10, 6)).view(2, 30, -1)
    assert torch.equal(ma, mb)
    assert (a - b).abs().max().item() < 1e-6
    assert (a[ma] - direct[ma]).abs().max().item() < 1e-5
    assert a[~ma].abs().max().item() == 0.0


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_eager_and_sdpa_models_agree(family):
    dec = tiny_decoder(family)
    model = CepeForCausalLM.from_decoder(dec, tiny_cepe_config()).eval()
    randomize_cross(model)
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    enc_mask[0, 1, 4:] = False
    with torch.no_grad():
        a = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        model.cepe_config.attn_implementation = "eager"
        model.encoder.attn_implementation = "eager"
        b = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert (a - b).abs().max().item() < 1e-4


def test_packed_keys_match_unpacked():
    dec = tiny_decoder()
    model = CepeForCausalLM.from_decoder(dec, tiny_cepe_config(pack_keys=True)).eval()
    randomize_cross(model)
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 4)
    enc_mask[0, 1, 3:] = False
    enc_mask[1, 2:] = False
    with torch.no_grad():
        a = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        model.cepe_config.pack_keys = False
        b = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    "null_key,token_gate,match_gate,lengths",
    [
        (False, False, False, {}),
        (True, False, False, {}),
        (True, True, False, {}),
        (True, True, True, {}),
        (False, False, False, {"length_scale": 20}),
        (True, False, True, {"length_scale": 20}),
        (False, False, False, {"length_scale": 20, "length_scale_below": True, "length_scale_above": True}),
        (True, True, True, {"length_scale": 20, "short_gate": True}),
        (True, True, True, {"length_scale": 20, "short_gate": True, "long_gate": True}),
        (False, False, False, {"induction_gate": True}),
        (True, True, True, {"induction_gate": True}),
    ],
)
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_cache_modes_agree(impl, null_key, token_gate, match_gate, lengths):
    """With null keys: kv caches them with K/V; absorbed falls back to projected keys. With token gates,
    match gates, length exponents (below and above the pivot) or gates for short and long contexts (randomised by
    randomize_cross like every cross-attention weight) every mode scales its heads alike (the two examples
    have 24 and 16 context tokens: one above the pivot, one below)."""
    cfg = tiny_cepe_config(
        attn_implementation=impl,
        null_key=null_key,
        token_gate=token_gate,
        match_gate=match_gate,
        **lengths,
    )
    model = CepeForCausalLM.from_decoder(tiny_decoder(), cfg).eval()
    randomize_cross(model)
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    enc_mask[1, 2] = False
    outs, logits = {}, {}
    for mode in ("kv", "states", "absorbed"):
        outs[mode] = model.generate(
            ids,
            encoder_input_ids=enc_ids,
            encoder_attention_mask=enc_mask,
            max_new_tokens=6,
            do_sample=False,
            cross_attention_cache=mode,
            pad_token_id=0,
        )
        ctx = model.prepare_context(enc_ids, enc_mask, cross_attention_cache=mode)
        with torch.no_grad():
            logits[mode] = model(ids, cross_context=ctx).logits
    assert torch.equal(outs["kv"], outs["states"]) and torch.equal(outs["kv"], outs["absorbed"])
    assert (logits["kv"] - logits["states"]).abs().max().item() < 1e-4
    assert (logits["kv"] - logits["absorbed"]).abs().max().item() < 1e-4


def test_generate_without_context_equals_decoder(tiny_model):
    ids = _ids(1)
    a = tiny_model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    plain = tiny_decoder()  # the same weights, never hooked (tiny_model wraps tiny_decoder())
    ref = plain.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(a, ref)
    enc_ids, enc_mask = random_context(1, 3)
    with_ctx = tiny_model.generate(
        ids,
        encoder_input_ids=enc_ids,
        encoder_attention_mask=enc_mask,
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
    )
    assert not torch.equal(with_ctx, ref)  # the context is used (the check above is not vacuous)


def test_kv_cache_is_built_once_per_layer(tiny_model):
    ids = _ids(1)
    enc_ids, enc_mask = random_context(1, 3)
    ctx = tiny_model.prepare_context(enc_ids, enc_mask, cross_attention_cache="kv")
    with torch.no_grad():
        out = tiny_model(ids, cross_context=ctx, use_cache=True)
        assert sorted(ctx.kv) == tiny_model.cross_layers
        first = {i: kv[0].data_ptr() for i, kv in ctx.kv.items()}
        nxt = out.logits[:, -1:].argmax(-1)
        tiny_model(nxt, cross_context=ctx, past_key_values=out.past_key_values, use_cache=True)
    assert {i: kv[0].data_ptr() for i, kv in ctx.kv.items()} == first


def test_score_scaling_only_beyond_training_length():
    from cepe import CepeConfig

    cfg = CepeConfig(
        encoder=EncoderConfig(vocab_size=10, hidden_size=8, num_attention_heads=2),
        score_scaling="yarn",
        train_context_tokens=100,
    )
    assert cfg.score_scale(50) == 1.0 and cfg.score_scale(100) == 1.0
    assert cfg.score_scale(400) == pytest.approx((1 + 0.1 * math.log(4)) ** 2)
    model = CepeForCausalLM.from_decoder(
        tiny_decoder(), tiny_cepe_config(score_scaling="yarn", train_context_tokens=8)
    ).eval()
    randomize_cross(model)
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    with torch.no_grad():
        a = model(ids, encoder_input_ids=enc_ids[:, :1], encoder_attention_mask=enc_mask[:, :1]).logits
        b = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        model.cepe_config.score_scaling = "none"
        a2 = model(ids, encoder_input_ids=enc_ids[:, :1], encoder_attention_mask=enc_mask[:, :1]).logits
        b2 = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert torch.equal(a, a2)  # 8 tokens = training length: unscaled
    assert (b - b2).abs().max() > 1e-4  # 24 tokens: scaled


# ----------------------------------------------------------------------------- training surface
def test_trainable_parameters_are_encoder_and_cross_attention(tiny_model):
    names = {n for n, p in tiny_model.named_parameters() if p.requires_grad}
    assert names and all(n.startswith("encoder.") or ".cross_attn." in n for n in names)
    expected = {f"encoder.{n}" for n, _ in tiny_model.encoder.named_parameters()}
    expected |= {n for n, _ in tiny_model.named_parameters() if ".cross_attn." in n}
    assert names == expected
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    tiny_model.train()
    loss = tiny_model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask, labels=ids).loss
    loss.backward()
    assert all(p.grad is None for n, p in tiny_model.named_parameters() if n not in names)
    assert tiny_model.encoder.embed_tokens.weight.grad is not None


def test_loss_matches_full_logits_cross_entropy(tiny_model):
    ids = _ids()
    labels = ids.clone()
    labels[0, :4] = -100
    enc_ids, enc_mask = random_context(2, 3)
    with torch.no_grad():
        out = tiny_model(
            ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask, labels=labels, return_logits=True
        )
        ref = torch.nn.functional.cross_entropy(
            out.logits[:, :-1].reshape(-1, VOCAB).float(), labels[:, 1:].reshape(-1)
        )
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-5)
    full = tiny_model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert (out.logits - full).abs().max().item() < 1e-5
    # a loss builds no self-attention cache nobody reads (HF's default would), unless asked for one
    assert out.past_key_values is None
    with torch.no_grad():
        cached = tiny_model(
            ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask, labels=labels, use_cache=True
        )
    assert cached.past_key_values is not None and cached.loss.item() == out.loss.item()


def test_copy_init_copies_self_attention():
    dec = tiny_decoder()
    model = CepeForCausalLM.from_decoder(dec, tiny_cepe_config(init_mode="copy"))
    lay = decoder_layers(model.decoder)[1]
    assert torch.equal(lay.cross_attn.q_proj.weight, lay.self_attn.q_proj.weight)
    assert torch.equal(lay.cross_attn.k_proj.weight, lay.self_attn.k_proj.weight[:, :32])
    assert torch.equal(lay.cross_attn.v_proj.weight, lay.self_attn.v_proj.weight[:, :32])
    assert torch.equal(lay.cross_attn.o_proj.weight, lay.self_attn.o_proj.weight)
    zero = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config())
    assert decoder_layers(zero.decoder)[0].cross_attn.o_proj.weight.abs().max() == 0


def test_last_n_layers_form():
    model = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(num_cross_attn_layers=2))
    assert model.cross_layers == [1, 2]
    assert not hasattr(decoder_layers(model.decoder)[0], "cross_attn")
    model = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(cross_attention_layers=[0, 2]))
    assert model.cross_layers == [0, 2]


def test_default_config_sized_from_decoder():
    model = CepeForCausalLM.from_decoder(tiny_decoder(hidden_size=256, intermediate_size=256))
    assert model.cepe_config.encoder.hidden_size == 64
    assert model.cepe_config.encoder.vocab_size == VOCAB + 1


# ----------------------------------------------------------------------------- validation
def test_clear_errors(tiny_model):
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    with pytest.raises(ValueError, match="outside the decoder vocabulary"):
        tiny_model(ids + VOCAB)
    with pytest.raises(ValueError, match="outside the encoder vocabulary"):
        tiny_model(ids, encoder_input_ids=enc_ids + 2 * VOCAB, encoder_attention_mask=enc_mask)
    with pytest.raises(ValueError, match=r"must be \(B, K, L\)"):
        tiny_model(ids, encoder_input_ids=enc_ids[0])
    with pytest.raises(ValueError, match=r"input_ids must be \(B, T\)"):
        tiny_model(ids[0])
    with pytest.raises(ValueError, match="empty chunks"):
        tiny_model(ids, encoder_input_ids=enc_ids[:, :0])
    with pytest.raises(ValueError, match="must match"):
        tiny_model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask[:, :2])
    with pytest.raises(ValueError, match="cross_attention_cache"):
        tiny_model.generate(ids, encoder_input_ids=enc_ids, cross_attention_cache="bogus", max_new_tokens=1)
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        CepeForCausalLM.from_decoder(
            tiny_decoder(),
            tiny_cepe_config(encoder=EncoderConfig(vocab_size=500, hidden_size=32, num_attention_heads=2)),
        )
    with pytest.raises(ValueError, match="not registered"):
        from transformers import GPT2Config, GPT2LMHeadModel

        CepeForCausalLM.from_decoder(
            GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
        )


def test_generate_runs_the_encoder_once(tiny_model, monkeypatch):
    calls = []
    real = tiny_model.encoder.forward
    monkeypatch.setattr(tiny_model.encoder, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    enc_ids, enc_mask = random_context(1, 3)
    tiny_model.generate(
        _ids(1),
        encoder_input_ids=enc_ids,
        encoder_attention_mask=enc_mask,
        max_new_tokens=5,
        do_sample=False,
        pad_token_id=0,
    )
    assert len(calls) == 1  # one micro-batch holds all 3 chunks: one encoder call for the whole generation


@pytest.mark.parametrize("shape", [(1, 9, 3, 1, 5000), (2, 4, 2, 3, 4099), (1, 1, 1, 9, 8192)])
def test_split_keys_attention_matches_reference(shape):
    """Decode-time split-K attention (blocks merged by log-sum-exp, remainder block included) equals the
    plain reference, for any number of blocks; the SDPA entry point takes it when a decode step leaves
    cores idle."""
    n, h, kv, t, s = shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, h, t, 16, generator=g)
    k, v = torch.randn(n, kv, s, 16, generator=g), torch.randn(n, kv, s, 16, generator=g)
    ref = attention_ref(q, k, v, None, 0.25)
    for parts in (1, 2, 3, 5):
        torch.testing.assert_close(attention_split_keys(q, k, v, 0.25, parts), ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(attention_sdpa(q, k, v, None, 0.25), ref, rtol=1e-5, atol=1e-5)
        assert split_keys_parts(1, 1, 100, q.device) == 1  # too few keys: not worth splitting
        assert split_keys_parts(1, 1, 8192, q.device) >= 2
    assert split_keys_parts(1, 1, 8192, q.device) == 1  # training (grad enabled) keeps the fused kernel


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_with_logsumexp_and_both_gradients(masked, dtype):
    """``attention_sdpa_lse``: without autograd, ``attention_sdpa``'s output bit for bit and each query's
    logsumexp of the scaled, masked scores (GQA, padding and holes in the keys; at a decode step that
    splits the keys, the blocks' logsumexps merged); under autograd the same values, with the gradients of
    both outputs (the logsumexp's folded into the kernel's backward) equal to autograd's through the
    scores."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 6, 9, 16, generator=g).to(dtype).requires_grad_(True)
    k = torch.randn(2, 2, 40, 16, generator=g).to(dtype).requires_grad_(True)
    v = torch.randn(2, 2, 40, 16, generator=g).to(dtype).requires_grad_(True)
    mask = None
    if masked:
        mask = torch.ones(2, 40, dtype=torch.bool)
        mask[0, 25:] = False
        mask[1, ::3] = False
    w = torch.randn(2, 6, 9, 16, generator=g).to(dtype)
    w_lse = torch.randn(2, 6, 9, generator=g)
    scores = torch.matmul(q.float(), k.float().repeat_interleave(3, dim=1).transpose(-1, -2)) * 0.25
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    want_out = torch.matmul(scores.softmax(-1), v.float().repeat_interleave(3, dim=1))
    want_lse = torch.logsumexp(scores, -1)
    want_grads = torch.autograd.grad((want_out * w.float()).sum() + (want_lse * w_lse).sum(), (q, k, v))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.no_grad():
        out, lse = attention_sdpa_lse(q, k, v, mask, 0.25)
        assert torch.equal(out, attention_sdpa(q, k, v, mask, 0.25)) and lse.dtype == torch.float32
        torch.testing.assert_close(lse, want_lse, rtol=tol, atol=tol)
    out, lse = attention_sdpa_lse(q, k, v, mask, 0.25)
    torch.testing.assert_close(out.float(), want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, want_lse, rtol=tol, atol=tol)
    got_grads = torch.autograd.grad((out * w).sum() + (lse * w_lse).sum(), (q, k, v))
    for got, want in zip(got_grads, want_grads):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 4)
    q1 = torch.randn(1, 1, 1, 16, generator=g)  # one work unit: split at any thread count
    k1, v1 = torch.randn(1, 1, 5000, 16, generator=g), torch.randn(1, 1, 5000, 16, generator=g)
    with torch.no_grad():
        assert split_keys_parts(1, 1, 5000, q1.device) >= 2  # this step takes the split path
        out1, lse1 = attention_sdpa_lse(q1, k1, v1, None, 0.25)
        assert torch.equal(out1, attention_sdpa(q1, k1, v1, None, 0.25))
        scores1 = torch.matmul(q1, k1.transpose(-1, -2)) * 0.25
        torch.testing.assert_close(lse1, torch.logsumexp(scores1, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["kv", "absorbed"])
def test_generate_with_static_cache_matches_dynamic(tiny_model, mode):
    """HF's preallocated cache (``cache_implementation="static"``, no per-step concatenation) gives the
    same greedy tokens and scores as the default growing cache."""
    enc_ids, enc_mask = random_context(2, 3)
    outs = {}
    for impl in (None, "static"):
        extra = {} if impl is None else {"cache_implementation": impl}
        outs[impl] = tiny_model.generate(
            _ids(2),
            encoder_input_ids=enc_ids,
            encoder_attention_mask=enc_mask,
            cross_attention_cache=mode,
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
            **extra,
        )
    assert torch.equal(outs[None].sequences, outs["static"].sequences)
    torch.testing.assert_close(torch.stack(outs["static"].scores), torch.stack(outs[None].scores))


def test_context_scale_equals_scaled_o_proj_and_survives_generation():
    """``context_scale`` s gives what every ``o_proj`` multiplied by s gives (forward and greedy decoding
    with cached context); 0 gives the decoder; bad values are refused."""
    from cepe import CepeConfig
    from cepe.cross_attention import CrossAttention

    dec = tiny_decoder()
    model = CepeForCausalLM.from_decoder(dec, tiny_cepe_config()).eval()
    randomize_cross(model)
    ref = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config()).eval()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, CrossAttention):
                m.o_proj.weight.mul_(1.7)
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    kw = {"encoder_input_ids": enc_ids, "encoder_attention_mask": enc_mask}
    with torch.no_grad():
        plain = model(ids, **kw).logits
        model.cepe_config.context_scale = 1.7
        scaled = model(ids, **kw).logits
        want = ref(ids, **kw).logits
        gen = model.generate(ids[:1], max_new_tokens=5, do_sample=False, **{k: v[:1] for k, v in kw.items()})
        gen_ref = ref.generate(
            ids[:1], max_new_tokens=5, do_sample=False, **{k: v[:1] for k, v in kw.items()}
        )
        model.cepe_config.context_scale = 0.0
        off = model(ids, **kw).logits
        dec_logits = dec(ids).logits
    assert (scaled - want).abs().max().item() <= 1e-5
    assert (scaled - plain).abs().max().item() > 1e-3
    assert torch.equal(gen, gen_ref)
    assert (off - dec_logits).abs().max().item() <= 1e-6
    with pytest.raises(ValueError, match="context_scale"):
        CepeConfig(
            encoder=EncoderConfig(vocab_size=10, hidden_size=8, num_attention_heads=2), context_scale=-1
        )


def test_attention_alignment_is_computed_in_every_cache_mode(tiny_model):
    """The alignment probe scores the keys themselves: the ``absorbed`` mode (keys folded into the
    query) projects them for a layer it supervises instead of skipping the probe (before: no loss)."""
    from cepe.cross_attention import AlignProbe

    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    targets = torch.full(ids.shape, -1, dtype=torch.long)
    targets[:, 3:] = torch.arange(ids.shape[1] - 3) % 20
    losses = {}
    for mode in ("states", "kv", "absorbed"):
        ctx = tiny_model.prepare_context(enc_ids, enc_mask, cross_attention_cache=mode)
        ctx.align = AlignProbe(targets, heads=2)
        with torch.no_grad():
            tiny_model(ids, cross_context=ctx)
        assert len(ctx.align.losses) == len(tiny_model.cross_attention_modules())
        losses[mode] = float(ctx.align.loss())
    assert losses["absorbed"] == pytest.approx(losses["states"], rel=1e-5)
    assert losses["kv"] == pytest.approx(losses["states"], rel=1e-5)
