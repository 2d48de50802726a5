"""Incremental calls that do not directly continue the previous one: a cache cropped by assisted decoding
(``DynamicCache.crop``, ``generate(prompt_lookup_num_tokens=...)``) or continuations branching from one
prefill cache. What a context keeps per decoder position (``CrossContext.read_state`` for the induction gates
and run biases, ``CrossContext.mix_tail`` for the output mixture's suffix matches) is read at entry
``past − 1``, so each such call gives the logits of a single call over the same tokens."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import VOCAB, random_context, randomize_cross, tiny_cepe_config, tiny_decoder

from cepe import CepeForCausalLM

OPTIONS = {
    "read": dict(induction_gate=True, run_bias=True),
    "mix": dict(output_mix=True, mix_match=3, mix_copy=True, mix_agree=True),
    "both": dict(induction_gate=True, output_mix=True, mix_match=3),
}


def _model(**kw) -> CepeForCausalLM:
    model = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(**kw)).eval()
    randomize_cross(model, std=0.5)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for head in (model.mix_head, model.copy_head):
            for p in [] if head is None else head.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 2.0)
    return model


def _copying_context(seed: int = 5):
    """A context of one row, and decoder tokens that copy its text (so runs and suffix matches happen)."""
    enc_ids, enc_mask = random_context(1, 3)
    text = enc_ids[0].flatten()
    return enc_ids, enc_mask, text


def _full(model, ids, enc_ids, enc_mask) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits


def _crop(cache, length: int) -> None:
    """``cache`` cut back to its first ``length`` tokens, as assisted decoding does (a negative count
    removes that many tokens in transformers 5)."""
    cache.crop(length - cache.get_seq_length())
    assert cache.get_seq_length() == length


def _step(model, ids, ctx, cache):
    with torch.no_grad():
        out = model(ids, cross_context=ctx, past_key_values=cache, use_cache=True)
    return out.logits, out.past_key_values


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("mode", ["kv", "absorbed"])
def test_a_cropped_cache_gives_the_full_forward(name, mode):
    """Prefill, run on, crop the cache back (a rejected draft), then go on with other tokens: every call's
    logits are those of one call over the tokens the cache holds plus its own (before: the state of the
    rejected tokens was dropped or used)."""
    model = _model(**OPTIONS[name])
    enc_ids, enc_mask, text = _copying_context()
    seq = torch.cat([text[:6], text[6:10], text[3:8], torch.tensor([5, 9, 11])])[None]  # (1, 18)
    draft = torch.cat([text[:6], text[6:10], torch.tensor([1, 2, 3, 4])])[None]  # the rejected tokens: 10..13
    ctx = model.prepare_context(enc_ids, enc_mask, cross_attention_cache=mode)
    logits, cache = _step(model, draft[:, :6], ctx, None)
    logits, cache = _step(model, draft[:, 6:14], ctx, cache)  # 8 tokens: 4 accepted, 4 rejected
    _crop(cache, 10)
    got = []
    for a, b in ((10, 12), (12, 13), (13, 18)):
        logits, cache = _step(model, seq[:, a:b], ctx, cache)
        got.append(logits)
    full = _full(model, seq, enc_ids, enc_mask)
    torch.testing.assert_close(torch.cat(got, dim=1), full[:, 10:], rtol=1e-4, atol=1e-3)
    # a crop to less than a suffix's length, and to nothing but one token, read the same way
    _crop(cache, 1)
    logits, cache = _step(model, seq[:, 1:4], ctx, cache)
    torch.testing.assert_close(logits, full[:, 1:4], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_branches_from_one_prefill_cache(name):
    """Two continuations of one prefill (copies of its cache), run one after the other: each gives its own
    full forward (before: the second read the first's state). Interleaved branches each get a fork of
    the context."""
    model = _model(**OPTIONS[name])
    enc_ids, enc_mask, text = _copying_context()
    pre = text[:6][None]
    branches = [text[6:9][None], torch.tensor([[3, 4, 5]]), text[1:4][None]]
    ctx = model.prepare_context(enc_ids, enc_mask)
    _, cache = _step(model, pre, ctx, None)
    for cont in branches:
        logits, _ = _step(model, cont, ctx, copy.deepcopy(cache))
        full = _full(model, torch.cat([pre, cont], dim=1), enc_ids, enc_mask)[:, 6:]
        torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-3)
    # interleaved, one token at a time: each branch on its own fork of the context
    forks = [(ctx.fork(), copy.deepcopy(cache)) for _ in branches]
    got: list[list[torch.Tensor]] = [[] for _ in branches]
    for t in range(3):
        for i, cont in enumerate(branches):
            c, kv = forks[i]
            logits, kv = _step(model, cont[:, t : t + 1], c, kv)
            forks[i] = (c, kv)
            got[i].append(logits)
    for cont, steps in zip(branches, got):
        full = _full(model, torch.cat([pre, cont], dim=1), enc_ids, enc_mask)[:, 6:]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_prompt_lookup_decoding_gives_the_greedy_tokens(name):
    """HF's prompt-lookup (assisted) decoding proposes tokens from the prompt and crops the cache back to
    those it accepts: the tokens are greedy decoding's."""
    model = _model(**OPTIONS[name])
    enc_ids, enc_mask, text = _copying_context()
    prompt = torch.cat([text[:12], text[:12]])[None]  # repeated: lookup finds candidates
    kw = dict(
        attention_mask=torch.ones_like(prompt),
        encoder_input_ids=enc_ids,
        encoder_attention_mask=enc_mask,
        max_new_tokens=16,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    greedy = model.generate(prompt, **kw)
    lookup = model.generate(
        prompt, prompt_lookup_num_tokens=3, output_logits=True, return_dict_in_generate=True, **kw
    )
    assert torch.equal(greedy, lookup.sequences)
    # every step's logits (those after a rejected draft too) are a single call's over the sequence
    full = _full(model, greedy[:, :-1], enc_ids, enc_mask)[0, prompt.shape[1] - 1 :]
    torch.testing.assert_close(torch.cat(lookup.logits), full, rtol=1e-4, atol=1e-3)


def test_a_cache_this_context_did_not_see_warns():
    """A call after cached tokens whose history this context lacks (a fresh context per call) says so
    instead of silently reading them as unknown; a plain model (nothing kept per position) does not."""
    enc_ids, enc_mask, text = _copying_context()
    for name in ("read", "mix"):
        model = _model(**OPTIONS[name])
        _, cache = _step(model, text[:6][None], model.prepare_context(enc_ids, enc_mask), None)
        with pytest.warns(RuntimeWarning, match="no record of them"):
            _step(model, text[6:8][None], model.prepare_context(enc_ids, enc_mask), cache)
    plain = _model()
    _, cache = _step(plain, text[:6][None], plain.prepare_context(enc_ids, enc_mask), None)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _step(plain, text[6:8][None], plain.prepare_context(enc_ids, enc_mask), cache)


def test_history_is_kept_by_position_and_follows_beams():
    """``read_state`` holds one entry per decoder position (B, H, P), ``mix_tail`` the tokens (B, P); a
    beam reorder moves whole rows; a fresh call (past 0) starts a new history."""
    model = _model(**OPTIONS["both"])
    enc_ids, enc_mask = random_context(2, 3)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    ctx = model.prepare_context(enc_ids, enc_mask)
    _, cache = _step(model, ids[:, :5], ctx, None)
    _step(model, ids[:, 5:], ctx, cache)
    doubled = ctx.with_decoder_rows()
    heads = model.cross_attention_modules()[0].num_heads
    assert all(h.shape == (2, heads, 7) for h in ctx.read_state.values())
    assert torch.equal(doubled.mix_tail, ids)
    rows = torch.tensor([1, 1, 3, 3])
    before = {k: v.clone() for k, v in ctx.read_state.items()}
    doubled.reorder(rows)
    assert torch.equal(doubled.mix_tail, ids[[1, 1]])
    assert all(torch.equal(ctx.read_state[k], v[[1, 1]]) for k, v in before.items())
    _step(model, ids[:, :3], ctx, None)
    assert all(h.shape[-1] == 3 for h in ctx.read_state.values()) and doubled.mix_tail.shape == (2, 3)
