"""The copy in the output mixture (``CepeConfig.mix_copy``): ``μ·p_copy + (1 − μ)·p_mixture`` where the
decoder's last tokens occur in the context, ``p_copy`` the tokens that follow the longest such suffix."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    check_beam_scores,
    check_incremental_calls,
    check_left_padded_generation,
    tiny_cepe_config,
    tiny_decoder,
)
from test_output_mix import _both_sides, _few_tokens, _matched, _mixed, _padded_case

from cepe import CepeForCausalLM
from cepe.config import CepeConfig
from cepe.mixture import (
    COPY_BIAS,
    context_successors,
    copy_agreement_feature,
    copy_mix_logits,
    copy_mix_logits_ref,
    copy_mix_nll,
    copy_probs_ref,
    copy_spans,
    mix_logit,
    mix_logits_ref,
    reader_sure_feature,
    top_logprob,
    vote_weights,
)
from cepe.training.speed import HeadWeight, chunked_copy_expectation, chunked_reader_inputs, mixture_token_nll


def _brute_copy(ids: list[int], ctx: list[int], order: int, vocab: int) -> torch.Tensor:
    """The copy distribution from n-gram counts instead of a scan: for the longest suffix s of at most
    ``order`` tokens that the context continues, ``p(y) = count(s + y) / sum over z of count(s + z)``."""
    grams = Counter(tuple(ctx[i : i + n]) for n in range(2, order + 2) for i in range(len(ctx) - n + 1))
    out = torch.zeros(len(ids), vocab)
    for j in range(len(ids)):
        for k in range(min(order, j + 1), 0, -1):
            s = tuple(ids[j - k + 1 : j + 1])
            counts = torch.tensor([float(grams[(*s, y)]) for y in range(vocab)])
            if counts.sum() > 0:
                out[j] = counts / counts.sum()
                break
    return out


def test_the_reference_copy_agrees_with_a_brute_force_count():
    rng = random.Random(0)
    for _ in range(20):
        ctx = [rng.randrange(5) for _ in range(rng.randrange(1, 30))]
        ids = [rng.randrange(5) for _ in range(rng.randrange(1, 20))]
        torch.testing.assert_close(copy_probs_ref(ids, ctx, 4, 5), _brute_copy(ids, ctx, 4, 5))
    # a hand case: "1 2" is followed by 3 twice and by 4 once; "2" alone also by 1
    got = copy_probs_ref([1, 2], [1, 2, 3, 1, 2, 3, 1, 2, 4, 2, 1], 2, 5)
    torch.testing.assert_close(got[1], torch.tensor([0, 0, 0, 2 / 3, 1 / 3]))
    torch.testing.assert_close(got[0], torch.tensor([0, 0, 1.0, 0, 0]))  # "1" is followed by 2 three times
    # with decay 1 the votes weigh 1/(1 + d/64): the 3s stand 9 and 6 tokens back, the 4 stands 3 back
    w3, w4 = 1 / (1 + 9 / 64) + 1 / (1 + 6 / 64), 1 / (1 + 3 / 64)
    got = copy_probs_ref([1, 2], [1, 2, 3, 1, 2, 3, 1, 2, 4, 2, 1], 2, 5, decay=1.0)
    torch.testing.assert_close(got[1], torch.tensor([0, 0, 0, w3 / (w3 + w4), w4 / (w3 + w4)]))
    assert vote_weights(torch.tensor([0, 64, 192]), 1.0).tolist() == [1.0, 0.5, 0.25]


@pytest.mark.parametrize("vocab,decay", [(3, 0.0), (6, 0.0), (3, 1.5), (6, 0.7)])
def test_vectorised_copy_agrees_with_the_reference(vocab, decay):
    """Padded chunks read as one text; a tail continues an incremental call; padding matches nothing;
    the probability of one token per position is the dense distribution's entry; votes weighed by how
    far back they stand (``decay``) as the reference weighs them."""
    g = torch.Generator().manual_seed(vocab)
    ids = torch.randint(0, vocab, (3, 4, 6), generator=g)
    mask = torch.rand(3, 4, 6, generator=g) > 0.3
    mask[2] = False  # an example with no context: nothing occurs
    dec = torch.randint(0, vocab, (3, 9), generator=g)
    table = context_successors(ids, mask, 4, decay=decay)
    assert (table.weight is None) == (decay == 0)
    spans = copy_spans(dec, table)
    dense = spans.probs(vocab)  # (3, 9, V)
    for b in range(3):
        torch.testing.assert_close(
            dense[b], copy_probs_ref(dec[b].tolist(), ids[b][mask[b]].tolist(), 4, vocab, decay)
        )
    logp = torch.randn(3, 9, vocab, generator=g).log_softmax(-1)
    torch.testing.assert_close(spans.expected(logp), (dense * logp.exp()).sum(-1))
    torch.testing.assert_close(spans.top_share(), dense.amax(-1))  # 0 where no suffix occurs
    assert ((spans.top_share() < 1) & spans.has).any()  # some positions' votes disagree
    assert spans.has[:2].any() and not spans.has[2].any()
    torch.testing.assert_close(dense.sum(-1), spans.has.float())
    y = torch.randint(0, vocab, (3, 9), generator=g)
    torch.testing.assert_close(spans.target_probs(y), dense.gather(-1, y[..., None])[..., 0])
    part = copy_spans(dec[:, 5:], table, tail=dec[:, 2:5])
    torch.testing.assert_close(part.probs(vocab), dense[:, 5:])
    padded = dec.clone()
    padded[:, :3] = -1
    got = copy_spans(padded, table).probs(vocab)
    assert not got[:, :3].any()
    for b in range(2):
        ref = copy_probs_ref(dec[b, 3:].tolist(), ids[b][mask[b]].tolist(), 4, vocab, decay)
        torch.testing.assert_close(got[b, 3:], ref)  # the suffixes start after the padding
    sel = spans.has.clone()
    torch.testing.assert_close(spans[sel].probs(vocab), dense[sel])


@pytest.mark.parametrize("spread", [0.1, 5.0, 60.0])
def test_copy_mix_logits_agree_with_the_reference(spread):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 7, generator=g) * spread
    c = torch.randn(40, generator=g) * 6
    counts = (torch.rand(40, 7, generator=g) > 0.6).float() * torch.randint(1, 4, (40, 7), generator=g)
    counts[::5] = 0.0  # every fifth position: no suffix occurs
    has = counts.sum(-1) > 0
    copy = counts / counts.sum(-1, keepdim=True).clamp_min(1)
    got = copy_mix_logits(logits, c, copy, has)
    torch.testing.assert_close(
        got.log_softmax(-1).double(), copy_mix_logits_ref(logits, c, copy, has), rtol=1e-5, atol=1e-5
    )
    assert (~has).any() and torch.equal(got[~has], logits[~has])  # no suffix: the mixture bit for bit
    y = torch.randint(0, 7, (40,), generator=g)
    nll = -logits.log_softmax(-1).gather(-1, y[:, None])[:, 0]
    want = -copy_mix_logits_ref(logits, c, copy, has).gather(-1, y[:, None])[:, 0]
    got_nll = copy_mix_nll(nll, c, copy.gather(-1, y[:, None])[:, 0], has)
    torch.testing.assert_close(got_nll.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got_nll).all()


def _copying(
    hidden: bool = False,
    length: bool = False,
    agree: bool = False,
    seed: int = 5,
    prob: bool = False,
    near: bool = False,
    sure: bool = False,
    decay: float = 0.0,
    top: bool = False,
    read: bool = False,
    count: bool = False,
) -> CepeForCausalLM:
    """:func:`_matched` (3 suffix orders) with the copy, its head given random weights (``prob``,
    ``near``, ``sure``, ``top``, ``read``, ``count``: with the copy head's own inputs; ``decay``: its votes weighed by
    recency)."""
    model = _matched(hidden)
    model.enable_output_mix(3, hidden, length=length, agree=agree)
    model.enable_output_copy(prob, near, sure, top, read, count)
    model.set_mix_copy_decay(decay)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.copy_head.weight.copy_(torch.randn(model.copy_head.weight.shape, generator=g))
        model.copy_head.bias.fill_(-0.5)
    return model


@pytest.mark.parametrize(
    "hidden,agree,prob,near,sure,decay,top",
    [
        (False, False, False, False, False, 0.0, False),
        (True, True, False, False, False, 0.0, False),
        (False, True, True, False, False, 0.0, False),
        (False, True, True, True, False, 0.0, False),
        (False, False, False, False, True, 0.0, False),
        (False, True, True, True, True, 0.0, False),
        (False, True, True, True, True, 2.5, False),
        (False, False, False, False, False, 0.0, True),
        (False, True, True, True, True, 1.0, True),
    ],
)
@pytest.mark.parametrize("read,count", [(False, False), (True, False), (False, True)])
def test_the_model_mixes_in_the_copy(hidden, agree, prob, near, sure, decay, top, read, count):
    """Logits = the reference mixture, then the reference copy of each example's real context tokens
    mixed in with μ from the copy head over the mixing head's inputs (with ``mix_copy_prob`` the
    mixture's probability of a draw from the copy, floored log / 8; with ``mix_copy_near`` log(1 + d / 64)
    / 4 of the matched suffix's most recent distance, by the scanning reference; with ``mix_copy_sure``
    the reader's largest log-probability, floored / 8; with ``mix_copy_decay`` the votes weighed by the
    reference; with ``mix_copy_top`` the reference copy's largest probability; with ``mix_copy_read`` the
    reader's probability of a draw from the copy, floored log / 8; with ``mix_copy_count`` log(1 + the
    matched suffix's occurrences) / 4, by scanning); the loss is their cross-entropy."""
    model = _copying(
        hidden, agree=agree, prob=prob, near=near, sure=sure, decay=decay, top=top, read=read, count=count
    )
    ids, enc_ids, enc_mask = _padded_case()
    ids[:, 4] = 9  # a token the context lacks: no suffix occurs there
    out, h_ctx, h_dec, lc, ld, match = _both_sides(model, ids, enc_ids, enc_mask)
    with torch.no_grad():
        x = model.prepare_context(enc_ids, enc_mask).suffix_features(ids, 0)
        loss = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask, labels=ids).loss
    torch.testing.assert_close(x[..., :3], match)
    copy = torch.stack(
        [
            copy_probs_ref(ids[b].tolist(), enc_ids[b][enc_mask[b]].tolist(), 3, lc.shape[-1], decay)
            for b in range(2)
        ]
    )
    has = copy.sum(-1) > 0
    assert has.any() and (~has).any()
    mixed = mix_logits_ref(lc, ld, mix_logit(model.mix_head, h_ctx, h_dec, x, hidden))
    if prob:  # the expected mixture probability of a copied token, by the dense distributions
        s = (copy.double() * mixed.exp()).sum(-1)
        f = torch.where(has, s.log().clamp_min(-16.0) / 8, torch.zeros_like(s))
        assert (f[has] < -0.05).any()  # the input is not trivially zero
        x = torch.cat([x, f[..., None].to(x.dtype)], dim=-1)
    if near:
        d = torch.tensor(
            [_nearest_ref(ids[b].tolist(), enc_ids[b][enc_mask[b]].tolist(), 3) for b in range(2)]
        ).float()
        assert (d[has] > 1).any() and not d[~has].any()
        r = torch.where(has, torch.log1p(d / 64) / 4, torch.zeros_like(d))
        x = torch.cat([x, r[..., None].to(x.dtype)], dim=-1)
    if sure:
        best = lc.double().log_softmax(-1).max(-1).values
        u = torch.where(has, best.clamp_min(-16.0) / 8, torch.zeros_like(best))
        assert (u[has] < -0.05).any()  # the input is not trivially zero
        x = torch.cat([x, u[..., None].to(x.dtype)], dim=-1)
    if top:
        t = copy.amax(-1)
        assert ((t < 0.99) & has).any()  # the input is not trivially one
        x = torch.cat([x, t[..., None].to(x.dtype)], dim=-1)
    if read:
        s = (copy.double() * lc.double().softmax(-1)).sum(-1)
        q = torch.where(has, s.log().clamp_min(-16.0) / 8, torch.zeros_like(s))
        assert (q[has] < -0.05).any()  # the input is not trivially zero
        x = torch.cat([x, q[..., None].to(x.dtype)], dim=-1)
    if count:
        n = torch.tensor(
            [_occurrences_ref(ids[b].tolist(), enc_ids[b][enc_mask[b]].tolist(), 3) for b in range(2)]
        ).float()
        assert (n[has] > 1).any() and not n[~has].any()
        x = torch.cat([x, (torch.log1p(n) / 4)[..., None].to(x.dtype)], dim=-1)
    c = mix_logit(model.copy_head, h_ctx, h_dec, x, hidden)
    want = copy_mix_logits_ref(mixed, c, copy, has)
    torch.testing.assert_close(out.log_softmax(-1).double(), want, rtol=1e-4, atol=1e-4)
    nll = -want[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    torch.testing.assert_close(loss.double(), nll, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        model.copy_head.bias.fill_(-60.0)
        model.copy_head.weight.zero_()
        off = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    torch.testing.assert_close(off.log_softmax(-1).double(), mixed, rtol=1e-4, atol=1e-4)
    assert (off - out).abs().max() > 1e-2  # the copy moved the distribution


def _occurrences_ref(ids: list[int], ctx: list[int], order: int) -> list[int]:
    """How many times the longest matched suffix (at most ``order`` tokens) of each position occurs in
    ``ctx`` followed by a token, by scanning (0 where none matches)."""
    out = []
    for j in range(len(ids)):
        n = 0
        for k in range(min(order, j + 1), 0, -1):
            n = sum(ctx[i : i + k] == ids[j - k + 1 : j + 1] for i in range(len(ctx) - k))
            if n:
                break
        out.append(n)
    return out


def _nearest_ref(ids: list[int], ctx: list[int], order: int) -> list[int]:
    """How far before the end of ``ctx`` the last successor of each position's longest matched suffix
    (at most ``order`` tokens) stands, by scanning (0 where none matches)."""
    out = []
    for j in range(len(ids)):
        d = 0
        for k in range(min(order, j + 1), 0, -1):
            hits = [i for i in range(len(ctx) - k) if ctx[i : i + k] == ids[j - k + 1 : j + 1]]
            if hits:
                d = len(ctx) - (hits[-1] + k)
                break
        out.append(d)
    return out


@pytest.mark.parametrize("real", range(1, 10))
def test_a_context_shorter_than_the_suffix_orders_copies_what_it_holds(real):
    """A context with no more real tokens than the match orders (an online teacher's short example, a
    short prompt's context) has the grams of the orders it holds and none longer: the copy is the
    reference's, and each of the model's rows is what that row alone gives (8 orders, as shipped)."""
    g = torch.Generator().manual_seed(real)
    ids = torch.randint(0, 3, (2, 2, 8), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1] = False
    mask[1, 0, :real] = True  # the second example holds `real` tokens
    dec = torch.randint(0, 3, (2, 7), generator=g)
    spans = copy_spans(dec, context_successors(ids, mask, 8, recency=True, decay=0.5))
    for b in range(2):
        ref = copy_probs_ref(dec[b].tolist(), ids[b][mask[b]].tolist(), 8, 3, 0.5)
        torch.testing.assert_close(spans.probs(3)[b], ref)
    model = _mixed(5, mix_match=8, mix_hidden=False)
    model.enable_output_mix(8, False, length=True, agree=True)
    model.enable_output_copy(True, True, True, True, True, True)
    model.set_mix_copy_decay(1.0)
    with torch.no_grad():
        for head in (model.mix_head, model.copy_head):
            head.weight.copy_(torch.randn(head.weight.shape, generator=g))
    enc_ids, enc_mask = _few_tokens((2, 3, 8), 4), torch.ones(2, 3, 8, dtype=torch.bool)
    enc_mask[1] = False
    enc_mask[1, 0, :real] = True
    ids = _few_tokens((2, 9), 5)
    with torch.no_grad():
        both = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        for b in range(2):
            one = slice(b, b + 1)
            alone = model(
                ids[one], encoder_input_ids=enc_ids[one], encoder_attention_mask=enc_mask[one]
            ).logits
            torch.testing.assert_close(both[one], alone)


def test_the_nearest_occurrence_agrees_with_a_scan():
    """``CopySpans.nearest``: padded chunks read as one text of their real tokens, a tail, no match."""
    g = torch.Generator().manual_seed(11)
    for vocab in (3, 7):
        ids = torch.randint(0, vocab, (3, 4, 6), generator=g)
        mask = torch.rand(3, 4, 6, generator=g) > 0.3
        mask[2] = False
        dec = torch.randint(0, vocab, (3, 9), generator=g)
        table = context_successors(ids, mask, 3, recency=True)
        got = copy_spans(dec, table).nearest()
        for b in range(3):
            assert got[b].tolist() == _nearest_ref(dec[b].tolist(), ids[b][mask[b]].tolist(), 3)
        part = copy_spans(dec[:, 5:], table, tail=dec[:, 3:5]).nearest()
        assert torch.equal(part, got[:, 5:])
    # a hand case: "1" last continues (to 2) 4 tokens before the end, "1 2" (to 4) 3 before it
    ctx = torch.tensor([[1, 2, 3, 1, 2, 4, 2, 1]])
    got = copy_spans(torch.tensor([[1, 2, 5]]), context_successors(ctx, None, 2, recency=True))
    assert got.nearest().tolist() == [[4, 3, 0]]
    with pytest.raises(ValueError, match="recency=True"):
        copy_spans(torch.tensor([[1, 2]]), context_successors(ctx, None, 2)).nearest()


@pytest.mark.parametrize(
    "prob,near,sure,decay,top",
    [
        (False, False, False, 0.0, False),
        (True, False, False, 0.0, False),
        (True, True, False, 0.0, False),
        (False, True, True, 0.0, False),
        (True, True, True, 1.0, True),
    ],
)
@pytest.mark.parametrize("read,count", [(False, False), (True, True)])
def test_the_training_loss_agrees_with_the_reference_path(prob, near, sure, decay, top, read, count):
    """The fast loss (each side's log-probability of the target, the copy's probability of it, with
    ``mix_copy_prob`` the copy's expectation under the mixture in chunks of rows; votes weighed with
    ``decay``) equals the cross-entropy of the mixed logits, and so do their gradients on both heads."""
    model = _copying(
        agree=True, prob=prob, near=near, sure=sure, decay=decay, top=top, read=read, count=count
    )
    ids, enc_ids, enc_mask = _padded_case()
    labels = ids.clone()
    labels[0, :2] = -100
    ctx = model.prepare_context(enc_ids, enc_mask)
    base = model.decoder.get_decoder()
    with torch.no_grad(), model.use_context(ctx):
        hidden = base(ids).last_hidden_state
    with torch.no_grad(), model.use_context(None):
        alone = base(ids).last_hidden_state
    match, copy = ctx.suffix_inputs(ids, 0)
    assert copy is not None and copy.has.any() and (copy.weight is None) == (decay == 0)
    grads = []
    for fast in (True, False):
        model.zero_grad()
        nll = mixture_token_nll(model, hidden, alone, labels, HeadWeight(), fast, match, copy)
        nll.mean().backward()
        grads.append((nll.detach(), model.copy_head.weight.grad.clone(), model.mix_head.weight.grad.clone()))
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert grads[0][1].abs().sum() > 0


def test_the_chunked_copy_expectation_agrees_with_the_dense_one():
    """``chunked_copy_expectation`` (rows in chunks, positions without a match skipped) = ``expected``
    of the whole mixture's log-probabilities = the dense sum."""
    g = torch.Generator().manual_seed(3)
    vocab, d = 11, 6
    ctx_ids = torch.randint(0, vocab, (1, 40), generator=g)
    dec = torch.randint(0, vocab, (1, 23), generator=g)
    dec[0, :5] = vocab + 1  # no match at the start: chunks with nothing to compute
    spans = copy_spans(dec, context_successors(ctx_ids, None, 3))[0]  # (23,)
    h_ctx, h_dec, w = torch.randn(23, d, generator=g), torch.randn(23, d, generator=g), torch.randn(vocab, d)
    a = torch.randn(23, generator=g) * 3
    logp = torch.logaddexp(
        F.logsigmoid(a)[:, None] + (h_ctx @ w.T).log_softmax(-1),
        F.logsigmoid(-a)[:, None] + (h_dec @ w.T).log_softmax(-1),
    )
    dense = (spans.probs(vocab) * logp.exp()).sum(-1)
    torch.testing.assert_close(spans.expected(logp), dense)
    for chunk in (1, 4, 100):
        torch.testing.assert_close(chunked_copy_expectation(h_ctx, h_dec, a, w, spans, chunk), dense)
    assert spans.has.any() and (~spans.has).any() and dense[spans.has].gt(0).all()
    f = copy_agreement_feature(torch.tensor([1.0, 1e-3, 1e-30, 0.5]), torch.tensor([True, True, True, False]))
    torch.testing.assert_close(f, torch.tensor([0.0, math.log(1e-3) / 8, -2.0, 0.0]))


def test_the_chunked_reader_inputs_agree_with_the_dense_ones():
    """``chunked_reader_inputs`` (rows in chunks, only the rows with a suffix, one pass of logits for
    both) = ``top_logprob`` of all logits at once = the largest log-softmax entry, and = the copy's
    expectation under the reader's softmax; 0 without a match; ``reader_sure_feature`` floors the first at
    −16, scales by 1/8 and is 0 without a match."""
    g = torch.Generator().manual_seed(4)
    vocab, d = 11, 6
    ctx_ids = torch.randint(0, vocab, (1, 40), generator=g)
    dec = torch.randint(0, vocab, (1, 23), generator=g)
    dec[0, :5] = vocab + 1  # no match at the start
    spans = copy_spans(dec, context_successors(ctx_ids, None, 3))[0]  # (23,)
    h, w = torch.randn(23, d, generator=g) * 3, torch.randn(vocab, d, generator=g)
    logp = (h.double() @ w.double().T).log_softmax(-1)
    has = spans.has
    assert has.any() and (~has).any()
    top = torch.where(has, logp.max(-1).values, torch.zeros(23, dtype=torch.float64)).float()
    expect = (spans.probs(vocab).double() * logp.exp()).sum(-1).float()  # 0 where no suffix occurs
    torch.testing.assert_close(top_logprob(h @ w.T)[has], top[has])
    for chunk in (1, 4, 100):
        got_top, got_expect = chunked_reader_inputs(h, w, spans, True, True, chunk)
        torch.testing.assert_close(got_top, top)
        torch.testing.assert_close(got_expect, expect)
    assert chunked_reader_inputs(h, w, spans, False, True)[0] is None
    assert chunked_reader_inputs(h, w, spans, True, False)[1] is None
    assert (top[has] < -0.1).any() and (top <= 0).all() and (expect[has] > 0).all()
    u = reader_sure_feature(torch.tensor([0.0, -4.0, -40.0, -1.0]), torch.tensor([True, True, True, False]))
    torch.testing.assert_close(u, torch.tensor([0.0, -0.5, -2.0, 0.0]))


def test_the_copy_heads_own_inputs_start_at_zero_weight(tmp_path):
    """A copy head trained without ``mix_copy_prob`` keeps its function when the input is added (zero
    weight); the input then changes μ once it has a weight; saved and loaded back as such."""
    model = _copying(agree=True)
    ids, enc_ids, enc_mask = _padded_case()
    kw = dict(encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask)
    with torch.no_grad():
        before = model(ids, **kw).logits
        model.enable_output_copy(prob=True)
        assert model.cepe_config.mix_copy_prob and model.copy_head.weight.shape == (1, 7)
        assert model.copy_head.weight[0, -1] == 0
        torch.testing.assert_close(model(ids, **kw).logits, before, rtol=0, atol=0)
        model.enable_output_copy(prob=True)  # idempotent
        model.enable_output_copy()  # never narrows a head
        assert model.copy_head.weight.shape == (1, 7)
        model.enable_output_copy(near=True)  # the recency input after it, zero too
        assert model.cepe_config.mix_copy_near and model.copy_head.weight.shape == (1, 8)
        torch.testing.assert_close(model(ids, **kw).logits, before, rtol=0, atol=0)
        model.enable_output_copy(sure=True)  # the reader's certainty after them, zero too
        assert model.cepe_config.mix_copy_sure and model.copy_head.weight.shape == (1, 9)
        torch.testing.assert_close(model(ids, **kw).logits, before, rtol=0, atol=0)
        model.copy_head.weight[0, -3] = 3.0
        after = model(ids, **kw).logits
        assert (after - before).abs().max() > 1e-3
        model.copy_head.weight[0, -2] = -3.0
        again = model(ids, **kw).logits
        assert (again - after).abs().max() > 1e-3
        model.copy_head.weight[0, -1] = 3.0
        assert (model(ids, **kw).logits - again).abs().max() > 1e-3
    from cepe.config import COPY_HEAD_INPUTS

    for name in COPY_HEAD_INPUTS:  # every copy-head input needs the copy
        with pytest.raises(ValueError, match=f"{name} is an input of the copy"):
            CepeConfig(**{**tiny_cepe_config(output_mix=True, mix_match=2).__dict__, name: True})
    model.save_pretrained(tmp_path / "own")
    back = CepeForCausalLM.from_pretrained(tmp_path / "own", decoder=tiny_decoder())
    assert (
        back.cepe_config.mix_copy_prob and back.cepe_config.mix_copy_near and back.cepe_config.mix_copy_sure
    )
    with torch.no_grad():
        torch.testing.assert_close(back(ids, **kw).logits, model(ids, **kw).logits, rtol=0, atol=0)


def test_greedy_generation_copies_a_span_the_decoder_does_not_continue():
    """With μ near 1 the continuation of a span that occurs once in the context is copied token by token,
    what neither the decoder nor the mixture generates."""
    model = _copying()
    with torch.no_grad():
        model.copy_head.weight.zero_()
        model.copy_head.bias.fill_(30.0)
    span = [7, 19, 3, 42, 11, 29, 5, 33]
    enc_ids = torch.tensor([[list(range(60, 68)), span, list(range(70, 78))]])
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    got = model.generate(torch.tensor([span[:3]]), encoder_input_ids=enc_ids, **kw)
    assert got[0, 3:].tolist() == span[3:]
    alone = tiny_decoder().generate(torch.tensor([span[:3]]), **kw)
    assert alone[0, 3:].tolist() != span[3:]


def test_invariants_no_context_and_no_match_are_the_mixture():
    model = _copying(agree=True)
    ids = _few_tokens((2, 9), 6)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, tiny_decoder()(ids).logits)  # no context: the decoder
        enc_ids = torch.full((2, 2, 4), 9)  # tokens the decoder never sees: nothing matches
        with_copy = model(ids, encoder_input_ids=enc_ids).logits
        model.copy_head = None
        model.cepe_config.mix_copy = False
        assert torch.equal(model(ids, encoder_input_ids=enc_ids).logits, with_copy)


@pytest.mark.parametrize("mode", ["kv", "absorbed"])
def test_incremental_calls_continue_the_copy(mode):
    check_incremental_calls(_copying(agree=True), mode, _few_tokens((2, 10), 2), _few_tokens((2, 3, 8), 3))
    check_incremental_calls(
        _copying(agree=True, prob=True, near=True, sure=True, decay=1.0, top=True, read=True, count=True),
        mode,
        _few_tokens((2, 10), 2),
        _few_tokens((2, 3, 8), 3),
    )


def test_beam_search_with_the_copy():
    check_beam_scores(_copying(hidden=True))
    check_beam_scores(_copying(prob=True, near=True, sure=True, decay=0.5, top=True, read=True, count=True))


def test_vote_decay_saves_loads_and_refuses_bad_values(tmp_path):
    """``mix_copy_decay`` travels with the adapter; 0 is the unweighted copy bit for bit; a decay moves the
    distribution where several votes disagree; bad values and a decay without the copy are refused."""
    model = _copying(length=True, agree=True, decay=0.0)
    ids, enc_ids, enc_mask = _padded_case()
    kw = dict(encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask)
    with torch.no_grad():
        plain = model(ids, **kw).logits
        assert torch.equal(_copying(length=True, agree=True)(ids, **kw).logits, plain)
        model.set_mix_copy_decay(2.0)
        decayed = model(ids, **kw).logits
    assert (decayed - plain).abs().max() > 1e-3
    model.save_pretrained(tmp_path / "decay")
    back = CepeForCausalLM.from_pretrained(tmp_path / "decay", decoder=tiny_decoder())
    assert back.cepe_config.mix_copy_decay == 2.0
    with torch.no_grad():
        assert torch.equal(back(ids, **kw).logits, decayed)
    for bad in (-0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite number ≥ 0"):
            model.set_mix_copy_decay(bad)
    with pytest.raises(ValueError, match="enable_output_copy first"):
        _matched(hidden=False).set_mix_copy_decay(1.0)
    with pytest.raises(ValueError, match="mix_copy_decay weighs the copy's votes: set mix_copy"):
        tiny_cepe_config(output_mix=True, mix_match=2, mix_copy_decay=1.0)
    with pytest.raises(ValueError, match="finite number ≥ 0"):
        context_successors(enc_ids, enc_mask, 2, decay=-1.0)


def test_save_load_enable_and_errors(tmp_path):
    model = _copying(length=True)
    model.save_pretrained(tmp_path / "copy")
    back = CepeForCausalLM.from_pretrained(tmp_path / "copy", decoder=tiny_decoder())
    assert back.cepe_config.mix_copy and torch.equal(back.copy_head.weight, model.copy_head.weight)
    ids, enc_ids = _few_tokens((2, 9), 4), _few_tokens((2, 3, 8), 5)
    with torch.no_grad():
        before = model(ids, encoder_input_ids=enc_ids).logits
        assert torch.equal(back(ids, encoder_input_ids=enc_ids).logits, before)
        model.enable_output_copy()  # idempotent
        model.enable_output_mix(3, False, length=True, agree=True)  # both heads widened, zero weights
        assert model.copy_head.weight.shape == (1, 7) and not model.copy_head.weight[0, 4:].any()
        assert torch.equal(model(ids, encoder_input_ids=enc_ids).logits, before)
    fresh = _matched(hidden=False)
    fresh.enable_output_copy()
    assert not fresh.copy_head.weight.any() and fresh.copy_head.bias.item() == COPY_BIAS
    with pytest.raises(ValueError, match="missing keys.*copy_head"):
        fresh.load_adapter_state_dict(_matched(hidden=False).adapter_state_dict())
    plain = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(output_mix=True))
    with pytest.raises(ValueError, match="enable_output_mix first"):
        plain.enable_output_copy()
    with pytest.raises(ValueError, match="mix_copy copies after the suffixes"):
        CepeConfig(**{**tiny_cepe_config(output_mix=True).__dict__, "mix_copy": True})


def test_dropping_the_mixture_leaves_the_adapter_it_was_trained_over(tmp_path):
    """``disable_output_mix`` (``cepe export --drop-mixture``): the logits are the context side's alone
    (the adapter under the heads), saved without the heads and loaded back as such."""
    model = _copying(length=True, agree=True)
    ids, enc_ids, enc_mask = _padded_case()
    _out, _h_ctx, _h_dec, lc, _ld, _match = _both_sides(model, ids, enc_ids, enc_mask)
    model.disable_output_mix()
    model.disable_output_mix()  # idempotent
    c = model.cepe_config
    assert model.mix_head is None and model.copy_head is None and not model.reads_context_ids
    assert not (c.output_mix or c.mix_match or c.mix_length or c.mix_agree or c.mix_copy)
    with torch.no_grad():
        got = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    torch.testing.assert_close(got, lc, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path / "plain")
    back = CepeForCausalLM.from_pretrained(tmp_path / "plain", decoder=tiny_decoder())
    assert back.mix_head is None and not any(
        k.startswith(("mix_head", "copy_head")) for k in back.adapter_state_dict()
    )
    with torch.no_grad():
        again = back(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    torch.testing.assert_close(again, lc, rtol=1e-5, atol=1e-5)


def test_left_padded_batch_generates_each_row_as_alone():
    """Pad columns match nothing: the pad id 3 followed by the row's first token (1) occurs in the
    context, and is not a suffix of the row."""
    ids, enc_ids = _few_tokens((2, 8), 4), _few_tokens((2, 3, 8), 5)
    assert ids[1, 3] == 1 and "3 1" in " ".join(map(str, enc_ids[1].flatten().tolist()))
    check_left_padded_generation(_copying(agree=True), ids, enc_ids, pad_id=3)
    # one real token (4) after 7 pads: the pad id and it form a suffix that occurs, read at generation
    assert "3 4" in " ".join(map(str, enc_ids[1].flatten().tolist())) and ids[1, 7] == 4
    check_left_padded_generation(_copying(agree=True), ids, enc_ids, pad_id=3, pads=7, cache="static")
    check_left_padded_generation(
        _copying(prob=True, near=True, sure=True, decay=0.5, top=True, read=True, count=True),
        ids,
        enc_ids,
        pad_id=3,
    )
