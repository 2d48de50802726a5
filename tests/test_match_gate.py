"""Match-strength head gates (``CepeConfig.match_gate``): head h's output times 2·σ(a_h·m + c_h·κ̂ + b_h),
from the log-mean-exp m of its scores and its attention's concentration κ̂.

The cache modes agree with match gates: ``tests/test_model.py::test_cache_modes_agree``; zero gates are the
adapter without them: ``tests/test_token_gate.py::test_zero_gates_are_exactly_the_adapter_without_them``."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import VOCAB, heads_scaled, random_context, randomize_cross, tiny_cepe_config, tiny_decoder

from cepe import CepeForCausalLM
from cepe.cross_attention import MatchKeys, match_stats_ref, match_stats_sdpa


def _ids(b: int = 2, t: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(5))


def _qk(b=2, h=6, kv=2, t=5, s=40, hd=16, seed=0, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, hd, generator=g) * spread
    k = torch.randn(b, kv, s, hd, generator=g)
    return q, k


def test_stats_by_hand():
    """Equal scores: m is that score and κ̂ = 0; one key far above the rest: κ̂ near 1, m near s − log n."""
    hd, n = 4, 10
    q = torch.zeros(1, 1, 2, hd)
    q[0, 0, 1, 0] = 40.0  # token 1 matches key 3 only
    k = torch.zeros(1, 1, n, hd)
    k[0, 0, :, 1] = 1.0
    k[0, 0, 3, 0] = 1.0
    got = match_stats_ref(q, k, None, scale=0.5)
    torch.testing.assert_close(got[0, 0, 0], torch.tensor([0.0, 0.0]))
    assert got[0, 0, 1, 0].item() == pytest.approx(20.0 - math.log(n), abs=1e-4)
    assert got[0, 0, 1, 1].item() == pytest.approx(1.0, abs=1e-6)
    # masked keys count neither in n nor in the scores
    mask = torch.zeros(1, n, dtype=torch.bool)
    mask[0, :4] = True
    got = match_stats_ref(q, k, mask, scale=0.5)
    assert got[0, 0, 1, 0].item() == pytest.approx(20.0 - math.log(4), abs=1e-4)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("spread", [0.3, 3.0, 12.0])
def test_fused_stats_agree_with_the_reference(masked, spread):
    q, k = _qk(spread=spread)
    mask = None
    if masked:
        mask = torch.ones(2, k.shape[2], dtype=torch.bool)
        mask[0, 25:] = False
        mask[1, ::3] = False
    ref = match_stats_ref(q, k, mask, scale=0.25)
    fast = match_stats_sdpa(q, MatchKeys.build(k, mask), scale=0.25)
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)
    assert (ref[..., 1] >= -1e-5).all() and (ref[..., 1] <= 1 + 1e-5).all()


def test_fused_stats_agree_at_decode_lengths():
    """One query over many keys (the split-key decode kernel's case, no mask) and bf16 inputs."""
    q, k = _qk(b=1, t=1, s=5000, spread=2.0, seed=3)
    ref = match_stats_ref(q, k, None, scale=0.25)
    torch.testing.assert_close(match_stats_sdpa(q, MatchKeys.build(k, None), 0.25), ref, rtol=1e-4, atol=1e-4)
    half = match_stats_sdpa(q.bfloat16(), MatchKeys.build(k.bfloat16(), None), 0.25)
    torch.testing.assert_close(
        half, match_stats_ref(q.bfloat16(), k.bfloat16(), None, 0.25), rtol=1e-3, atol=1e-3
    )


def test_keys_built_in_the_autocast_dtype_give_what_fp32_keys_give():
    """Under autocast the keys are built in bf16 (half the copies); the fused attention cast fp32 keys to
    bf16 anyway, so the statistics are bit for bit those of fp32-built keys."""
    q, k = _qk(b=2, s=300, spread=2.0, seed=4)
    mask = torch.ones(2, 300, dtype=torch.bool)
    mask[1, 200:] = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        keys = MatchKeys.build(k.bfloat16(), mask)
        assert keys.k.dtype == keys.v.dtype == torch.bfloat16
        wide = MatchKeys(keys.k.float(), keys.v.float(), keys.mask, keys.log_n)
        assert torch.equal(match_stats_sdpa(q, keys, 0.25), match_stats_sdpa(q, wide, 0.25))
    assert MatchKeys.build(k.bfloat16(), mask).k.dtype == torch.float32  # no autocast: fp32 as before


def test_checkpoint_recomputation_reuses_the_statistics(monkeypatch):
    """Under gradient checkpointing each layer's statistics are computed once (the recomputation in
    backward reuses them) and the gradients are those of a run without checkpointing; a new query or a
    changed k_proj computes them again."""
    import cepe.cross_attention as ca

    calls = []
    real = ca.match_stats_sdpa
    monkeypatch.setattr(ca, "match_stats_sdpa", lambda *a: calls.append(1) or real(*a))

    def grads(checkpoint: bool):
        model = _gated(null_key=True, token_gate=True).train()
        if checkpoint:
            model.decoder.activation_checkpointing_enable({"use_reentrant": False})
            model.decoder.train()
        enc_ids, enc_mask = random_context(2, 3)
        ctx = model.prepare_context(enc_ids, enc_mask)
        calls.clear()
        with model.use_context(ctx):
            loss = model(_ids(), cross_context=ctx, labels=_ids()).loss
            loss.backward()
        return loss.item(), len(calls), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    loss_a, calls_a, plain = grads(False)
    loss_b, calls_b, ckpt = grads(True)
    layers = len(_gated().cross_attention_modules())
    assert calls_a == calls_b == layers
    assert loss_a == pytest.approx(loss_b, rel=1e-6) and set(plain) == set(ckpt)
    for n, g in plain.items():
        torch.testing.assert_close(ckpt[n], g, rtol=1e-4, atol=1e-6)
    model = _gated()
    m = model.cross_attention_modules()[0]
    ctx = model.prepare_context(*random_context(2, 3), cross_attention_cache="states")
    hidden = torch.randn(2, 5, m.q_proj.in_features, generator=torch.Generator().manual_seed(1))
    calls.clear()
    m(hidden, ctx)
    m(hidden * 2, ctx)  # another query
    assert len(calls) == 2
    with torch.no_grad():
        m.k_proj.weight.mul_(3.0)  # an optimizer step between two calls on one context
    got = m(hidden * 2, ctx)
    assert len(calls) == 3
    with torch.no_grad():
        fresh = model.prepare_context(*random_context(2, 3), cross_attention_cache="states")
        torch.testing.assert_close(got, m(hidden * 2, fresh))


def _gated(seed: int = 3, **kw) -> CepeForCausalLM:
    model = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(match_gate=True, **kw)).eval()
    randomize_cross(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.cross_attention_modules():
            m.match_gate.copy_(torch.randn(m.match_gate.shape, generator=g))
            m.match_norm.copy_(torch.rand(m.match_norm.shape, generator=g) + 0.5)
    return model


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("token_gate", [False, True])
def test_layer_output_by_hand(impl, token_gate):
    model = _gated(attn_implementation=impl, token_gate=token_gate, null_key=True)
    enc_ids, enc_mask = random_context(2, 3)
    enc_mask[1, 2] = False
    ctx = model.prepare_context(enc_ids, enc_mask, cross_attention_cache="states")
    m = model.cross_attention_modules()[0]
    hidden = torch.randn(2, 5, m.q_proj.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = m(hidden, ctx)
        gate, m.match_gate = m.match_gate, None
        tgate, m.token_gate = m.token_gate, None
        b, t = hidden.shape[:2]
        normed = m.layernorm(hidden)
        q = m.q_proj(normed).view(b, t, m.num_heads, m.head_dim).transpose(1, 2)
        k, _ = m.project_kv(ctx.states)
        stats = match_stats_ref(q, k, ctx.key_mask, m.scale)  # (B, H, T, 2), over the real keys
        norm = m.match_norm  # (H, 4): μ_m, σ_m, μ_κ, σ_κ
        stats = (stats - norm[None, :, None, 0::2]) / norm[None, :, None, 1::2]
        logit = stats[..., 0] * gate[:, 0, None] + stats[..., 1] * gate[:, 1, None] + gate[:, 2, None]
        if tgate is not None:
            logit = logit + tgate(normed).transpose(1, 2)
        strength = (2 * torch.sigmoid(logit)).transpose(1, 2)  # (B, T, H)
        want = heads_scaled(m, hidden, ctx, strength)
        m.match_gate, m.token_gate = gate, tgate
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_gate_changes_the_function_and_invariants_hold():
    model = _gated()
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    with torch.no_grad():
        a = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        assert torch.equal(model(ids).logits, tiny_decoder()(ids).logits)  # no context: exactly the decoder
        for m in model.cross_attention_modules():
            m.o_proj.weight.zero_()
        zero_o = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        assert torch.equal(zero_o, tiny_decoder()(ids).logits)  # zero o_proj: exactly the decoder
    randomize_cross(model)
    with torch.no_grad():
        for m in model.cross_attention_modules():
            m.match_gate.zero_()
        b = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert (a - b).abs().max().item() > 1e-3


def test_gradients_reach_the_gate_and_not_through_the_statistics():
    """The statistics are a sensor (no graph even from inputs that require grad); the loss moves a, c, b."""
    q, k = _qk()
    q.requires_grad_(True)
    k.requires_grad_(True)
    assert not match_stats_ref(q, k, None, 0.25).requires_grad
    assert not match_stats_sdpa(q, MatchKeys.build(k, None), 0.25).requires_grad
    model = _gated(null_key=True)
    m = model.cross_attention_modules()[0]
    enc_ids, enc_mask = random_context(2, 3)
    ctx = model.prepare_context(enc_ids, enc_mask, cross_attention_cache="states")
    hidden = torch.randn(2, 5, m.q_proj.in_features, generator=torch.Generator().manual_seed(1))
    m(hidden, ctx).square().sum().backward()
    assert m.match_gate.grad is not None and (m.match_gate.grad != 0).all()
    assert m.q_proj.weight.grad is not None


def test_match_gate_saves_and_loads(tmp_path):
    model = _gated()
    model.save_pretrained(tmp_path)
    loaded = CepeForCausalLM.from_pretrained(tmp_path, decoder=tiny_decoder()).eval()
    assert loaded.cepe_config.match_gate
    for a, b in zip(model.cross_attention_modules(), loaded.cross_attention_modules()):
        assert torch.equal(a.match_gate, b.match_gate)
    with pytest.raises(ValueError):  # an adapter with match gates does not fit a model without them
        CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config()).load_adapter_state_dict(
            model.adapter_state_dict()
        )


def test_calibration_standardises_the_features():
    """Fresh (zero) gates are 1 whatever the norms, so one pass gives every layer its exact statistics."""
    model = _gated()
    with torch.no_grad():
        for m in model.cross_attention_modules():
            m.match_gate.zero_()
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    enc_mask[1] = False  # a row without context is left out of the statistics

    def forward():
        model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask)

    norms = model.calibrate_match_gate(forward)
    assert set(norms) == set(model.cross_layers)
    for m in model.cross_attention_modules():
        m.match_record = []
    with torch.no_grad():
        forward()
    for m in model.cross_attention_modules():
        x = torch.cat(m.match_record, dim=1)  # (H, N, 2), N = one row's tokens
        assert x.shape[1] == ids.shape[1]
        z = (x - m.match_norm[:, None, 0::2]) / m.match_norm[:, None, 1::2]
        torch.testing.assert_close(z.mean(1), torch.zeros_like(z.mean(1)), atol=1e-4, rtol=0)
        torch.testing.assert_close(z.std(1), torch.ones_like(z.std(1)), atol=1e-3, rtol=0)
        m.match_record = None
    plain = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config())
    with pytest.raises(ValueError, match="enable_match_gate"):
        plain.calibrate_match_gate(lambda: None)
    with pytest.raises(ValueError, match="no decoder token with context"):
        model.calibrate_match_gate(lambda: model(ids))


def test_calibration_needs_two_tokens_and_keeps_norms_finite():
    """One decoder token gives no (unbiased) standard deviation: a clear error and the norms untouched, not
    NaN norms that make every later forward with context NaN; non-finite features are refused the same way."""
    model = _gated()
    enc_ids, enc_mask = random_context(1, 2)
    before = [m.match_norm.clone() for m in model.cross_attention_modules()]
    with pytest.raises(ValueError, match="at least 2"):
        model.calibrate_match_gate(
            lambda: model(_ids(1, 1), encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask)
        )
    for m, b in zip(model.cross_attention_modules(), before):
        assert torch.equal(m.match_norm, b) and m.match_record is None
    with torch.no_grad():
        out = model(_ids(1, 4), encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert out.isfinite().all()

    def nan_features():
        for m in model.cross_attention_modules():
            m.match_record.append(torch.full((m.num_heads, 3, 2), float("nan")))

    with pytest.raises(ValueError, match="not finite"):
        model.calibrate_match_gate(nan_features)
    for m, b in zip(model.cross_attention_modules(), before):
        assert torch.equal(m.match_norm, b)
    norms = model.calibrate_match_gate(  # two tokens in all (two calls of one) are enough
        lambda: [model(_ids(1, 1), encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask) for _ in "ab"]
    )
    assert all(n.isfinite().all() for n in norms.values())


def test_match_gate_stats_script(tmp_path, capsys):
    """``scripts/match_gate_stats.py``: weights that moved together read as correlation 1 and one sign."""
    from conftest import load_script

    script = load_script("match_gate_stats")
    model = _gated()
    with torch.no_grad():
        for m in model.cross_attention_modules():
            col = torch.randn(m.num_heads, 1, generator=torch.Generator().manual_seed(m.layer_idx))
            m.match_gate.copy_(col * torch.tensor([1.0, 2.0, 0.5]))
    model.save_pretrained(tmp_path / "a")
    s = script.stats(script.weights(str(tmp_path / "a")))
    assert s["corr_a_b"] == pytest.approx(1.0) and s["corr_c_b"] == pytest.approx(1.0)
    assert s["one_sign"] == 1.0
    script.main([str(tmp_path / "a")])
    assert "one sign 100 %" in capsys.readouterr().out
    CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config()).save_pretrained(tmp_path / "b")
    with pytest.raises(SystemExit, match="no match gates"):
        script.weights(str(tmp_path / "b"))


def test_sensor_cost_script(capsys):
    """``scripts/sensor_cost.py`` times the three parts on a small shape and prints each."""
    from conftest import load_script

    out = load_script("sensor_cost").main(["--keys", "64", "--repeat", "1"])
    assert set(out) == {"attention_ms", "build_keys_ms", "sensor_attention_ms"}
    assert all(v > 0 for v in out.values())
    assert "sensor_attention_ms:" in capsys.readouterr().out


def test_shift_match_gates_script(tmp_path):
    """``scripts/shift_match_gates.py``: the bias row and both match weights move by exactly what is asked;
    zero shifts are the adapter itself, and a very negative bias closes every gate (the decoder alone)."""
    from conftest import load_script

    script = load_script("shift_match_gates")
    model = _gated()
    model.save_pretrained(tmp_path / "a")
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)

    def logits(path=None, m=None):
        m = m or CepeForCausalLM.from_pretrained(path, decoder=tiny_decoder()).eval()
        with torch.no_grad():
            return m(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits

    same = script.main([str(tmp_path / "a"), str(tmp_path / "same"), "--bias", "0", "--gain", "0"])
    assert torch.equal(logits(same), logits(m=model))
    moved = CepeForCausalLM.from_pretrained(
        script.shift(str(tmp_path / "a"), str(tmp_path / "moved"), -1.5, 0.25), decoder=tiny_decoder()
    )
    for a, b in zip(model.cross_attention_modules(), moved.cross_attention_modules()):
        torch.testing.assert_close(
            b.match_gate - a.match_gate, torch.tensor([0.25, 0.25, -1.5]).expand_as(a.match_gate)
        )
    shut = script.main([str(tmp_path / "a"), str(tmp_path / "shut"), "--bias", "-200", "--gain", "0"])
    with torch.no_grad():
        alone = model(ids).logits
    torch.testing.assert_close(logits(shut), alone, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(logits(m=model), alone)
    CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config()).save_pretrained(tmp_path / "b")
    with pytest.raises(SystemExit, match="no match gates"):
        script.main([str(tmp_path / "b"), str(tmp_path / "c"), "--bias", "-1", "--gain", "0"])
