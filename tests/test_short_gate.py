"""Gates for contexts shorter than the pivot (``CepeConfig.short_gate``): their logit times
``max(0, log(length_scale / n))``, added to the token and match gates' logits; and their mirror for longer
contexts (``CepeConfig.long_gate``), times ``max(0, log(n / length_scale))``."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import VOCAB, random_context, randomize_cross, tiny_cepe_config, tiny_decoder

from cepe import CepeForCausalLM

PIVOT = 16


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(5))


def _masks() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    enc_ids, long_mask = random_context(1, 3)  # 24 real tokens: above the pivot
    short_mask = long_mask.clone()
    short_mask[0, 1:] = False  # 8 real tokens: below it
    return enc_ids, long_mask, short_mask


def _model(short: bool) -> CepeForCausalLM:
    cfg = tiny_cepe_config(
        null_key=True, token_gate=True, match_gate=True, length_scale=PIVOT, length_scale_below=True
    )
    model = CepeForCausalLM.from_decoder(tiny_decoder(), cfg).eval()
    randomize_cross(model)
    if short:  # added after randomising, so both models share every other weight
        model.enable_short_gate()
        g = torch.Generator().manual_seed(9)
        with torch.no_grad():
            for m in model.cross_attention_modules():
                for p in (m.short_gate.weight, m.short_gate.bias, m.short_match):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _logits(model, enc_ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids(), encoder_input_ids=enc_ids, encoder_attention_mask=mask).logits


def test_added_gates_change_nothing_and_long_contexts_never_see_them():
    enc_ids, long_mask, short_mask = _masks()
    plain = _model(short=False)
    before = {k: _logits(plain, enc_ids, m) for k, m in (("long", long_mask), ("short", short_mask))}
    plain.enable_short_gate()
    plain.enable_short_gate()  # idempotent
    assert plain.cepe_config.short_gate
    for k, m in (("long", long_mask), ("short", short_mask)):
        assert torch.equal(_logits(plain, enc_ids, m), before[k])
    gated = _model(short=True)
    assert torch.equal(_logits(gated, enc_ids, long_mask), before["long"])
    assert not torch.allclose(_logits(gated, enc_ids, short_mask), before["short"])


def test_below_the_pivot_they_are_the_other_gates_moved_by_the_length_feature():
    """At n = 8 a short gate is exactly a token gate and a match gate whose weights moved by
    ``log(16 / 8)`` times its own."""
    enc_ids, _, short_mask = _masks()
    gated, folded = _model(short=True), _model(short=False)
    f = math.log(PIVOT / 8)
    with torch.no_grad():
        for g, m in zip(gated.cross_attention_modules(), folded.cross_attention_modules()):
            m.token_gate.weight += f * g.short_gate.weight
            m.token_gate.bias += f * g.short_gate.bias
            m.match_gate[:, :2] += f * g.short_match
    torch.testing.assert_close(
        _logits(gated, enc_ids, short_mask), _logits(folded, enc_ids, short_mask), rtol=1e-4, atol=1e-5
    )


def test_gradients_save_load_and_a_match_gate_added_later(tmp_path):
    enc_ids, _, short_mask = _masks()
    model = _model(short=True).train()
    loss = model(_ids(), encoder_input_ids=enc_ids, encoder_attention_mask=short_mask, labels=_ids()).loss
    loss.backward()
    grads = [p.grad for m in model.cross_attention_modules() for p in (m.short_gate.weight, m.short_match)]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    model.eval().save_pretrained(tmp_path)
    loaded = CepeForCausalLM.from_pretrained(tmp_path, decoder=tiny_decoder()).eval()
    assert loaded.cepe_config.short_gate
    assert torch.equal(_logits(loaded, enc_ids, short_mask), _logits(model, enc_ids, short_mask))
    bare = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(length_scale=PIVOT, short_gate=True))
    assert bare.cross_attention_modules()[0].short_match is None
    bare.enable_match_gate()  # the short gates gain their match weights, zero
    assert all(not m.short_match.any() for m in bare.cross_attention_modules())
    with pytest.raises(ValueError, match="short_gate needs length_scale"):
        tiny_cepe_config(short_gate=True)
    with pytest.raises(ValueError, match="enable_length_scale first"):
        CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config()).enable_short_gate()


def _long_model(long: bool) -> CepeForCausalLM:
    model = _model(short=False)
    if long:
        model.enable_long_gate()
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for m in model.cross_attention_modules():
                for p in (m.long_gate.weight, m.long_gate.bias, m.long_match):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def test_long_gates_act_above_the_pivot_only_as_the_other_gates_moved():
    """Added zero: nothing changes; trained: contexts at or below the pivot are untouched, and at n = 24
    they are the token and match gates moved by ``log(24 / 16)`` times their own weights."""
    enc_ids, long_mask, short_mask = _masks()
    plain = _long_model(long=False)
    before = {k: _logits(plain, enc_ids, m) for k, m in (("long", long_mask), ("short", short_mask))}
    plain.enable_long_gate()
    plain.enable_long_gate()  # idempotent
    assert plain.cepe_config.long_gate
    for k, m in (("long", long_mask), ("short", short_mask)):
        assert torch.equal(_logits(plain, enc_ids, m), before[k])
    gated, folded = _long_model(long=True), _long_model(long=False)
    assert torch.equal(_logits(gated, enc_ids, short_mask), before["short"])
    assert not torch.allclose(_logits(gated, enc_ids, long_mask), before["long"])
    f = math.log(24 / PIVOT)
    with torch.no_grad():
        for g, m in zip(gated.cross_attention_modules(), folded.cross_attention_modules()):
            m.token_gate.weight += f * g.long_gate.weight
            m.token_gate.bias += f * g.long_gate.bias
            m.match_gate[:, :2] += f * g.long_match
    torch.testing.assert_close(
        _logits(gated, enc_ids, long_mask), _logits(folded, enc_ids, long_mask), rtol=1e-4, atol=1e-5
    )


def test_long_gates_train_save_load_and_need_a_pivot(tmp_path):
    enc_ids, long_mask, _ = _masks()
    model = _long_model(long=True).train()
    model(_ids(), encoder_input_ids=enc_ids, encoder_attention_mask=long_mask, labels=_ids()).loss.backward()
    grads = [p.grad for m in model.cross_attention_modules() for p in (m.long_gate.weight, m.long_match)]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    model.eval().save_pretrained(tmp_path)
    loaded = CepeForCausalLM.from_pretrained(tmp_path, decoder=tiny_decoder()).eval()
    assert loaded.cepe_config.long_gate
    assert torch.equal(_logits(loaded, enc_ids, long_mask), _logits(model, enc_ids, long_mask))
    bare = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(length_scale=PIVOT, long_gate=True))
    assert bare.cross_attention_modules()[0].long_match is None
    bare.enable_match_gate()  # the long gates gain their match weights, zero
    assert all(not m.long_match.any() for m in bare.cross_attention_modules())
    with pytest.raises(ValueError, match="long_gate needs length_scale"):
        tiny_cepe_config(long_gate=True)
    with pytest.raises(ValueError, match="enable_length_scale first"):
        CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config()).enable_long_gate()
