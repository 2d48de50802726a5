"""scripts/contrast_probe.py: context-aware greedy decoding through ``generate`` equals a plain loop of
whole forward passes, is greedy CEPE at alpha 0 or without context, and changes answers where the context
and the decoder alone disagree."""

from __future__ import annotations

import torch
from conftest import load_script

from cepe.eval.methods import CepeMethod, Request


def _method(model) -> CepeMethod:
    return CepeMethod(model, chunk_length=8, eos_token_id=None, pad_token_id=0)


def _request(context: bool = True) -> Request:
    g = torch.Generator().manual_seed(4)
    pieces = [torch.randint(1, 60, (20,), generator=g).tolist()] if context else []
    return Request(
        input_ids=torch.randint(1, 60, (7,), generator=g).tolist(), context=pieces, max_new_tokens=6
    )


def _reference(method: CepeMethod, r: Request, alpha: float, plausibility: float) -> list[int]:
    """The same rule, one whole forward pass with and one without the context per new token."""
    ids = list(r.input_ids)
    enc_ids, enc_mask = method.encoder_inputs([r])
    with torch.no_grad():
        for _ in range(r.max_new_tokens):
            x = torch.tensor([ids])
            lc = torch.log_softmax(
                method.model(x, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits[0, -1], -1
            )
            l0 = torch.log_softmax(method.model(x).logits[0, -1], -1)
            mixed = ((1 + alpha) * lc - alpha * l0).masked_fill(
                lc < lc.max() + torch.log(torch.tensor(plausibility)), -1e9
            )
            ids.append(int(mixed.argmax()))
    return ids[len(r.input_ids) :]


def test_contrast_matches_a_plain_loop_and_is_greedy_at_alpha_zero(tiny_model, monkeypatch):
    mod = load_script("contrast_probe")
    monkeypatch.setattr(CepeMethod, "_call_generate", CepeMethod._call_generate)  # restored after the test
    method, r = _method(tiny_model), _request()
    greedy = method.generate(r)
    mod.install(0.0, 1e-9)
    assert method.generate(r) == greedy
    answers = {}
    for alpha in (1.0, 3.0):
        mod.install(alpha, 0.01)
        answers[alpha] = method.generate(r)
        assert answers[alpha] == _reference(method, r, alpha, 0.01)
    assert any(a != greedy for a in answers.values())  # the rule acts on this model and context


def test_without_context_the_contrast_changes_nothing(tiny_model, monkeypatch):
    mod = load_script("contrast_probe")
    monkeypatch.setattr(CepeMethod, "_call_generate", CepeMethod._call_generate)
    method, r = _method(tiny_model), _request(context=False)
    greedy = method.generate(r)
    mod.install(3.0, 1e-9)
    assert method.generate(r) == greedy
