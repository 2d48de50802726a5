"""The encoder built from the decoder's own layers, shared embeddings, causal chunks, and init modes."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_decoder

from cepe import CepeConfig, CepeForCausalLM, EncoderConfig
from cepe.config import encoder_config_from_decoder
from cepe.layers import RMSNorm
from cepe.wrapping import decoder_layers


def decoder_built(causal: bool, layers: int = 2, **kw) -> CepeForCausalLM:
    dec = tiny_decoder(num_hidden_layers=4)
    enc = encoder_config_from_decoder(dec.config, num_layers=layers, causal=causal)
    cfg = CepeConfig(encoder=enc, chunk_length=8, share_embeddings=True, **kw)
    model = CepeForCausalLM.from_decoder(dec, cfg).eval()
    model.init_encoder_from_decoder()
    return model


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_causal_encoder_from_decoder_is_the_decoder(impl):
    """A causal encoder copied from the first k layers gives the decoder's own (unit-RMS) hidden states."""
    model = decoder_built(causal=True, layers=2, attn_implementation=impl)
    ids = torch.randint(0, 97, (3, 8))
    with torch.no_grad():
        phi = model.encoder(ids)
        hidden = model.decoder(input_ids=ids, output_hidden_states=True).hidden_states[2]
        ref = RMSNorm(hidden.shape[-1], model.cepe_config.encoder.rms_norm_eps)(hidden)
    torch.testing.assert_close(phi, ref, atol=1e-5, rtol=1e-5)


def test_bidirectional_encoder_from_decoder_reads_ahead():
    model = decoder_built(causal=False)
    ids = torch.randint(0, 97, (1, 8))
    ids2 = ids.clone()
    ids2[0, -1] = (ids[0, -1] + 1) % 97
    with torch.no_grad():
        a, b = model.encoder(ids), model.encoder(ids2)
    assert not torch.allclose(a[0, 0], b[0, 0])  # the first position sees the last token
    causal = decoder_built(causal=True)
    with torch.no_grad():
        a, b = causal.encoder(ids), causal.encoder(ids2)
    torch.testing.assert_close(a[0, :-1], b[0, :-1])  # causal: earlier positions do not


def test_causal_padding_matches_unpadded():
    """Right-padded causal chunks: real positions equal the unpadded encoding (eager and sdpa agree)."""
    for impl in ("eager", "sdpa"):
        model = decoder_built(causal=True, attn_implementation=impl)
        ids = torch.randint(0, 97, (2, 8))
        mask = torch.ones(2, 8, dtype=torch.bool)
        mask[1, 5:] = False
        with torch.no_grad():
            out = model.encoder(ids, mask)
            alone = model.encoder(ids[1:, :5])
        torch.testing.assert_close(out[1, :5], alone[0], atol=1e-5, rtol=1e-5)
        assert torch.isfinite(out).all()


def test_shared_embeddings_are_not_adapter_weights():
    model = decoder_built(causal=False)
    keys = set(model.adapter_state_dict())
    assert not any("embed_tokens" in k for k in keys)
    assert model.encoder.embed(torch.tensor([[3]])).data_ptr() != 0
    emb = model.decoder.get_input_embeddings().weight
    assert not emb.requires_grad
    assert all(p is not emb for p in model.trainable_parameters())


def test_shared_embeddings_round_trip(tmp_path):
    model = decoder_built(causal=True, init_mode="gate")
    with torch.no_grad():
        for m in model.cross_attention_modules():
            m.gate.fill_(0.3)
    model.save_pretrained(tmp_path)
    dec = tiny_decoder(num_hidden_layers=4)
    loaded = CepeForCausalLM.from_pretrained(tmp_path, decoder=dec).eval()
    ids, enc = torch.randint(0, 97, (1, 6)), torch.randint(0, 97, (1, 2, 8))
    with torch.no_grad():
        a = model(ids, encoder_input_ids=enc).logits
        b = loaded(ids, encoder_input_ids=enc).logits
    torch.testing.assert_close(a, b)


def test_gate_init_is_exactly_the_decoder_and_learns():
    model = decoder_built(causal=False, init_mode="gate")
    ids, enc = torch.randint(0, 97, (2, 6)), torch.randint(0, 97, (2, 2, 8))
    with torch.no_grad():
        base = model.decoder(input_ids=ids).logits
    out = model(ids, encoder_input_ids=enc, labels=ids, return_logits=True)
    torch.testing.assert_close(out.logits, base)
    out.loss.backward()
    gates = [m.gate.grad for m in model.cross_attention_modules()]
    assert all(g is not None for g in gates) and any(float(g.abs().sum()) > 0 for g in gates)


def test_mirror_init_scores_equal_self_attention_scores():
    """With mirror_self_attention, on Φ = unit-RMS states x, cross-attention k/v equal the layer's
    self-attention k/v on input_layernorm(x)."""
    model = decoder_built(causal=True, mirror_self_attention=True)
    layer = decoder_layers(model.decoder)[1]
    x = torch.randn(2, 5, 64)
    unit = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + layer.input_layernorm.variance_epsilon)
    with torch.no_grad():
        k_cross, v_cross = layer.cross_attn.project_kv(unit)
        normed = layer.input_layernorm(x)
        k_self = layer.self_attn.k_proj(normed).view(2, 5, 2, 16).transpose(1, 2)
        v_self = layer.self_attn.v_proj(normed).view(2, 5, 2, 16).transpose(1, 2)
    torch.testing.assert_close(k_cross, k_self, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_cross, v_self, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.cross_attn.layernorm.weight, layer.input_layernorm.weight)


def test_released_init_copies_pre_mlp_norm():
    dec = tiny_decoder()
    with torch.no_grad():
        for layer in decoder_layers(dec):
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    from conftest import tiny_cepe_config

    model = CepeForCausalLM.from_decoder(dec, tiny_cepe_config(init_mode="copy"))
    for layer in decoder_layers(model.decoder):
        torch.testing.assert_close(layer.cross_attn.layernorm.weight, layer.post_attention_layernorm.weight)
        torch.testing.assert_close(layer.cross_attn.o_proj.weight, layer.self_attn.o_proj.weight)


def test_encoder_from_unsupported_family_is_refused():
    dec = tiny_decoder("qwen2")
    with pytest.raises(ValueError, match="Llama-shaped"):
        encoder_config_from_decoder(dec.config)
    with pytest.raises(ValueError, match="encoder layers"):
        encoder_config_from_decoder(tiny_decoder().config, num_layers=9)


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_cross_attention_carries_per_head_qk_norms(family):
    """Qwen 3 / Gemma 3 normalise every query and key head: cross-attention does the same, with the
    self-attention's norms copied, so on the same input its keys are the layer's pre-RoPE keys."""
    dec = tiny_decoder(family)
    with torch.no_grad():
        for layer in decoder_layers(dec):
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
    from conftest import randomize_cross

    enc = EncoderConfig(vocab_size=97, hidden_size=64, num_attention_heads=4)
    model = CepeForCausalLM.from_decoder(dec, CepeConfig(encoder=enc, chunk_length=8, init_mode="copy"))
    layer = decoder_layers(model.decoder)[0]
    cross = layer.cross_attn
    assert cross.k_norm is not None and cross.q_norm is not None
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        k_cross, _ = cross.project_kv(x)
        k_self = layer.self_attn.k_norm(layer.self_attn.k_proj(x).view(1, 5, 2, 16)).transpose(1, 2)
    torch.testing.assert_close(k_cross, k_self, atol=1e-5, rtol=1e-5)
    # "absorbed" cannot fold a per-key norm into the query: it re-projects, and gives the same logits
    randomize_cross(model)
    with torch.no_grad():
        for layer in decoder_layers(model.decoder):
            layer.cross_attn.k_norm.weight.uniform_(0.5, 1.5)
    ids, enc_ids = torch.randint(0, 97, (1, 6)), torch.randint(0, 97, (1, 2, 8))
    with torch.no_grad():
        ctx_a = model.prepare_context(enc_ids, cross_attention_cache="absorbed")
        ctx_s = model.prepare_context(enc_ids, cross_attention_cache="states")
        a = model(ids, cross_context=ctx_a).logits
        s = model(ids, cross_context=ctx_s).logits
    torch.testing.assert_close(a, s)
