"""Each supported decoder family wrapped: cross-attention initialised from a layer's self-attention computes
that self-attention (its scale and per-head norms included); the model is exactly the decoder without
context or with zero ``o_proj``, at prefill and in cached decoding, with and without padding."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, random_context, randomize_cross, tiny_cepe_config, tiny_decoder

from cepe import CepeConfig, CepeForCausalLM, EncoderConfig
from cepe.cross_attention import CrossContext
from cepe.wrapping import decoder_layers

# decoder families without attention biases (Qwen 2's q/k/v biases are not part of the cross-attention)
COPYABLE = {
    "llama": {},
    "mistral": {},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3": {},
    "gemma": {"head_dim": 16},
    # query_pre_attn_scalar differs from head_dim, as in the 27B models (144 and 168 for head_dim 128)
    "gemma2": {"query_pre_attn_scalar": 24, "attn_logit_softcapping": None},
    "gemma3_text": {"query_pre_attn_scalar": 24},
}


@pytest.mark.parametrize("family", sorted(COPYABLE))
def test_copied_cross_attention_is_the_self_attention(family):
    """With q/k/v/o copied (``init_mode="copy"``) and Φ the very states its query reads, cross-attention is
    the layer's self-attention without RoPE and without a causal mask."""
    dec = tiny_decoder(family, **COPYABLE[family])
    dec.config._attn_implementation = "eager"  # no mask given: every key, as cross-attention reads
    with torch.no_grad():
        for layer in decoder_layers(dec):
            for name in ("q_norm", "k_norm"):
                if getattr(layer.self_attn, name, None) is not None:
                    getattr(layer.self_attn, name).weight.uniform_(0.5, 1.5)
    enc = EncoderConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4)
    model = CepeForCausalLM.from_decoder(
        dec, CepeConfig(encoder=enc, chunk_length=8, init_mode="copy")
    ).eval()
    h = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
    no_rope = (torch.ones(2, 5, 16), torch.zeros(2, 5, 16))
    for layer in decoder_layers(model.decoder):
        cross = layer.cross_attn
        with torch.no_grad():
            x = cross.layernorm(h)
            ref, _ = layer.self_attn(hidden_states=x, position_embeddings=no_rope, attention_mask=None)
            out = cross(h, CrossContext(states=x, mode="states", impl="eager"))
        torch.testing.assert_close(out, ref, atol=1e-9, rtol=1e-4)


# every family, with sliding-window layers shorter than the sequence where the family has them
WINDOWED = {
    "llama": {},
    "mistral": {"sliding_window": 4},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4},
    "qwen2": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    "qwen3": {},
    "gemma": {"head_dim": 16},
    "gemma2": {"sliding_window": 4},
    "gemma3_text": {
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
}


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_no_context_or_zero_o_proj_is_the_decoder_when_decoding(family):
    """Exactly the decoder's logits (fp32): without context (cross-attention random) and with context but
    every ``o_proj`` zero, at prefill and token by token on the cache, with and without left padding."""
    dec = tiny_decoder(family, **WINDOWED[family])
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    pad = torch.ones(2, 10, dtype=torch.long)
    pad[0, :3] = 0
    enc_ids, enc_mask = random_context(2, 3)
    enc_mask[1, 2] = False
    for context in (False, True):
        model = CepeForCausalLM.from_decoder(
            tiny_decoder(family, **WINDOWED[family]), tiny_cepe_config()
        ).eval()
        if context:
            ctx = model.prepare_context(enc_ids, enc_mask)
            assert ctx is not None and all(not m.o_proj.weight.any() for m in model.cross_attention_modules())
        else:
            randomize_cross(model)
            ctx = None
        for mask in (None, pad):
            with torch.no_grad():
                kw = {} if mask is None else {"attention_mask": mask[:, :6]}
                ref = dec(ids[:, :6], use_cache=True, **kw)
                out = model(ids[:, :6], use_cache=True, cross_context=ctx, **kw)
                assert torch.equal(out.logits, ref.logits)
                for t in range(6, 10):
                    kw = {} if mask is None else {"attention_mask": mask[:, : t + 1]}
                    ref = dec(ids[:, t : t + 1], past_key_values=ref.past_key_values, use_cache=True, **kw)
                    out = model(
                        ids[:, t : t + 1],
                        past_key_values=out.past_key_values,
                        cross_context=ctx,
                        use_cache=True,
                        **kw,
                    )
                    assert torch.equal(out.logits, ref.logits)
