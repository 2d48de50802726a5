"""The cross-attention "no match" key (``CepeConfig.null_key``): a learned key per KV head with a zero value."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import VOCAB, random_context, randomize_cross, tiny_cepe_config, tiny_decoder

from cepe import CepeForCausalLM


def _model(**kw) -> CepeForCausalLM:
    model = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(null_key=True, **kw)).eval()
    randomize_cross(model)
    return model


def _ids(b: int = 2, t: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_layer_output_by_hand(impl):
    """Each head's softmax runs over [null key, real keys] with the null value zero: written out by hand."""
    model = _model(attn_implementation=impl, pack_keys=False)
    enc_ids, enc_mask = random_context(2, 3)
    enc_mask[1, 1:] = False  # padding in example 1
    ctx = model.prepare_context(enc_ids, enc_mask, cross_attention_cache="states")
    m = model.cross_attention_modules()[0]
    hidden = torch.randn(2, 5, m.q_proj.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = m(hidden, ctx)
        b, t, h, kv, hd = 2, 5, m.num_heads, m.num_kv, m.head_dim
        q = m.q_proj(m.layernorm(hidden)).view(b, t, h, hd).transpose(1, 2)  # (B, H, T, hd)
        k, v = m.project_kv(ctx.states)  # (B, KV, S, hd)
        rep = h // kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        null = m.null_key.repeat_interleave(rep, 0)  # (H, hd)
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)  # (B, H, T, S)
        mask = ctx.key_mask if ctx.key_mask is not None else torch.ones(b, k.shape[2], dtype=torch.bool)
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        null_score = (q * null[None, :, None, :]).sum(-1, keepdim=True) / math.sqrt(hd)  # (B, H, T, 1)
        p = torch.softmax(torch.cat([null_score, scores], -1), -1)[..., 1:]  # the null value is 0
        heads = p @ v  # (B, H, T, hd)
        if m.gate is not None:
            heads = heads * torch.tanh(m.gate)[None, :, None, None]
        want = m.o_proj(heads.transpose(1, 2).reshape(b, t, -1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the same as attention over the real keys scaled by sigmoid(lse - null score), per head
    assert float(p.sum(-1).max()) < 1.0


def test_null_key_changes_the_function():
    """The cache modes agree with null keys (``tests/test_model.py::test_cache_modes_agree``); here: the same
    weights without null keys compute something else."""
    model = _model()
    plain = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config()).eval()
    randomize_cross(plain)
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    with torch.no_grad():
        a = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        b = plain(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert (a - b).abs().max().item() > 1e-3


def test_invariants_hold_with_a_null_key():
    """No context, a fully padded context or a zero o_proj: exactly the decoder."""
    model = _model()
    ids = _ids()
    with torch.no_grad():
        ref = tiny_decoder()(ids).logits
        assert torch.equal(model(ids).logits, ref)
        enc_ids, enc_mask = random_context(2, 2)
        assert torch.equal(
            model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=torch.zeros_like(enc_mask)).logits,
            ref,
        )
        for m in model.cross_attention_modules():
            m.o_proj.weight.zero_()
        assert torch.equal(model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits, ref)


def test_null_key_saves_loads_and_starts_at_zero(tmp_path):
    fresh = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(null_key=True, init_mode="gate"))
    assert all(not m.null_key.any() for m in fresh.cross_attention_modules())
    model = _model()
    model.save_pretrained(tmp_path)
    loaded = CepeForCausalLM.from_pretrained(tmp_path, decoder=tiny_decoder()).eval()
    assert loaded.cepe_config.null_key
    for a, b in zip(model.cross_attention_modules(), loaded.cross_attention_modules()):
        assert torch.equal(a.null_key, b.null_key)
    with pytest.raises(ValueError):  # an adapter with null keys does not fit a model without them
        CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config()).load_adapter_state_dict(
            {k: v for k, v in model.adapter_state_dict().items()}
        )


def test_a_stage_adds_null_keys_to_an_adapter_and_trains_them(tmp_path):
    """``cepe: {null_key: true}`` over an ``init_adapter`` trained without: zero null keys that then train
    (and are saved with the adapter)."""
    import yaml

    from cepe.training.config import load_config
    from cepe.training.models import build_model
    from cepe.training.trainer import train

    d = yaml.safe_load(open("configs/train/tiny/cepe.yaml"))
    d.pop("init_adapter")
    d.update(steps=2, progress=False, encoder_init="decoder", encoder={"num_hidden_layers": 1})
    first = train(load_config({**d, "output_dir": str(tmp_path / "first")}))
    assert not CepeForCausalLM.from_pretrained(first, decoder=_tiny(d)).cepe_config.null_key
    cfg = load_config(
        {**d, "output_dir": str(tmp_path / "run"), "init_adapter": str(first), "cepe": {"null_key": True}}
    )
    model = build_model(cfg)
    assert model.cepe_config.null_key and all(not m.null_key.any() for m in model.cross_attention_modules())
    out = train(cfg)
    trained = CepeForCausalLM.from_pretrained(out, decoder=_tiny(d))
    assert trained.cepe_config.null_key
    assert any(m.null_key.abs().sum() > 0 for m in trained.cross_attention_modules())


def _tiny(d):
    from cepe.training.config import load_config
    from cepe.training.models import build_decoder

    return build_decoder(load_config({**d, "output_dir": "unused"}))


def test_a_stage_switches_an_adapters_encoder_to_bidirectional(tmp_path):
    """``encoder: {causal: false}`` over an ``init_adapter`` with a causal encoder: the same weights attend
    both ways within a chunk (Φ changes, the first token of a chunk now sees the rest), and the saved
    adapter says so."""
    import yaml

    from cepe.training.config import load_config
    from cepe.training.models import build_model

    d = yaml.safe_load(open("configs/train/tiny/cepe.yaml"))
    d.pop("init_adapter")
    d.update(
        steps=1, progress=False, encoder_init="decoder", encoder={"num_hidden_layers": 1, "causal": True}
    )
    from cepe.training.trainer import train

    first = train(load_config({**d, "output_dir": str(tmp_path / "first")}))
    causal = CepeForCausalLM.from_pretrained(first, decoder=_tiny(d)).eval()
    assert causal.cepe_config.encoder.causal
    cfg = load_config(
        {**d, "output_dir": str(tmp_path / "run"), "init_adapter": str(first), "encoder": {"causal": False}}
    )
    model = build_model(cfg).eval()
    assert not model.cepe_config.encoder.causal
    enc_ids, enc_mask = random_context(1, 2)
    with torch.no_grad():
        a, _ = causal.encode_context(enc_ids, enc_mask)
        b, _ = model.encode_context(enc_ids, enc_mask)
    assert not torch.allclose(a[:, 0], b[:, 0])  # the first token now reads the whole chunk
    model.save_pretrained(tmp_path / "saved")
    assert not CepeForCausalLM.from_pretrained(
        tmp_path / "saved", decoder=_tiny(d)
    ).cepe_config.encoder.causal
