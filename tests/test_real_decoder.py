"""A few checks on the real default decoder (SmolLM2-135M-Instruct from its package)."""

from __future__ import annotations

import pytest
import torch

from cepe import CepeForCausalLM
from cepe.chunking import chunk_ids

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real():
    from cepe.assets import load_decoder

    decoder, tok = load_decoder("default")
    return CepeForCausalLM.from_decoder(decoder).eval(), tok


def test_real_decoder_shape_and_trainable_set(real):
    model, tok = real
    assert model.decoder.config.num_hidden_layers == 30 and model.decoder.config.vocab_size == len(tok)
    assert model.cross_layers == list(range(30))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(n.startswith("encoder.") or ".cross_attn." in n for n in names)


def test_real_zero_init_is_exactly_the_decoder(real):
    model, tok = real
    text = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
    ids = torch.tensor([tok(text)["input_ids"]])
    chunks, mask = chunk_ids(tok(text * 5)["input_ids"], 16)
    from cepe.assets import load_decoder_model

    plain_decoder = load_decoder_model("default")  # a separate, unhooked copy of the decoder
    assert not any(".cross_attn." in n for n, _ in plain_decoder.named_parameters())
    with torch.no_grad():
        ref = plain_decoder(ids).logits
        no_ctx = model(ids).logits
        out = model(ids, encoder_input_ids=chunks[None], encoder_attention_mask=mask[None]).logits
    assert torch.equal(no_ctx, ref) and torch.equal(out, ref)
