"""Agreement of the performance paths in the core with their reference paths."""

from __future__ import annotations

import torch

from cepe.config import EncoderConfig
from cepe.encoder import ContextEncoder


def test_in_place_chunk_encoding_matches_reference():
    torch.manual_seed(0)
    cfg = EncoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
    enc = ContextEncoder(cfg).eval()
    ids = torch.randint(0, 50, (2, 5, 8))
    mask = torch.ones(2, 5, 8, dtype=torch.bool)
    mask[0, 3:] = False  # two all-padding chunks (skipped)
    mask[1, 4, 5:] = False  # a partly padded chunk
    with torch.no_grad():
        ref, ref_mask = enc.encode_chunks(ids, mask, micro_batch=3, in_place=False)
        fast, fast_mask = enc.encode_chunks(ids, mask, micro_batch=3, in_place=True)
    torch.testing.assert_close(fast, ref, rtol=0, atol=0)
    assert torch.equal(fast_mask, ref_mask)
    assert fast[0, 3 * 8 :].abs().sum() == 0 and fast[1, 4 * 8 + 5 :].abs().sum() == 0
    # default: in place without autograd, reference path (differentiable) with it
    with torch.inference_mode():
        inf, _ = enc.encode_chunks(ids, mask, micro_batch=3)
    torch.testing.assert_close(inf, ref, rtol=0, atol=0)
    states, _ = enc.encode_chunks(ids, mask, micro_batch=3)
    states.sum().backward()
    assert enc.embed_tokens.weight.grad is not None
