"""Run biases (``CepeConfig.run_bias``): head h adds β_h to each query's score on ``j⁺``, the key after the
one its previous query attended to most, so that a copy under way continues.

The fused path (the kernel's output corrected in closed form) against the reference (the bias in the full
score matrix), values and gradients; the logsumexp with its own gradient; zero biases are the adapter
without them; generation carries the read position; a stage adds them and trains only them."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    check_beam_scores,
    check_checkpointing_gradients,
    check_enabling_keeps_the_function,
    check_incremental_calls,
    check_left_padded_generation,
    check_read_state_options,
    check_saved_option,
    random_context,
    randomize_cross,
    tiny_cepe_config,
    tiny_decoder,
)

from cepe import CepeForCausalLM
from cepe.cross_attention import KeysLogsumexp, best_keys_ref, successor_keys
from cepe.layers import attention_ref


def _mask(s: int = 40) -> torch.Tensor:
    mask = torch.ones(2, s, dtype=torch.bool)
    mask[0, 25:] = False  # trailing padding (packed keys)
    mask[1, ::3] = False  # holes (unpacked chunks)
    return mask


@pytest.mark.parametrize("masked", [False, True])
def test_logsumexp_and_its_gradient(masked, monkeypatch):
    """Chunked over queries (a tiny chunk forces several), it equals torch.logsumexp of the masked fp32
    scores, and its gradients equal autograd's through them."""
    monkeypatch.setattr("cepe.cross_attention.READ_CHUNK", 100)
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(2, 6, 9, 16, generator=g) * 2).requires_grad_(True)
    k = torch.randn(2, 2, 40, 16, generator=g).requires_grad_(True)
    mask = _mask() if masked else None
    w = torch.randn(2, 6, 9, generator=g)
    got = KeysLogsumexp.apply(q, k, mask, 0.25)
    (got * w).sum().backward()
    dq, dk = q.grad.clone(), k.grad.clone()
    q.grad = k.grad = None
    scores = torch.matmul(q, k.repeat_interleave(3, dim=1).transpose(-1, -2)) * 0.25
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    want = torch.logsumexp(scores, dim=-1)
    (want * w).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dq, q.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dk, k.grad, rtol=1e-4, atol=1e-5)


def test_successor_keys_by_hand():
    best = torch.tensor([[[0, 2, 5, 1]]])  # (B=1, H=1, T=4)
    mask = torch.tensor([[True, True, True, False, True, True]])  # key 3 is padding
    before, succ = successor_keys(best, None, mask, 6)
    assert before.tolist() == [[[-1, 0, 2, 5]]]
    assert succ.tolist() == [[[-1, 1, 4, -1]]]  # none before the first; 2 -> 4 over the hole; 5 is last
    _, succ = successor_keys(best[..., :1], torch.tensor([[4]]), mask, 6)  # a previous call read key 4
    assert succ.tolist() == [[[5]]]


def _model(impl: str = "sdpa", seed: int = 3, spread: float = 2.0, **kw) -> CepeForCausalLM:
    model = CepeForCausalLM.from_decoder(
        tiny_decoder(), tiny_cepe_config(run_bias=True, attn_implementation=impl, **kw)
    ).eval()
    randomize_cross(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.cross_attention_modules():
            m.run_bias.copy_(torch.randn(m.run_bias.shape, generator=g) * spread)
    return model


@pytest.mark.parametrize("null_key", [False, True])
@pytest.mark.parametrize("others", [False, True])
def test_layer_by_hand_and_fast_equals_reference(null_key, others):
    """The layer's output is attention with β_h on j⁺ (the bias written into the scores by hand, j⁺ from
    the unbiased scores); the fused path and the reference agree on it and on every gradient."""
    kw = dict(null_key=null_key, induction_gate=others, match_gate=others, token_gate=others)
    enc_ids, enc_mask = random_context(2, 3)
    enc_mask[1, 2] = False
    hidden = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1))
    results = {}
    for impl in ("eager", "sdpa"):
        model = _model(impl, **kw).train()
        if others:
            with torch.no_grad():
                for m in model.cross_attention_modules():
                    m.induction_gate.normal_(generator=torch.Generator().manual_seed(7))
        ctx = model.prepare_context(enc_ids, enc_mask, cross_attention_cache="states")
        m = model.cross_attention_modules()[0]
        h = hidden[..., : m.q_proj.in_features].clone().requires_grad_(True)
        out = m(h, ctx)
        out.pow(2).sum().backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        results[impl] = (out.detach(), h.grad.clone(), grads)
        if impl == "eager" and not others:  # the layer by hand: the bias in the score matrix
            with torch.no_grad():
                b, t = h.shape[:2]
                q = m.q_proj(m.layernorm(h)).view(b, t, m.num_heads, m.head_dim).transpose(1, 2)
                k, v = m.project_kv(ctx.states)
                best, _ = best_keys_ref(q, k, ctx.key_mask, m.scale)
                _, succ = successor_keys(best, None, ctx.key_mask, k.shape[2])
                mask, off = ctx.key_mask, 0
                if null_key:
                    k, v, mask = m.with_null_key(k, v, mask)
                    off = 1
                bias = torch.zeros(b, m.num_heads, t, k.shape[2])
                for bi, hi, ti in torch.nonzero(succ >= 0).tolist():
                    bias[bi, hi, ti, succ[bi, hi, ti] + off] = m.run_bias[hi]
                att = attention_ref(q, k, v, mask, m.scale, bias=bias)
                want = m.o_proj(att.transpose(1, 2).reshape(b, t, -1))
            torch.testing.assert_close(out.detach(), want, rtol=1e-5, atol=1e-6)
    (o_ref, h_ref, g_ref), (o_fast, h_fast, g_fast) = results["eager"], results["sdpa"]
    torch.testing.assert_close(o_fast, o_ref, rtol=1e-4, atol=1e-5)
    assert (h_fast - h_ref).abs().max() <= 1e-5 * h_ref.abs().max()
    assert set(g_fast) == set(g_ref) and "run_bias" in g_ref and (g_ref["run_bias"] != 0).all()
    for n, g in g_ref.items():  # fp32 sums in another order: relative to the gradient's scale
        assert (g_fast[n] - g).abs().max() <= 1e-5 * g.abs().max(), n


def test_zero_biases_are_exactly_the_adapter_without_them_and_invariants_hold():
    plain = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(null_key=True)).eval()
    randomize_cross(plain)
    check_enabling_keeps_the_function(plain, plain.enable_run_bias, "run_bias")
    check_read_state_options(_model(), lambda m: m.run_bias.zero_())


@pytest.mark.parametrize("mode", ["kv", "states", "absorbed"])
def test_incremental_calls_continue_the_run(mode):
    check_incremental_calls(_model(null_key=True), mode)


def test_beam_search_follows_reordered_rows():
    check_beam_scores(_model(spread=4.0))


def test_checkpointing_save_and_load(tmp_path):
    """Gradient checkpointing gives the same gradients; the adapter saves and loads."""
    plain = check_checkpointing_gradients(lambda: _model(null_key=True))
    assert any(".run_bias" in n and (g != 0).any() for n, g in plain.items())
    check_saved_option(_model(), "run_bias", tmp_path / "a")


def test_left_padded_batch_generates_each_row_as_alone():
    check_left_padded_generation(_model(spread=4.0))
    check_left_padded_generation(_model(spread=4.0), cache="static")
