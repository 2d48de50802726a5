"""Suffix-match indicators (``cepe.mixture``: the vectorised form and its reference against a brute-force
search) and scripts/mix_fit.py (the recorded log-probabilities and mixing logits against the mixture
model's own output, a fitted head that separates the kinds)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import load_script, randomize_cross, tiny_cepe_config, tiny_decoder

from cepe import CepeForCausalLM
from cepe.mixture import (
    context_grams,
    mix_nll,
    suffix_agreement,
    suffix_agreement_ref,
    suffix_match_features,
    suffix_matches_ref,
)

mix_fit = load_script("mix_fit")


def _random_cases(seed: int, vocab: int):
    """Twenty (decoder ids, context ids) pairs over a small vocabulary: suffixes recur."""
    rng = random.Random(seed)
    for _ in range(20):
        ctx = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        yield [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))], ctx


def test_suffix_matches_agree_with_a_brute_force_search():
    for ids, ctx in _random_cases(0, 5):
        got = suffix_matches_ref(ids, ctx, 4)
        for j in range(len(ids)):
            for k in range(1, 5):
                want = j + 1 >= k and any(
                    ctx[i : i + k] == ids[j - k + 1 : j + 1] for i in range(len(ctx) - k)
                )  # i + k < len(ctx): a token follows the match
                assert got[j, k - 1].item() == float(want), (ids, ctx, j, k)


def _against_the_reference(seed: int, vocab: int, fast, ref):
    """``fast`` over 3 padded contexts of 4 chunks of 6 (4 orders) against ``ref`` per example on its real
    tokens read as one text; returns the decoder ids ``(3, 9)``, the grams and ``fast``'s output."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 4, 6), generator=g)
    mask = torch.rand(3, 4, 6, generator=g) > 0.3
    dec = torch.randint(0, vocab, (3, 9), generator=g)
    grams = context_grams(ids, mask, 4)
    whole = fast(dec, grams)
    for b in range(3):
        torch.testing.assert_close(whole[b], ref(dec[b].tolist(), ids[b][mask[b]].tolist(), 4))
    return dec, grams, whole


def test_vectorised_suffix_matches_agree_with_the_reference():
    """Chunks with padding read as one text; a row's tail continues its tokens (incremental calls);
    padding in the decoder matches nothing."""
    dec, grams, whole = _against_the_reference(2, 4, suffix_match_features, suffix_matches_ref)
    # the last 4 tokens as an incremental call, the 3 before them as its tail: the whole call's rows
    part = suffix_match_features(dec[:, 5:], grams, tail=dec[:, 2:5])
    torch.testing.assert_close(part, whole[:, 5:])
    padded = dec.clone()
    padded[:, :3] = -1
    got = suffix_match_features(padded, grams)
    assert got[:, :3].sum() == 0 and torch.equal(got[:, 6:], whole[:, 6:])


def test_suffix_agreement_agrees_with_a_brute_force_count():
    """1 / (distinct successors) of each matched suffix, 0 where it does not occur."""
    for ids, ctx in _random_cases(1, 4):
        got = suffix_agreement_ref(ids, ctx, 3)
        for j in range(len(ids)):
            for k in range(1, 4):
                nxt = {
                    ctx[i + k]
                    for i in range(len(ctx) - k)
                    if j + 1 >= k and ctx[i : i + k] == ids[j - k + 1 : j + 1]
                }
                want = 1.0 / len(nxt) if nxt else 0.0
                assert abs(got[j, k - 1].item() - want) < 1e-7, (ids, ctx, j, k)
    # a passage's suffix continues one way; a prefix followed by several labels does not
    got = suffix_agreement_ref([7, 1], [7, 1, 2, 5, 1, 3, 7, 1, 2, 9], 2)
    assert got.tolist() == [[1.0, 0.0], [0.5, 1.0]]


def test_vectorised_suffix_agreement_agrees_with_the_reference():
    dec, grams, whole = _against_the_reference(3, 3, suffix_agreement, suffix_agreement_ref)
    assert ((whole > 0) & (whole < 1)).any() and (whole == 1).any()  # both kinds occur
    torch.testing.assert_close(suffix_agreement(dec[:, 5:], grams, tail=dec[:, 2:5]), whole[:, 5:])
    torch.testing.assert_close(suffix_match_features(dec, grams), (whole > 0).float())
    short = context_grams(torch.tensor([[4], [5]]), None, 2)  # one token: no gram has a successor
    assert suffix_agreement(torch.tensor([[4, 4], [5, 5]]), short).sum() == 0


@pytest.mark.parametrize("inputs", [{}, {"mix_match": 3, "mix_length": True, "mix_agree": True}])
def test_collect_records_what_the_mixture_computes(monkeypatch, inputs):
    """``-mix_nll`` of the recorded log-probabilities and the recorded own logit is the mixture model's
    log-probability of each scored target (in fp32: ``collect`` runs bf16 autocast where bf16 is fast, as
    the evaluations' ``--autocast auto`` does), also for a head that reads more than the hidden states."""
    monkeypatch.setenv("CEPE_BF16", "0")
    cfg = tiny_cepe_config(output_mix=True, **inputs)
    model = CepeForCausalLM.from_decoder(tiny_decoder(), cfg).eval()
    randomize_cross(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.mix_head.weight.copy_(torch.randn(model.mix_head.weight.shape, generator=g) * 0.2)
    dec = torch.randint(1, 60, (1, 12), generator=g)
    enc = torch.randint(1, 60, (1, 2, 8), generator=g)
    ctx = enc.reshape(-1).tolist()
    rows = mix_fit.collect(model, [("d", dec, enc, ctx)], 5, 3)
    want = model(input_ids=dec, encoder_input_ids=enc).logits[0, :-1].log_softmax(-1)
    want = want.gather(-1, dec[0, 1:, None])[-5:, 0]
    got = -mix_nll(rows["lp_ctx"], rows["lp_dec"], rows["own"])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert rows["match"].shape == (5, 3) and len(rows["kind"]) == 5
    torch.testing.assert_close(rows["match"], suffix_matches_ref(dec[0].tolist(), ctx, 3)[:-1][-5:])


@pytest.mark.parametrize(
    "inputs, why",
    [
        ({"mix_match": 3, "mix_hidden": False}, "mix_hidden: false"),
        ({"mix_match": 3, "mix_copy": True}, "mix_copy"),
    ],
)
def test_collect_refuses_a_head_without_hidden_states_or_with_the_copy(inputs, why):
    model = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(output_mix=True, **inputs)).eval()
    dec, enc = torch.randint(1, 60, (1, 12)), torch.randint(1, 60, (1, 2, 8))
    with pytest.raises(SystemExit, match=why):
        mix_fit.collect(model, [("d", dec, enc, enc.reshape(-1).tolist())], 5, 3)


def test_a_fitted_head_gives_the_reader_the_tokens_it_gets_right():
    """Tokens with a match: the reader is sure and right; without: it is wrong. The fitted match head
    (raw inputs, its standardisation folded in) beats both sides alone."""
    g = torch.Generator().manual_seed(0)
    match = (torch.rand(400, 2, generator=g) < 0.3).float()
    hit = match[:, 0] > 0
    lp_ctx = torch.where(hit, torch.tensor(-0.05), torch.tensor(-6.0))
    lp_dec = torch.full((400,), -2.0)
    head = mix_fit.fit(match, lp_ctx, lp_dec, steps=300, lr=0.05)
    with torch.no_grad():
        a = head(match)[:, 0]
    nll = mix_nll(lp_ctx, lp_dec, a).mean()
    assert nll < 0.8 * min(-lp_ctx.mean(), -lp_dec.mean())
    assert torch.sigmoid(a[hit]).min() > 0.9 and torch.sigmoid(a[~hit]).max() < 0.1


def _copied_passage(vocab: int = 150_000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A context of 400 ids of a large vocabulary ``(1, 400)`` and decoder ids ``(1, 60)`` copied from it:
    suffixes of every length up to 8 occur."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(0, vocab, (1, 400), generator=g)
    return ctx[:, 150:210].clone(), ctx


def test_long_suffixes_of_a_large_vocabulary_are_found():
    """Grams of 4+ ids of a large vocabulary overflow int64: the exact hash (modulo 2^63) finds every
    occurring suffix, as the brute-force reference does; the hash of adapters saved before the fix
    (``wrap``) missed some and still does (their heads were fitted so)."""
    from cepe.mixture import _gram_hashes, context_successors, copy_probs_ref, copy_spans, suffix_hashes

    dec, ctx = _copied_passage()
    want = suffix_matches_ref(dec[0].tolist(), ctx[0].tolist(), 8)
    got = suffix_match_features(dec, context_grams(ctx, None, 8))
    torch.testing.assert_close(got[0], want)
    assert all((h[h != -1] >= 0).all() for h in suffix_hashes(dec, 8))
    assert (_gram_hashes(ctx, 8) >= 0).all() and (_gram_hashes(ctx, 8, wrap=True) < 0).any()
    table = context_successors(ctx, None, 8, wrap=True)
    old = copy_spans(dec, table, hashes=suffix_hashes(dec, 8, wrap=True))
    assert (old.has[0] == want[:, 0].bool()).all()  # order 1 never wraps: the same positions copy
    spans = copy_spans(dec, context_successors(ctx, None, 8))
    vocab = int(max(ctx.max(), dec.max())) + 1
    torch.testing.assert_close(
        spans.probs(vocab)[0], copy_probs_ref(dec[0].tolist(), ctx[0].tolist(), 8, vocab)
    )


def test_a_mixture_saved_before_the_hash_fix_keeps_its_hash():
    """A saved config with suffix matches and no ``mix_hash`` loads as ``wrap``; new configs and those that
    say so are ``exact``; the shipped adapter says ``wrap``; a model's suffix inputs follow its config."""
    import json
    from pathlib import Path

    import pytest

    from cepe.config import CepeConfig

    base = tiny_cepe_config(output_mix=True, mix_match=8, mix_hidden=False).to_dict()
    assert base["mix_hash"] == "exact"
    old = {k: v for k, v in base.items() if k != "mix_hash"}
    assert CepeConfig.from_dict(old).mix_hash == "wrap"
    assert CepeConfig.from_dict(base).mix_hash == "exact"
    plain = {k: v for k, v in tiny_cepe_config().to_dict().items() if k != "mix_hash"}
    assert CepeConfig.from_dict(plain).mix_hash == "exact"  # no mixture: nothing to keep
    with pytest.raises(ValueError, match="mix_hash must be"):
        CepeConfig.from_dict({**base, "mix_hash": "fast"})
    shipped = Path(__file__).resolve().parents[1] / "adapters" / "smollm2-135m-cepe" / "cepe_config.json"
    assert json.loads(shipped.read_text())["mix_hash"] == "wrap"
    dec, ctx = _copied_passage(vocab=90)  # within the tiny vocabulary: grams of 5+ ids still wrap
    want = suffix_matches_ref(dec[0].tolist(), ctx[0].tolist(), 8)
    for mode in ("exact", "wrap"):
        model = CepeForCausalLM.from_decoder(tiny_decoder(), CepeConfig.from_dict({**base, "mix_hash": mode}))
        with torch.no_grad():
            cc = model.prepare_context(ctx.view(1, 5, 80))
            feats = cc.suffix_features(dec, 0)[0, :, :8]
        assert torch.equal(feats, want) == (mode == "exact")
