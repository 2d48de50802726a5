"""The output mixture (``CepeConfig.output_mix``): ``λ·p_cepe + (1 − λ)·p_decoder`` token by token."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    check_beam_scores,
    check_incremental_calls,
    ids_of,
    random_context,
    randomize_cross,
    tiny_cepe_config,
    tiny_decoder,
)

from cepe import CepeForCausalLM
from cepe.config import CepeConfig
from cepe.cross_attention import CrossContext
from cepe.mixture import (
    head_inputs,
    length_feature,
    mix_head,
    mix_logit,
    mix_logits,
    mix_logits_ref,
    mix_nll,
    suffix_agreement_ref,
    suffix_matches_ref,
    widen_head,
)
from cepe.training.speed import chunked_target_logprobs


def _mixed(seed: int = 3, bias: float | None = None, **kw) -> CepeForCausalLM:
    """A tiny mixture model with random cross-attention and a random mixing head (or a fixed bias)."""
    model = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(output_mix=True, **kw)).eval()
    randomize_cross(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if bias is None:
            model.mix_head.weight.copy_(torch.randn(model.mix_head.weight.shape, generator=g) * 0.2)
            model.mix_head.bias.fill_(0.3)
        else:
            model.mix_head.weight.zero_()
            model.mix_head.bias.fill_(bias)
    return model


def _logits_pair(seed: int = 0, n: int = 6, v: int = 11, spread: float = 30.0):
    g = torch.Generator().manual_seed(seed)
    lc = torch.randn(n, v, generator=g) * spread
    ld = torch.randn(n, v, generator=g) * spread
    a = torch.randn(n, generator=g) * 4
    return lc, ld, a


@pytest.mark.parametrize("spread,scale", [(0.1, 4.0), (3.0, 4.0), (60.0, 4.0), (60.0, 40.0)])
def test_mix_logits_agree_with_the_reference(spread, scale):
    """Their softmax is the mixture of the two softmaxes, also where the sides disagree by e^100 and λ is
    within 1e-17 of 0 or 1."""
    lc, ld, a = _logits_pair(spread=spread)
    a = a.sign() * scale
    got = mix_logits(lc, ld, a).log_softmax(-1).double()
    want = mix_logits_ref(lc, ld, a)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(mix_logits(lc, ld, a)).all()


def test_mix_logits_limits():
    lc, ld, a = _logits_pair(spread=3.0)
    assert torch.equal(mix_logits(ld, ld, a), ld)  # the sides agree: the decoder's logits, bit for bit
    big = torch.full_like(a, 40.0)
    torch.testing.assert_close(mix_logits(lc, ld, big).log_softmax(-1), lc.log_softmax(-1))
    torch.testing.assert_close(mix_logits(lc, ld, -big).log_softmax(-1), ld.log_softmax(-1))


def test_mix_nll_is_the_mixture_at_the_target():
    lc, ld, a = _logits_pair(spread=3.0)
    y = torch.randint(0, lc.shape[1], (lc.shape[0],), generator=torch.Generator().manual_seed(1))
    pick = lambda t: t.log_softmax(-1).gather(-1, y[:, None])[:, 0]  # noqa: E731
    got = mix_nll(pick(lc), pick(ld), a)
    want = -mix_logits_ref(lc, ld, a).gather(-1, y[:, None])[:, 0]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_chunked_target_logprobs_agree_with_the_plain_path():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(13, 8, generator=g, requires_grad=True)
    w = torch.randn(29, 8, generator=g)
    y = torch.randint(0, 29, (13,), generator=g)
    coef = torch.randn(13, generator=g)
    got = chunked_target_logprobs(h, w, y, chunk=4)
    (got * coef).sum().backward()
    g_got, h.grad = h.grad.clone(), None
    want = (h @ w.t()).log_softmax(-1).gather(-1, y[:, None])[:, 0]
    (want * coef).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_got, h.grad, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="frozen output embedding"):
        chunked_target_logprobs(h, w.requires_grad_(), y)


def test_the_model_computes_the_mixture():
    """Logits = the mixture of the same adapter without ``output_mix`` and the decoder alone, λ from the head
    over both final hidden states; the loss is its cross-entropy."""
    model = _mixed()
    plain = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config()).eval()
    plain.load_adapter_state_dict(
        {k: v for k, v in model.adapter_state_dict().items() if "mix_head" not in k}
    )
    ids = ids_of()
    enc_ids, enc_mask = random_context(2, 3)
    enc_mask[1, 1:] = False
    with torch.no_grad():
        out = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask, labels=ids)
        ctx = plain.prepare_context(enc_ids, enc_mask)
        with plain.use_context(ctx):
            h_ctx = plain.decoder.get_decoder()(ids).last_hidden_state
        h_dec = tiny_decoder().get_decoder()(ids).last_hidden_state
        lc = plain(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        ld = tiny_decoder()(ids).logits
        a = mix_logit(model.mix_head, h_ctx, h_dec)
    want = mix_logits_ref(lc, ld, a)
    torch.testing.assert_close(out.logits.log_softmax(-1).double(), want, rtol=1e-4, atol=1e-4)
    nll = -want[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    torch.testing.assert_close(out.loss.double(), nll, rtol=1e-4, atol=1e-4)
    lam = torch.sigmoid(a)
    assert 0.01 < lam.min() and lam.max() < 0.99 and lam.std() > 0.1  # a real mixture, token by token


def test_invariants_no_context_and_zero_o_proj_are_the_decoder():
    model = _mixed()
    ids = ids_of()
    enc_ids, enc_mask = random_context(2, 3)
    with torch.no_grad():
        ref = tiny_decoder()(ids).logits
        assert torch.equal(model(ids).logits, ref)  # no context: exactly the decoder
        on = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        assert (on - ref).abs().max().item() > 1e-3
        for m in model.cross_attention_modules():
            m.o_proj.weight.zero_()
        zero = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert torch.equal(zero, ref)  # both halves agree exactly, and f(0) = 0


@pytest.mark.parametrize("mode", ["kv", "states", "absorbed"])
def test_incremental_calls_carry_both_halves(mode):
    check_incremental_calls(_mixed(), mode)


def test_beam_search_reorders_both_halves():
    check_beam_scores(_mixed())
    assert "forward" not in _mixed().decoder.__dict__


@pytest.mark.parametrize("beams", [1, 3])
def test_generate_at_the_mixture_limits(beams):
    """λ ≈ 1 generates what the adapter alone generates, λ ≈ 0 what the decoder alone generates (greedy
    and beam search): both halves of the doubled cache are right."""
    ids = ids_of(b=1, t=5)
    enc_ids, enc_mask = random_context(1, 3)
    kw = dict(max_new_tokens=8, num_beams=beams, do_sample=False, pad_token_id=0, eos_token_id=None)
    plain = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config()).eval()
    randomize_cross(plain)
    read = plain.generate(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask, **kw)
    alone = tiny_decoder().generate(ids, **kw)
    assert not torch.equal(read, alone)  # the context changes the continuation
    for bias, want in ((30.0, read), (-30.0, alone)):
        model = _mixed(bias=bias)
        got = model.generate(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask, **kw)
        assert torch.equal(got, want)
        assert "forward" not in model.decoder.__dict__  # the generate-time forward is removed


def test_save_load_and_enable(tmp_path):
    model = _mixed()
    model.save_pretrained(tmp_path / "mix")
    back = CepeForCausalLM.from_pretrained(tmp_path / "mix", decoder=tiny_decoder())
    assert back.cepe_config.output_mix
    assert torch.equal(back.mix_head.weight, model.mix_head.weight)
    plain = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config())
    plain.save_pretrained(tmp_path / "plain")
    loaded = CepeForCausalLM.from_pretrained(tmp_path / "plain", decoder=tiny_decoder())
    loaded.enable_output_mix()
    loaded.enable_output_mix()  # idempotent
    assert loaded.cepe_config.output_mix and not loaded.mix_head.weight.any()
    assert {"mix_head.weight", "mix_head.bias"} <= set(loaded.adapter_state_dict())
    with pytest.raises(ValueError, match="missing keys.*mix_head"):
        model.load_adapter_state_dict(plain.adapter_state_dict())


# ------------------------------------------------------------------ suffix-match inputs (mix_match)
def _matched(hidden: bool = True, seed: int = 3) -> CepeForCausalLM:
    """A tiny mixture whose head also takes 3 suffix-match inputs, with large weights on them."""
    model = _mixed(seed, mix_match=3, mix_hidden=hidden)
    with torch.no_grad():
        model.mix_head.weight[0, -3:] = torch.tensor([2.0, -3.0, 4.0])
    return model


def _few_tokens(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Ids from four tokens: suffixes of every length recur between context and decoder."""
    return torch.randint(1, 5, shape, generator=torch.Generator().manual_seed(seed))


def _padded_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decoder ids ``(2, 9)`` and a context ``(2, 3, 8)`` whose second example has one real chunk."""
    ids, enc_ids = _few_tokens((2, 9), 0), _few_tokens((2, 3, 8), 1)
    enc_mask = torch.ones_like(enc_ids).bool()
    enc_mask[1, 1:] = False
    return ids, enc_ids, enc_mask


def _both_sides(model, ids, enc_ids, enc_mask):
    """The model's logits, and by hand: both final hidden states, both sides' logits and the reference
    suffix matches (3 orders) over each example's real context tokens."""
    with torch.no_grad():
        out = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        ctx = model.prepare_context(enc_ids, enc_mask)
        with model.use_context(ctx):
            h_ctx = model.decoder.get_decoder()(ids).last_hidden_state
        h_dec = tiny_decoder().get_decoder()(ids).last_hidden_state
        lc = model.lm_logits(h_ctx)
        ld = tiny_decoder()(ids).logits
    match = torch.stack(
        [suffix_matches_ref(ids[b].tolist(), enc_ids[b][enc_mask[b]].tolist(), 3) for b in range(2)]
    )
    return out, h_ctx, h_dec, lc, ld, match


@pytest.mark.parametrize("hidden", [True, False])
def test_the_head_reads_the_suffix_matches(hidden):
    """Logits = the mixture with λ from the head over [h_cepe; h_decoder; matches] (or the matches alone),
    the matches from the reference over the context's real tokens read as one text."""
    model = _matched(hidden)
    assert model.mix_head.weight.shape == (1, (2 * 64 if hidden else 0) + 3)
    ids, enc_ids, enc_mask = _padded_case()
    out, h_ctx, h_dec, lc, ld, match = _both_sides(model, ids, enc_ids, enc_mask)
    assert 0 < match[..., 2].sum() < match[..., 0].sum()  # every order occurs, and not everywhere
    a = mix_logit(model.mix_head, h_ctx, h_dec, match, hidden)
    torch.testing.assert_close(out.log_softmax(-1).double(), mix_logits_ref(lc, ld, a), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        model.mix_head.weight[0, -3:] = 0.0
        same = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        a0 = mix_logit(model.mix_head, h_ctx, h_dec, match, hidden)
    torch.testing.assert_close(
        same.log_softmax(-1).double(), mix_logits_ref(lc, ld, a0), rtol=1e-4, atol=1e-4
    )
    assert (same - out).abs().max() > 1e-2  # the matches moved λ


@pytest.mark.parametrize("mode", ["kv", "absorbed"])
def test_incremental_calls_continue_the_suffixes(mode):
    """One token at a time gives the whole call's logits: each call's suffixes start from the tokens the
    last call ended with."""
    check_incremental_calls(_matched(), mode, _few_tokens((2, 10), 2), _few_tokens((2, 3, 8), 3))


def test_beam_search_reorders_the_suffix_tails():
    check_beam_scores(_matched())
    ctx = CrossContext(torch.zeros(4, 2, 3), match_ids=torch.zeros(4, 5, dtype=torch.long), match_order=3)
    ctx.mix_tail = torch.tensor([[1, 2, 5], [3, 4, 6]])  # the tokens by position
    ctx.reorder(torch.tensor([1, 1, 3, 3]))  # a doubled context: the first half's rows
    assert torch.equal(ctx.mix_tail, torch.tensor([[3, 4, 6], [3, 4, 6]]))


def test_the_doubled_context_copies_nothing():
    """``with_decoder_rows``: 2B decoder rows over the same tensors (nothing stored for the rows that read
    nothing), made once; repeated for beams it is the repeated context doubled; it cannot double twice."""
    states, mask = torch.randn(2, 5, 3), torch.rand(2, 5) > 0.3
    ctx = CrossContext(states, mask, match_ids=torch.zeros(2, 5, dtype=torch.long), match_order=2)
    doubled = ctx.with_decoder_rows()
    assert doubled is ctx.with_decoder_rows() and doubled.batch_size == 4 and doubled.reads == 2
    assert doubled.states is states and doubled.key_mask is mask and doubled.base is ctx
    beams = doubled.expand(12)  # 3 beams: 6 rows read, 6 do not
    assert beams.batch_size == 12 and beams.reads == 6 and beams.base.batch_size == 6
    assert torch.equal(beams.states, states.repeat_interleave(3, dim=0))
    with pytest.raises(ValueError, match="already doubled"):
        doubled.with_decoder_rows()


def test_suffix_matches_need_token_ids_and_a_matching_head(tmp_path):
    model = _matched()
    with pytest.raises(ValueError, match="need the context's token ids"):
        model(ids_of(), encoder_hidden_states=torch.randn(2, 6, model.cepe_config.encoder.state_size))
    with pytest.raises(ValueError, match="set output_mix too"):
        tiny_cepe_config(mix_match=2)
    with pytest.raises(ValueError, match="only its bias"):
        tiny_cepe_config(output_mix=True, mix_hidden=False)
    with pytest.raises(ValueError, match="mix_match must be"):
        CepeConfig(encoder=tiny_cepe_config().encoder, output_mix=True, mix_match=-1)
    with pytest.raises(ValueError, match="takes mix_match 3"):
        model.enable_output_mix()
    model.save_pretrained(tmp_path / "m")
    back = CepeForCausalLM.from_pretrained(tmp_path / "m", decoder=tiny_decoder())
    assert back.cepe_config.mix_match == 3 and torch.equal(back.mix_head.weight, model.mix_head.weight)
    plain = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config())
    plain.enable_output_mix(2, hidden=False)
    assert plain.mix_head.weight.shape == (1, 2) and plain.cepe_config.mix_match == 2


# ------------------------------------------------------------------ the context's length (mix_length)
def _with_length(hidden: bool = False) -> CepeForCausalLM:
    """:func:`_matched` whose head also takes the context's length, with a large weight on it (tiny
    contexts have a tiny ``log(1 + n / 1024)``)."""
    model = _matched(hidden)
    model.enable_output_mix(3, hidden, length=True)
    with torch.no_grad():
        model.mix_head.weight[0, -1] = 60.0
    return model


def test_length_feature_values():
    n = torch.tensor([0, 512, 1024, 8192])
    want = torch.tensor([0.0, 0.4054651, 0.6931472, 2.1972246])
    torch.testing.assert_close(length_feature(n), want)


@pytest.mark.parametrize("hidden,cap", [(True, None), (False, None), (False, 16)])
def test_the_head_reads_the_context_length(hidden, cap):
    """λ from the head over [(h_cepe; h_decoder;) matches; log(1 + n / 1024)], n each example's real
    context tokens (padding not counted; with ``mix_length_cap`` at most the cap: the example of 24 real
    tokens reads as 16 under a cap of 16), against the reference built by hand."""
    model = _with_length(hidden)
    model.set_mix_length_cap(cap)
    assert model.mix_head.weight.shape == (1, (2 * 64 if hidden else 0) + 4)
    ids, enc_ids, enc_mask = _padded_case()
    out, h_ctx, h_dec, lc, ld, match = _both_sides(model, ids, enc_ids, enc_mask)
    n = torch.tensor([min(24.0, cap or 24.0), 8.0])[:, None, None].expand(2, 9, 1)
    x = torch.cat([match, torch.log1p(n / 1024)], dim=-1)
    a = mix_logit(model.mix_head, h_ctx, h_dec, x, hidden)
    torch.testing.assert_close(out.log_softmax(-1).double(), mix_logits_ref(lc, ld, a), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        model.mix_head.weight[0, -1] = 0.0
        same = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert (same - out).abs().max() > 1e-2  # the length moved λ


def test_the_length_input_is_capped(tmp_path):
    """A cap below a context's length changes the logits (the reference: the test above); incremental
    calls and a save / load keep it; the cap needs the length input."""
    model = _with_length()
    model.set_mix_length_cap(16)
    ids, enc_ids, enc_mask = _padded_case()
    kw = dict(encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask)
    with torch.no_grad():
        out = model(ids, **kw).logits
        model.cepe_config.mix_length_cap = None
        uncapped = model(ids, **kw).logits
        model.cepe_config.mix_length_cap = 16
    assert (uncapped - out).abs().max() > 1e-2  # the first example's length moved λ
    model.save_pretrained(tmp_path / "cap")
    back = CepeForCausalLM.from_pretrained(tmp_path / "cap", decoder=tiny_decoder())
    assert back.cepe_config.mix_length_cap == 16
    with torch.no_grad():
        torch.testing.assert_close(back(ids, **kw).logits, out, rtol=0, atol=0)
    check_incremental_calls(back, "kv", _few_tokens((2, 10), 2), _few_tokens((2, 3, 8), 3))
    with pytest.raises(ValueError, match="mix_length_cap caps the heads' length input"):
        tiny_cepe_config(output_mix=True, mix_match=2, mix_length_cap=8)
    with pytest.raises(ValueError, match="mix_length_cap caps the heads' length input"):
        _matched(hidden=False).set_mix_length_cap(8)
    with pytest.raises(ValueError, match="mix_length_cap caps the heads' length input"):
        tiny_cepe_config(output_mix=True, mix_match=2, mix_length=True, mix_length_cap=0)


def _check_saved_and_needs_match(model: CepeForCausalLM, tmp_path, inp: str) -> None:
    """The head with input ``mix_{inp}`` saves and loads as it is, and the input needs ``mix_match``."""
    model.save_pretrained(tmp_path / "m")
    back = CepeForCausalLM.from_pretrained(tmp_path / "m", decoder=tiny_decoder())
    assert getattr(back.cepe_config, f"mix_{inp}")
    assert torch.equal(back.mix_head.weight, model.mix_head.weight)
    with pytest.raises(ValueError, match=f"mix_{inp} rides"):
        tiny_cepe_config(output_mix=True, **{f"mix_{inp}": True})
    plain = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config())
    with pytest.raises(ValueError, match=f"mix_{inp} rides"):
        plain.enable_output_mix(**{inp: True})


def test_adding_the_length_input_keeps_the_function(tmp_path):
    model = _matched(hidden=False)
    ids, enc_ids = _few_tokens((2, 9), 4), _few_tokens((2, 3, 8), 5)
    with torch.no_grad():
        before = model(ids, encoder_input_ids=enc_ids).logits
        model.enable_output_mix(3, False, length=True)
        model.enable_output_mix(3, False, length=True)  # idempotent
        after = model(ids, encoder_input_ids=enc_ids).logits
    assert model.mix_head.weight.shape == (1, 4) and model.mix_head.weight[0, -1] == 0
    assert model.cepe_config.mix_length and torch.equal(before, after)
    with pytest.raises(ValueError, match="mix_length True"):
        model.enable_output_mix(3, False)  # a length head cannot lose its input
    _check_saved_and_needs_match(model, tmp_path, "length")


@pytest.mark.parametrize("mode", ["kv", "absorbed"])
def test_incremental_calls_keep_the_length_input(mode):
    check_incremental_calls(_with_length(), mode, _few_tokens((2, 10), 2), _few_tokens((2, 3, 8), 3))


def test_beam_search_with_the_length_input():
    check_beam_scores(_with_length(hidden=True))


# ------------------------------------------------------------------ successor agreement (mix_agree)
def _with_agreement(hidden: bool = False, length: bool = True) -> CepeForCausalLM:
    """:func:`_matched` (with the length input or not) whose head also takes the 3 successor agreements,
    with large weights on them."""
    model = _matched(hidden)
    model.enable_output_mix(3, hidden, length=length, agree=True)
    with torch.no_grad():
        model.mix_head.weight[0, -3:] = torch.tensor([-5.0, 3.0, 6.0])
    return model


@pytest.mark.parametrize("hidden,length", [(True, True), (False, False)])
def test_the_head_reads_the_successor_agreement(hidden, length):
    """λ from the head over [(h_cepe; h_decoder;) matches; (length;) agreements], the agreements from
    the reference over each example's real context tokens, against the reference built by hand."""
    model = _with_agreement(hidden, length)
    assert model.mix_head.weight.shape == (1, (2 * 64 if hidden else 0) + 6 + int(length))
    ids, enc_ids, enc_mask = _padded_case()
    out, h_ctx, h_dec, lc, ld, match = _both_sides(model, ids, enc_ids, enc_mask)
    agree = torch.stack(
        [suffix_agreement_ref(ids[b].tolist(), enc_ids[b][enc_mask[b]].tolist(), 3) for b in range(2)]
    )
    assert ((agree > 0) & (agree < 1)).any() and (agree == 1).any()
    parts = [match]
    if length:
        parts.append(torch.log1p(torch.tensor([24.0, 8.0]) / 1024)[:, None, None].expand(2, 9, 1))
    x = torch.cat([*parts, agree], dim=-1)
    a = mix_logit(model.mix_head, h_ctx, h_dec, x, hidden)
    torch.testing.assert_close(out.log_softmax(-1).double(), mix_logits_ref(lc, ld, a), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        model.mix_head.weight[0, -3:] = 0.0
        same = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert (same - out).abs().max() > 1e-2  # the agreements moved λ


def test_adding_the_agreement_inputs_keeps_the_function(tmp_path):
    """Added to a head with the length input, or to one without it and then the length: each old weight
    stays on its own input, the new ones are zero, the logits are unchanged bit for bit."""
    ids, enc_ids = _few_tokens((2, 9), 4), _few_tokens((2, 3, 8), 5)
    for first_length in (True, False):
        model = _with_length() if first_length else _matched(hidden=False)
        w = model.mix_head.weight.detach().clone()
        with torch.no_grad():
            before = model(ids, encoder_input_ids=enc_ids).logits
            model.enable_output_mix(3, False, length=first_length, agree=True)
            model.enable_output_mix(3, False, length=first_length, agree=True)  # idempotent
            if not first_length:
                model.enable_output_mix(3, False, length=True, agree=True)  # the length between them
            after = model(ids, encoder_input_ids=enc_ids).logits
        assert model.mix_head.weight.shape == (1, 7) and torch.equal(before, after)
        assert torch.equal(model.mix_head.weight[0, :3], w[0, :3]) and not model.mix_head.weight[0, 4:].any()
        assert model.mix_head.weight[0, 3] == (w[0, 3] if first_length else 0.0)
        assert model.cepe_config.mix_agree and model.cepe_config.mix_length
    with pytest.raises(ValueError, match="mix_agree True"):
        model.enable_output_mix(3, False, length=True)  # an agreement head cannot lose its inputs
    _check_saved_and_needs_match(model, tmp_path, "agree")


def test_widen_head_needs_every_old_input():
    old = mix_head(head_inputs(4, 2, hidden=False, length=True), torch.zeros(1))
    with pytest.raises(ValueError, match=r"lacks \['n'\]"):
        widen_head(old, head_inputs(4, 2, False, True), head_inputs(4, 2, False, False, True))


@pytest.mark.parametrize("mode", ["kv", "absorbed"])
def test_incremental_calls_keep_the_agreement_inputs(mode):
    check_incremental_calls(_with_agreement(), mode, _few_tokens((2, 10), 2), _few_tokens((2, 3, 8), 3))


def test_beam_search_with_the_agreement_inputs():
    check_beam_scores(_with_agreement(hidden=True))


def test_a_head_widened_with_zero_weights_computes_the_same_bits():
    """Heads take their product in fp64 (MixHead): inputs added with zero weight (widen_head) leave the
    fp32 output bit for bit, whatever the number of inputs does to a vectorised fp32 sum, and the output
    is the plain fp32 linear map's up to its rounding."""
    from cepe.mixture import MixHead, widen_head

    g = torch.Generator().manual_seed(0)
    for f in (5, 17, 40):
        head = MixHead(f, 1)
        with torch.no_grad():
            head.weight.copy_(torch.randn(1, f, generator=g) * 3)
            head.bias.fill_(0.7)
        names = [f"x{i}" for i in range(f)]
        x = torch.randn(64, f, generator=g) * 4
        for extra in (1, 3, 9):
            wide = widen_head(head, names, names + [f"y{i}" for i in range(extra)])
            assert isinstance(wide, MixHead)
            xw = torch.cat([x, torch.randn(64, extra, generator=g)], dim=-1)
            assert torch.equal(wide(xw), head(x))
        torch.testing.assert_close(head(x), torch.nn.functional.linear(x, head.weight, head.bias))
        assert head(x).dtype == torch.float32


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "llama"])
def test_static_cache_generates_as_the_default_cache(family):
    """Under a static cache the decoder's mask is 4-D, or a dict of masks for families with sliding-window
    layers: the mixture doubles each, and generates the default cache's tokens."""
    model = CepeForCausalLM.from_decoder(tiny_decoder(family), tiny_cepe_config(output_mix=True)).eval()
    randomize_cross(model)
    with torch.no_grad():
        model.mix_head.weight.normal_(0, 0.2, generator=torch.Generator().manual_seed(3))
    ids, enc_ids = ids_of(t=8), random_context(2, 3)[0]
    kw = dict(encoder_input_ids=enc_ids, max_new_tokens=4, do_sample=False, pad_token_id=1)
    want = model.generate(ids, **kw)
    assert torch.equal(model.generate(ids, cache_implementation="static", **kw), want)
