"""Induction gates (``CepeConfig.induction_gate``): head h's output times 2·σ(w_h·ι̂), ι̂ from whether the
head now reads the key after the one its previous token's query read most (a copy going on).

The cache modes agree with induction gates: ``tests/test_model.py::test_cache_modes_agree``."""

from __future__ import annotations

import math

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
    heads_scaled,
    random_context,
    randomize_cross,
    tiny_cepe_config,
    tiny_decoder,
)

from cepe import CepeForCausalLM
from cepe.cross_attention import (
    MatchKeys,
    best_keys,
    best_keys_ref,
    induction_stats,
    induction_stats_ref,
    match_stats_ref,
    match_stats_sdpa,
    next_keys,
)


def _qk(b=2, h=6, kv=2, t=9, s=40, hd=16, seed=0, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, t, hd, generator=g) * spread, torch.randn(b, kv, s, hd, generator=g)


def _mask(s: int = 40) -> torch.Tensor:
    mask = torch.ones(2, s, dtype=torch.bool)
    mask[0, 25:] = False  # trailing padding (packed keys)
    mask[1, ::3] = False  # holes (unpacked chunks)
    return mask


def test_next_keys_skip_padding():
    mask = torch.tensor([[1, 0, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    got = next_keys(mask, 2, 6, torch.device("cpu"))
    assert got.tolist() == [[3, 3, 3, 4, -1, -1], [1, 2, 3, 4, 5, -1]]
    assert next_keys(None, 1, 3, torch.device("cpu")).tolist() == [[1, 2, -1]]


def test_statistic_by_hand():
    """Orthogonal keys, each query aimed at one key: reading on by one is 1 (up to the softmax's leak),
    jumping elsewhere is −1, the first token (no previous) 0, reading after the last key −1; a previous
    call's last position continues the run across calls."""
    n, hd = 8, 8
    k = torch.eye(n)[None, None]  # (1, 1, n, hd): key j = e_j
    order = [2, 3, 4, 0, 7, 5]  # token t reads key order[t]
    q = torch.stack([60.0 * torch.eye(n)[j] for j in order])[None, None]  # (1, 1, T, hd)
    feat, last = induction_stats_ref(q, k, None, scale=1.0)
    assert last.tolist() == [[5]]
    want = [0.0, 1.0, 1.0, -1.0, -1.0, -1.0]  # 2→3, 3→4 runs; 4→0 a jump; 0→7 a jump; 7 is the last key
    torch.testing.assert_close(feat[0, 0], torch.tensor(want), atol=1e-3, rtol=0)
    feat, _ = induction_stats_ref(q[:, :, :1], k, None, 1.0, prev=torch.tensor([[1]]))
    assert feat[0, 0, 0].item() == pytest.approx(1.0, abs=1e-3)  # key 1 then key 2: the run goes on
    uniform, _ = induction_stats_ref(torch.zeros(1, 1, 3, hd), k, None, 1.0)
    torch.testing.assert_close(uniform[0, 0, 1:], torch.zeros(2))  # log(n·1/n) = 0
    assert math.isclose(feat.abs().max().item(), 1.0, abs_tol=1e-3)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("spread", [0.3, 3.0, 12.0])
def test_chunked_statistic_agrees_with_the_reference(masked, spread, monkeypatch):
    """Grouped by KV head, a few queries at a time (a tiny chunk here), with and without a previous call."""
    import cepe.cross_attention as ca

    monkeypatch.setattr(ca, "READ_CHUNK", 2 * 6 * 40 * 2)  # two queries per chunk
    q, k = _qk(spread=spread)
    mask = _mask() if masked else None
    prev = torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(1))
    for p in (None, prev):
        ref, ref_last = induction_stats_ref(q, k, mask, 0.25, p)
        fast, fast_last = induction_stats(q, k, mask, 0.25, p)
        torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)
        assert torch.equal(fast_last, ref_last)
        # the logsumexp from the match statistics' fused attention (m + log n) instead of its own pass
        n = torch.full((2,), 40.0) if mask is None else mask.sum(-1).float()
        lse = match_stats_sdpa(q, MatchKeys.build(k, mask), 0.25)[..., 0] + n.log()[:, None, None]
        given, _ = induction_stats(q, k, mask, 0.25, p, lse=lse)
        torch.testing.assert_close(given, ref, rtol=1e-4, atol=1e-4)
        assert (ref >= -1).all() and (ref <= 1).all()
    if mask is not None:  # every argmax is a real key
        _, last = induction_stats_ref(q, k, mask, 0.25)
        assert mask.gather(1, last).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_most_attended_keys_are_the_first_of_equal_maxima(dtype, monkeypatch):
    """The chunked read pass finds the reference's key where scores tie (small integers: many ties), past
    padding and holes, in the keys' dtype."""
    import cepe.cross_attention as ca

    monkeypatch.setattr(ca, "READ_CHUNK", 2 * 6 * 40 * 3)  # three queries per chunk
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-2, 3, (2, 6, 9, 4), generator=g).to(dtype)
    k = torch.randint(-2, 3, (2, 2, 40, 4), generator=g).to(dtype)
    for mask in (None, _mask()):
        fast, _ = best_keys(q, k, mask, 0.5, need_lse=False)
        ref, _ = best_keys_ref(q, k, mask, 0.5)
        assert torch.equal(fast, ref)


def test_no_gradient_flows_through_the_statistic():
    q, k = _qk()
    q.requires_grad_(True)
    k.requires_grad_(True)
    assert not induction_stats_ref(q, k, None, 0.25)[0].requires_grad
    assert not induction_stats(q, k, None, 0.25)[0].requires_grad


def _model(seed: int = 3, spread: float = 3.0, **kw) -> CepeForCausalLM:
    model = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(induction_gate=True, **kw)).eval()
    randomize_cross(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.cross_attention_modules():
            m.induction_gate.copy_(torch.randn(m.induction_gate.shape, generator=g) * spread)
    return model


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("others", [False, True])
def test_layer_output_by_hand(impl, others):
    """Alone the gate is 2·σ(w·ι̂); with match and token gates its logit adds to theirs."""
    model = _model(attn_implementation=impl, match_gate=others, token_gate=others, null_key=True)
    enc_ids, enc_mask = random_context(2, 3)
    enc_mask[1, 2] = False
    ctx = model.prepare_context(enc_ids, enc_mask, cross_attention_cache="states")
    m = model.cross_attention_modules()[0]
    hidden = torch.randn(2, 5, m.q_proj.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = m(hidden, ctx)
        b, t = hidden.shape[:2]
        normed = m.layernorm(hidden)
        q = m.q_proj(normed).view(b, t, m.num_heads, m.head_dim).transpose(1, 2)
        k, _ = m.project_kv(ctx.states)
        feat, _ = induction_stats_ref(q, k, ctx.key_mask, m.scale)
        logit = feat * m.induction_gate[None, :, None]  # (B, H, T)
        if others:
            stats = match_stats_ref(q, k, ctx.key_mask, m.scale)
            w = m.match_gate
            stats = (stats - m.match_norm[None, :, None, 0::2]) / m.match_norm[None, :, None, 1::2]
            logit = logit + stats[..., 0] * w[:, 0, None] + stats[..., 1] * w[:, 1, None] + w[:, 2, None]
            logit = logit + m.token_gate(normed).transpose(1, 2)
        saved = (m.induction_gate, m.match_gate, m.token_gate)
        m.induction_gate = m.match_gate = m.token_gate = None
        want = heads_scaled(m, hidden, ctx, (2 * torch.sigmoid(logit)).transpose(1, 2))
        m.induction_gate, m.match_gate, m.token_gate = saved
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_zero_gates_are_exactly_the_adapter_without_them_and_invariants_hold():
    plain = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(match_gate=True)).eval()
    randomize_cross(plain)
    check_enabling_keeps_the_function(plain, plain.enable_induction_gate, "induction_gate")
    check_read_state_options(_model(), lambda m: m.induction_gate.zero_())


@pytest.mark.parametrize("mode", ["kv", "states", "absorbed"])
def test_incremental_calls_continue_the_run(mode):
    check_incremental_calls(_model(), mode)


def test_beam_search_follows_reordered_rows():
    check_beam_scores(_model(spread=6.0))


def test_gradients_checkpointing_save_and_load(tmp_path):
    """The gate learns (no gradient through ι̂); checkpointing reuses the statistic and gives the same
    gradients; the adapter saves and loads (a stage adds the gates to an adapter trained without:
    ``tests/test_token_gate.py::test_a_stage_adds_gates_and_trains_only_them``)."""
    plain = check_checkpointing_gradients(_model)
    assert any(".induction_gate" in n and (g != 0).all() for n, g in plain.items())
    model = _model()
    check_saved_option(model, "induction_gate", tmp_path / "a")
    with pytest.raises(ValueError):  # gates do not fit a model without them
        CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config()).load_adapter_state_dict(
            model.adapter_state_dict()
        )


def test_probe_separations():
    """``scripts/induction_probe.py``'s AUC (ties half) and its per-head logistic fit on several statistics,
    which separates what no single one does."""
    from conftest import load_script

    probe = load_script("induction_probe")
    a, b = torch.tensor([2.0, 3.0, 4.0]), torch.tensor([0.0, 1.0])
    assert probe.auc(a, b) == 1.0 and probe.auc(b, a) == 0.0
    assert probe.auc(torch.ones(4), torch.ones(3)) == 0.5
    assert probe.auc(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 0.0])) == pytest.approx(0.875)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(400, generator=g), torch.randn(400, generator=g)
    pos, neg = x + y > 0, x + y < 0  # each statistic alone overlaps, their sum does not
    single = probe.separation([x[pos]], [x[neg]])
    both = probe.separation([x[pos], y[pos]], [x[neg], y[neg]])
    assert single < 0.95 and both > 0.99
    # every head at once, fitted on even windows, measured on odd ones: a real signal carries over, noise
    # fitted with many features does not
    windows = []
    for _ in range(6):
        sig = torch.randn(50, 1, generator=g)
        noise = torch.randn(50, 40, generator=g)
        windows.append((torch.cat([sig[:25] + 3, noise[:25]], 1), torch.cat([sig[25:] - 3, noise[25:]], 1)))
    fit, test = probe.held_out(windows)
    assert fit > 0.99 and test > 0.99
    noise = [(torch.randn(20, 40, generator=g), torch.randn(20, 40, generator=g)) for _ in range(6)]
    fit, test = probe.held_out(noise)
    assert fit > test + 0.2 and abs(test - 0.5) < 0.2


def test_left_padded_batch_generates_each_row_as_alone():
    """A pad column's query is no previous token: the first real token of a left-padded row starts no run."""
    check_left_padded_generation(_model(spread=6.0))
    check_left_padded_generation(_model(spread=6.0), cache="static")
