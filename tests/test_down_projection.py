"""The encoder's learned down-projection of Φ (``EncoderConfig.output_size``): config, init, caches, I/O."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_decoder

from cepe import CepeConfig, CepeForCausalLM, EncoderConfig
from cepe.config import encoder_config_from_decoder
from cepe.encoder import EncoderForMaskedLM
from cepe.modeling import projection_init
from cepe.wrapping import decoder_layers


def projected(output_size: int | None, seed: int = 0, **kw) -> CepeForCausalLM:
    """A tiny decoder (width 64) with an encoder built from its first 2 layers, gated, mirrored, and the
    gates opened so that the context changes the logits."""
    dec = tiny_decoder(num_hidden_layers=4, seed=seed)
    enc = encoder_config_from_decoder(dec.config, num_layers=2, causal=True, output_size=output_size)
    kw = {"init_mode": "gate", "mirror_self_attention": True, **kw}
    cfg = CepeConfig(encoder=enc, chunk_length=8, share_embeddings=True, **kw)
    model = CepeForCausalLM.from_decoder(dec, cfg).eval()
    model.init_encoder_from_decoder()
    with torch.no_grad():
        for m in model.cross_attention_modules():
            if m.gate is not None:
                m.gate.fill_(0.7)
    return model


def inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (2, 6), generator=g), torch.randint(0, 97, (2, 3, 8), generator=g)


def test_output_size_is_validated():
    with pytest.raises(ValueError, match="output_size"):
        EncoderConfig(vocab_size=10, hidden_size=32, num_attention_heads=2, output_size=64)
    with pytest.raises(ValueError, match="output_size"):
        EncoderConfig(vocab_size=10, hidden_size=32, num_attention_heads=2, output_size=0)
    cfg = EncoderConfig(vocab_size=10, hidden_size=32, num_attention_heads=2, output_size=8)
    assert cfg.state_size == 8
    assert EncoderConfig(vocab_size=10, hidden_size=32, num_attention_heads=2).state_size == 32


def test_full_width_projection_is_the_model_without_one():
    """output_size = the width: the basis is orthogonal, so k_proj(out_proj(x)) = the mirrored k/v."""
    ids, enc = inputs()
    with torch.no_grad():
        plain = projected(None)(ids, encoder_input_ids=enc).logits
        full = projected(64)(ids, encoder_input_ids=enc).logits
    torch.testing.assert_close(full, plain, atol=1e-5, rtol=1e-5)


def test_narrow_projection_changes_the_function_but_not_the_decoder_alone():
    ids, enc = inputs()
    model = projected(16)
    with torch.no_grad():
        plain = projected(None)(ids, encoder_input_ids=enc).logits
        narrow = model(ids, encoder_input_ids=enc).logits
        alone = model(ids).logits
        base = model.decoder(input_ids=ids).logits
    assert not torch.allclose(narrow, plain, atol=1e-4)
    torch.testing.assert_close(alone, base, atol=0, rtol=0)  # no context: exactly the decoder
    with torch.no_grad():
        for m in model.cross_attention_modules():
            m.o_proj.weight.zero_()
        zeroed = model(ids, encoder_input_ids=enc).logits
    torch.testing.assert_close(zeroed, base, atol=0, rtol=0)  # zero o_proj: exactly the decoder


def test_phi_has_the_projected_width_and_caches_agree():
    """Φ is (B, S, output_size); the kv, states and absorbed caches give the same generation."""
    model = projected(16)
    ids, enc = inputs()
    with torch.no_grad():
        phi, mask = model.encode_context(enc)
        assert phi.shape == (2, 24, 16) and mask.shape == (2, 24)
        outs = {
            mode: model.generate(
                ids, encoder_input_ids=enc, cross_attention_cache=mode, max_new_tokens=4, do_sample=False
            )
            for mode in ("kv", "states", "absorbed")
        }
        logits = {
            mode: model(ids, encoder_input_ids=enc, cross_attention_cache=mode).logits
            for mode in ("kv", "states", "absorbed")
        }
    assert torch.equal(outs["kv"], outs["states"]) and torch.equal(outs["kv"], outs["absorbed"])
    torch.testing.assert_close(logits["absorbed"], logits["states"], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"\(B, S, 16\)"):
        model(ids, encoder_hidden_states=torch.zeros(2, 24, 64))
    with torch.no_grad():
        given = model(ids, encoder_hidden_states=phi, encoder_attention_mask=mask).logits
    torch.testing.assert_close(given, logits["kv"], atol=1e-6, rtol=1e-6)


def test_projection_init_is_the_best_of_its_rank():
    """Σ = I: P has orthonormal rows, A_i = W_i Pᵀ, and the maps lose exactly their tail singular values,
    less than through a random basis; a function of the weights (signs fixed)."""
    g = torch.Generator().manual_seed(0)
    maps = [torch.randn(12, 20, generator=g) for _ in range(3)]
    proj, parts = projection_init(maps, 6)  # (6, 20), 3 × (12, 6)
    torch.testing.assert_close(proj @ proj.T, torch.eye(6), atol=1e-5, rtol=0)
    for w, a in zip(maps, parts):
        torch.testing.assert_close(a, w @ proj.T, atol=1e-5, rtol=1e-5)
    stacked = torch.cat(maps).double()
    err = (stacked - torch.cat(parts).double() @ proj.double()).pow(2).sum()
    tail = torch.linalg.svdvals(stacked)[6:].pow(2).sum()
    torch.testing.assert_close(err, tail, atol=1e-4, rtol=1e-5)
    q, _ = torch.linalg.qr(torch.randn(20, 6, generator=g, dtype=torch.float64))
    assert float((stacked - stacked @ q @ q.T).pow(2).sum()) > float(err)
    again, _ = projection_init([m.clone() for m in maps], 6)
    assert torch.equal(again, proj)


def test_projection_init_fitted_to_inputs():
    """With the inputs' second moment, the loss on those inputs is the tail of W Σ^½'s spectrum, below the
    weights-only init's, and the projected inputs have second moment I."""
    g = torch.Generator().manual_seed(1)
    maps = [torch.randn(12, 20, generator=g) for _ in range(3)]
    mix = torch.randn(20, 20, generator=g) * torch.logspace(0, -2, 20)  # anisotropic inputs
    x = torch.randn(4000, 20, generator=g) @ mix.T
    moment = x.T.double() @ x.double() / x.shape[0]
    stacked = torch.cat(maps).double()

    def data_err(proj, parts):
        rec = torch.cat(parts).double() @ proj.double()
        return float(((stacked - rec) @ x.double().T).pow(2).sum() / x.shape[0])

    fitted = projection_init(maps, 6, moment)
    plain = projection_init(maps, 6)
    evals, evecs = torch.linalg.eigh(moment)
    tail = torch.linalg.svdvals(stacked @ (evecs * evals.sqrt()) @ evecs.T)[6:].pow(2).sum()
    assert data_err(*fitted) == pytest.approx(float(tail), rel=1e-4)
    assert data_err(*fitted) < 0.5 * data_err(*plain)
    px = x.double() @ fitted[0].double().T
    torch.testing.assert_close(px.T @ px / x.shape[0], torch.eye(6, dtype=torch.float64), atol=1e-4, rtol=0)


def test_fit_projection_keeps_more_of_what_kv_read():
    model = projected(16)
    _, chunks = inputs()
    layers = decoder_layers(model.decoder)

    def kv_err() -> float:
        with torch.no_grad():
            x = model.encoder(chunks.reshape(-1, 8), project=False).reshape(-1, 64)
            px = model.encoder.out_proj(x)
            total = 0.0
            for i in model.cross_layers:
                layer, cross = layers[i], layers[i].cross_attn
                fold = layer.input_layernorm.weight
                for full, mine in (
                    (layer.self_attn.k_proj, cross.k_proj),
                    (layer.self_attn.v_proj, cross.v_proj),
                ):
                    total += float((x @ (full.weight * fold).T - mine(px)).pow(2).sum())
        return total

    before = kv_err()
    model.fit_projection(chunks)
    assert kv_err() < 0.9 * before
    fitted = model.encoder.out_proj.weight.clone()
    mask = torch.ones(2, 4, 8, dtype=torch.bool)
    mask[:, 3] = False  # a chunk of padding only: skipped, as encode_chunks skips it
    model.fit_projection(torch.cat([chunks, chunks[:, :1]], dim=1), mask)
    torch.testing.assert_close(model.encoder.out_proj.weight, fitted)
    with pytest.raises(ValueError, match="output_size"):
        projected(None).fit_projection(chunks)


def test_projection_init_follows_the_stacked_kv_maps():
    model = projected(16)
    layers = decoder_layers(model.decoder)
    w = model.encoder.out_proj.weight  # (16, 64)
    for i in model.cross_layers:
        cross, layer = layers[i].cross_attn, layers[i]
        fold = layer.input_layernorm.weight
        torch.testing.assert_close(cross.k_proj.weight, (layer.self_attn.k_proj.weight * fold) @ w.T)
        torch.testing.assert_close(cross.v_proj.weight, (layer.self_attn.v_proj.weight * fold) @ w.T)


def test_projection_trains_saves_and_loads(tmp_path):
    model = projected(16)
    ids, enc = inputs()
    out = model(ids, encoder_input_ids=enc, labels=ids)
    out.loss.backward()
    grad = model.encoder.out_proj.weight.grad
    assert grad is not None and float(grad.abs().sum()) > 0
    assert "encoder.out_proj.weight" in model.adapter_state_dict()
    with torch.no_grad():
        model.encoder.out_proj.weight.add_(0.01)
    model.save_pretrained(tmp_path)
    loaded = CepeForCausalLM.from_pretrained(tmp_path, decoder=tiny_decoder(num_hidden_layers=4)).eval()
    assert loaded.cepe_config.encoder.output_size == 16
    with torch.no_grad():
        a = model.eval()(ids, encoder_input_ids=enc).logits
        b = loaded(ids, encoder_input_ids=enc).logits
    torch.testing.assert_close(a, b)


def test_separate_encoder_with_projection_and_its_mlm_head():
    """A narrow separate encoder may project too (random init); the MLM head reads the projected Φ."""
    enc = EncoderConfig(
        vocab_size=98,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        mask_token_id=97,
        output_size=8,
    )
    model = CepeForCausalLM.from_decoder(tiny_decoder(), CepeConfig(encoder=enc, chunk_length=8)).eval()
    ids, chunks = inputs()
    with torch.no_grad():
        phi, _ = model.encode_context(chunks)
        assert phi.shape[-1] == 8
        assert model(ids, encoder_input_ids=chunks).logits.shape == (2, 6, 97)
    mlm = EncoderForMaskedLM(enc)
    labels = torch.full((2, 8), -100)
    labels[:, 2] = 5
    loss, logits = mlm(torch.randint(0, 97, (2, 8)), labels=labels)
    assert logits.shape == (2, 98) and torch.isfinite(loss)
