"""Context-length exponents (``CepeConfig.length_scale``): head h's query times ``(n / length_scale)^τ_h``."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, random_context, randomize_cross, tiny_cepe_config, tiny_decoder

from cepe import CepeForCausalLM


def _ids(b: int = 2, t: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(5))


def _scaled(ref: int = 16, **kw) -> CepeForCausalLM:
    model = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(length_scale=ref, **kw)).eval()
    randomize_cross(model)  # exponents near 1 (1-D parameters are randomised around 1)
    return model


def _context():
    enc_ids, enc_mask = random_context(2, 3)  # 24 context tokens per example
    enc_mask[1, 1:] = False  # example 1: 8 real tokens
    return enc_ids, enc_mask


def test_layer_output_by_hand():
    model = _scaled()
    m = model.cross_attention_modules()[0]
    enc_ids, enc_mask = _context()
    ctx = model.prepare_context(enc_ids, enc_mask, cross_attention_cache="states")
    hidden = torch.randn(2, 5, m.q_proj.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = m(hidden, ctx)
        b, t = hidden.shape[:2]
        q = m.q_proj(m.layernorm(hidden)).view(b, t, m.num_heads, m.head_dim).transpose(1, 2)
        k, v = m.project_kv(ctx.states)
        groups = m.num_heads // m.num_kv
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        want = []
        for i, n in enumerate((24, 8)):
            f = (n / 16) ** m.length_exp  # (H,)
            s = (q[i] * f[:, None, None]) @ k[i, :, :n].transpose(-1, -2) * m.scale  # (H, T, n)
            want.append(torch.softmax(s, -1) @ v[i, :, :n])
        out = torch.stack(want).transpose(1, 2).reshape(b, t, -1)
        want = m.o_proj(out)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_zero_exponents_are_exactly_the_adapter_without_them():
    plain = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config()).eval()
    randomize_cross(plain)
    ids = _ids()
    enc_ids, enc_mask = _context()
    with torch.no_grad():
        before = plain(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        plain.enable_length_scale(16)
        plain.enable_length_scale(16)  # idempotent
        after = plain(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert plain.cepe_config.length_scale == 16 and torch.equal(before, after)
    with pytest.raises(ValueError, match="length_scale is 16"):
        plain.enable_length_scale(32)
    fresh = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(length_scale=8, init_mode="gate"))
    assert all(not m.length_exp.any() for m in fresh.cross_attention_modules())
    with pytest.raises(ValueError, match="length_scale must be a positive"):
        tiny_cepe_config(length_scale=0)


def test_the_reference_length_is_unscaled_and_other_lengths_are_not():
    """At n = length_scale the factor is exactly 1 whatever the exponents; at other n they change the output;
    no context is still exactly the decoder."""
    enc_ids, enc_mask = random_context(1, 2)  # 16 real tokens
    model = _scaled(ref=16)
    ids = _ids(1)
    with torch.no_grad():
        a = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        assert torch.equal(model(ids).logits, tiny_decoder()(ids).logits)
        for m in model.cross_attention_modules():
            m.length_exp.zero_()
        b = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert torch.equal(a, b)
    model = _scaled(ref=64)
    with torch.no_grad():
        c = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        for m in model.cross_attention_modules():
            m.length_exp.zero_()
        d = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert (c - d).abs().max().item() > 1e-3 and torch.equal(d, b)


def test_gradients_reach_the_exponents():
    """(The cache modes agree with exponents: ``tests/test_model.py::test_cache_modes_agree``.)"""
    model = _scaled(null_key=True, match_gate=True).train()
    enc_ids, enc_mask = _context()
    loss = model(_ids(), encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask, labels=_ids()).loss
    loss.backward()
    grads = [m.length_exp.grad for m in model.cross_attention_modules()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads) and any(
        g.abs().sum() > 0 for g in grads
    )


def test_saves_and_loads(tmp_path):
    model = _scaled()
    model.save_pretrained(tmp_path)
    loaded = CepeForCausalLM.from_pretrained(tmp_path, decoder=tiny_decoder()).eval()
    assert loaded.cepe_config.length_scale == 16
    for a, b in zip(model.cross_attention_modules(), loaded.cross_attention_modules()):
        assert torch.equal(a.length_exp, b.length_exp) and b.length_ref == 16.0
    with pytest.raises(ValueError):  # exponents do not fit a model without them
        CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config()).load_adapter_state_dict(
            model.adapter_state_dict()
        )


def test_scale_length_exponents_script(tmp_path):
    """alpha 0 gives the adapter without exponents' function, 1 the trained one, 0.5 half of every τ."""
    from conftest import load_script

    script = load_script("scale_length_exponents")
    model = _scaled()
    model.save_pretrained(tmp_path / "a")
    ids = _ids()
    enc_ids, enc_mask = _context()

    def logits(path):
        m = CepeForCausalLM.from_pretrained(path, decoder=tiny_decoder()).eval()
        with torch.no_grad():
            return m(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits, m

    trained, _ = logits(tmp_path / "a")
    script.main([str(tmp_path / "a"), str(tmp_path / "one"), "--alpha", "1"])
    assert torch.equal(logits(tmp_path / "one")[0], trained)
    script.main([str(tmp_path / "a"), str(tmp_path / "zero"), "--alpha", "0"])
    with torch.no_grad():
        for m in model.cross_attention_modules():
            m.length_exp.zero_()
        plain = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert torch.equal(logits(tmp_path / "zero")[0], plain)
    _, half = logits(script.main([str(tmp_path / "a"), str(tmp_path / "half"), "--alpha", "0.5"]))
    for a, b in zip(_scaled().cross_attention_modules(), half.cross_attention_modules()):
        assert torch.equal(b.length_exp, a.length_exp * 0.5)
    CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config()).save_pretrained(tmp_path / "b")
    with pytest.raises(SystemExit, match="no length exponents"):
        script.main([str(tmp_path / "b"), str(tmp_path / "c"), "--alpha", "0.5"])


def test_below_leaves_contexts_at_or_above_the_pivot_unscaled():
    """``length_scale_below``: n is capped at length_scale, so a context of 24 tokens with the pivot at 16
    reads exactly as with zero exponents, and one of 8 tokens as without the cap."""
    enc_ids, enc_mask = random_context(1, 3)  # 24 real tokens
    short_mask = enc_mask.clone()
    short_mask[0, 1:] = False  # 8 real tokens
    ids = _ids(1)

    def run(mask, below, zero=False):
        model = _scaled(ref=16, length_scale_below=below)
        with torch.no_grad():
            if zero:
                for m in model.cross_attention_modules():
                    m.length_exp.zero_()
            return model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=mask).logits

    assert torch.equal(run(enc_mask, True), run(enc_mask, False, zero=True))
    assert not torch.allclose(run(enc_mask, False), run(enc_mask, False, zero=True))
    assert torch.equal(run(short_mask, True), run(short_mask, False))
    plain = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config())
    plain.enable_length_scale(16, below=True)
    assert plain.cepe_config.length_scale_below and plain.cross_attention_modules()[0].length_below
    with pytest.raises(ValueError, match="below"):
        plain.enable_length_scale(16)


def test_above_scales_only_contexts_beyond_the_pivot():
    """``length_scale_above``: below the pivot (8 tokens, pivot 16) the exponents above change nothing; above
    it (24 tokens) the factor is ``(n / 16)^τ'_h`` times what ``length_scale_below`` leaves (exactly 1
    there), which is an uncapped model whose τ is τ'. Added to a capped adapter it changes nothing."""
    enc_ids, enc_mask = random_context(1, 3)  # 24 real tokens
    short_mask = enc_mask.clone()
    short_mask[0, 1:] = False  # 8 real tokens
    ids = _ids(1)
    both = _scaled(ref=16, length_scale_below=True, length_scale_above=True)
    capped = _scaled(ref=16, length_scale_below=True)
    uncapped = _scaled(ref=16)
    for b, c, u in zip(*(m.cross_attention_modules() for m in (both, capped, uncapped))):
        assert not torch.equal(b.length_exp_above, b.length_exp)  # randomised apart
        weights = dict(b.named_parameters())
        with torch.no_grad():
            for name, p in c.named_parameters():  # the same weights; the uncapped τ is τ'
                p.copy_(weights[name])
                u.get_parameter(name).copy_(weights["length_exp_above" if name == "length_exp" else name])

    def run(model, mask):
        with torch.no_grad():
            return model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=mask).logits

    assert torch.equal(run(both, short_mask), run(capped, short_mask))
    assert torch.equal(run(both, enc_mask), run(uncapped, enc_mask))
    assert not torch.allclose(run(both, enc_mask), run(capped, enc_mask))
    before = run(capped, enc_mask)
    capped.enable_length_scale(16, below=True, above=True)
    capped.enable_length_scale(16, below=True, above=True)  # idempotent
    assert capped.cepe_config.length_scale_above and torch.equal(run(capped, enc_mask), before)
    with pytest.raises(ValueError, match="length_scale_above"):
        capped.enable_length_scale(16, below=True)
    with pytest.raises(ValueError, match="need length_scale"):
        tiny_cepe_config(length_scale_above=True)


def test_scale_length_exponents_script_scales_the_exponents_above_too_or_alone(tmp_path):
    from conftest import load_script

    model = _scaled(ref=16, length_scale_below=True, length_scale_above=True)
    model.save_pretrained(tmp_path / "a")
    load_script("scale_length_exponents").main([str(tmp_path / "a"), str(tmp_path / "h"), "--alpha", "0.5"])
    half = CepeForCausalLM.from_pretrained(tmp_path / "h", decoder=tiny_decoder())
    for a, b in zip(model.cross_attention_modules(), half.cross_attention_modules()):
        assert torch.equal(b.length_exp, a.length_exp * 0.5)
        assert torch.equal(b.length_exp_above, a.length_exp_above * 0.5)
    script = load_script("scale_length_exponents")
    script.main([str(tmp_path / "a"), str(tmp_path / "up"), "--alpha", "0.5", "--only", "above"])
    up = CepeForCausalLM.from_pretrained(tmp_path / "up", decoder=tiny_decoder())
    for a, b in zip(model.cross_attention_modules(), up.cross_attention_modules()):
        assert torch.equal(b.length_exp, a.length_exp)
        assert torch.equal(b.length_exp_above, a.length_exp_above * 0.5)
    _scaled(ref=16).save_pretrained(tmp_path / "b")
    with pytest.raises(SystemExit, match="no above length exponents"):
        script.main([str(tmp_path / "b"), str(tmp_path / "c"), "--alpha", "0.5", "--only", "above"])


def test_graft_length_exponents_script(tmp_path):
    """The donor's exponents and gates above the pivot on the base: contexts under the pivot read as the base,
    longer ones as the donor (which differs from the base in its exponents below the pivot and above it and
    in its long gates)."""
    from conftest import load_script

    script = load_script("graft_length_exponents")
    base = _scaled(ref=16, length_scale_below=True)
    base.save_pretrained(tmp_path / "base")
    donor = CepeForCausalLM.from_pretrained(tmp_path / "base", decoder=tiny_decoder()).eval()
    donor.enable_length_scale(16, below=True, above=True)
    donor.enable_long_gate()
    with torch.no_grad():
        for m in donor.cross_attention_modules():
            m.length_exp.mul_(-2.0)
            m.length_exp_above.fill_(0.7)
            m.long_gate.bias.fill_(-0.4)
    donor.save_pretrained(tmp_path / "donor")
    out = script.main([str(tmp_path / "base"), str(tmp_path / "donor"), str(tmp_path / "out")])
    grafted = CepeForCausalLM.from_pretrained(out, decoder=tiny_decoder()).eval()
    c = grafted.cepe_config
    assert c.length_scale_above and c.length_scale_below and c.long_gate
    enc_ids, long_mask = random_context(1, 3)  # 24 real tokens
    short_mask = long_mask.clone()
    short_mask[0, 1:] = False  # 8

    def run(model, mask):
        with torch.no_grad():
            return model(_ids(1), encoder_input_ids=enc_ids, encoder_attention_mask=mask).logits

    assert torch.equal(run(grafted, short_mask), run(base, short_mask))
    assert torch.equal(run(grafted, long_mask), run(donor, long_mask))
    assert not torch.allclose(run(grafted, long_mask), run(base, long_mask))
    with pytest.raises(SystemExit, match="no weights above"):
        script.main([str(tmp_path / "donor"), str(tmp_path / "base"), str(tmp_path / "x")])
    _scaled(ref=32, length_scale_below=True, length_scale_above=True).save_pretrained(tmp_path / "other")
    with pytest.raises(SystemExit, match="pivots differ"):
        script.main([str(tmp_path / "base"), str(tmp_path / "other"), str(tmp_path / "x")])


def test_length_exp_stats_script(tmp_path):
    """The script's numbers are the saved exponents' and gates' own."""
    from conftest import load_script

    model = _scaled(ref=16, length_scale_below=True, length_scale_above=True, short_gate=True)
    with torch.no_grad():
        for i, m in enumerate(model.cross_attention_modules()):
            m.length_exp.copy_(torch.linspace(-0.1, 0.2, m.num_heads))
            m.length_exp_above.fill_(0.01 * (i + 1))
            m.short_gate.bias.fill_(-0.5)
    model.save_pretrained(tmp_path / "a")
    res = load_script("length_exp_stats").main([str(tmp_path / "a"), "--align-heads", "1"])[
        str(tmp_path / "a")
    ]
    m = model.cross_attention_modules()[0]
    n = len(model.cross_attention_modules())
    assert res["length_exp"]["heads"] == n * m.num_heads
    assert res["length_exp"]["median_align_heads"] == pytest.approx(-0.1)
    assert res["length_exp"]["above_0.05"] == n * int((m.length_exp > 0.05).sum())
    assert res["length_exp_above"]["max"] == pytest.approx(0.01 * n)
    assert res["short_gate"]["median_bias"] == pytest.approx(-0.5)
    plain = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config())
    plain.save_pretrained(tmp_path / "b")
    with pytest.raises(SystemExit, match="no length exponents"):
        load_script("length_exp_stats").main([str(tmp_path / "b")])
