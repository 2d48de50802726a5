"""scripts/topk_probe.py: top-k cross-attention is plain attention when k covers every key, reads only the
best key at k = 1, and reaches a model's cross-attention (and nothing else) once installed."""

from __future__ import annotations

import torch
from conftest import ids_of, load_script, random_context

import cepe.cross_attention as ca
from cepe.layers import attention_ref


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 5, 8, generator=g)
    k = torch.randn(2, 2, 11, 8, generator=g)
    v = torch.randn(2, 2, 11, 8, generator=g)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, 7:] = False
    return q, k, v, mask


def test_topk_covering_every_key_is_plain_attention():
    mod = load_script("topk_probe")
    q, k, v, mask = _inputs()
    bias = torch.randn(2, 4, 5, 11, generator=torch.Generator().manual_seed(3))
    for kk in (11, 50):
        torch.testing.assert_close(
            mod.topk_attention(q, k, v, mask, 0.3, topk=kk), attention_ref(q, k, v, mask, 0.3)
        )
        torch.testing.assert_close(
            mod.topk_attention(q, k, v, mask, 0.3, bias, topk=kk), attention_ref(q, k, v, mask, 0.3, bias)
        )


def test_topk_one_reads_the_best_unmasked_key_and_fewer_keys_change_the_read():
    mod = load_script("topk_probe")
    q, k, v, mask = _inputs(1)
    out = mod.topk_attention(q, k, v, mask, 0.3, topk=1)
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # head h reads KV head h // 2
    scores = (q @ kr.transpose(-1, -2)).masked_fill(~mask[:, None, None, :], float("-inf"))
    best = scores.argmax(-1)  # (N, H, T)
    want = torch.gather(vr, 2, best[..., None].expand(-1, -1, -1, 8))
    torch.testing.assert_close(out, want)
    assert (
        mod.topk_attention(q, k, v, mask, 0.3, topk=3) - attention_ref(q, k, v, mask, 0.3)
    ).abs().max() > 1e-3


def test_install_changes_the_cross_attention_only(tiny_model, monkeypatch):
    mod = load_script("topk_probe")
    monkeypatch.setattr(ca, "ATTENTION_KERNELS", ca.ATTENTION_KERNELS)  # restored after the test
    monkeypatch.setattr(ca.CrossAttention, "attend_run", ca.CrossAttention.attend_run)
    ids = ids_of()
    enc_ids, enc_mask = random_context(2, 3)
    with torch.no_grad():
        before = tiny_model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        plain = tiny_model(ids).logits
        mod.install(1000)  # more keys than the context has: the same function
        torch.testing.assert_close(
            tiny_model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits, before
        )
        mod.install(1)
        one = tiny_model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        assert (one - before).abs().max() > 1e-3
        assert torch.equal(tiny_model(ids).logits, plain)  # no context: the decoder, untouched
