"""Evaluation baselines and metrics against their definitions (tiny random models, fp32, CPU)."""

import pytest
import torch

from cepe.eval.methods import Request
from cepe.eval.streaming import StreamingLLM
from cepe.tiny import random_decoder

SHAPE = dict(
    vocab_size=259,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


def _ids(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


@pytest.mark.parametrize("stride", [1, 8])
def test_streaming_on_a_sliding_window_decoder_equals_the_same_weights_without_one(stride):
    """A Mistral decoder whose sliding window (4096) covers the text computes exactly what a Llama decoder
    with its weights computes, so StreamingLLM must give both the same scores and tokens. A cache built from
    the Mistral config held sliding-window layers, whose length counts every token ever given: after the first
    eviction the next tokens took text positions and the next eviction shifted by the wrong amount (stride 1)
    or the attention mask no longer matched the keys (a larger stride raised)."""
    mistral = random_decoder("mistral", 0, **SHAPE)
    llama = random_decoder("llama", 0, **SHAPE)
    llama.load_state_dict(mistral.state_dict())
    ids = _ids(60)
    opts = dict(sink_tokens=2, recent_tokens=10, stride=stride)
    req = Request(ids, num_targets=40)
    got = StreamingLLM(mistral, **opts).score([req])[0]
    want = StreamingLLM(llama, **opts).score([req])[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    gen = Request(ids, max_new_tokens=6)
    assert StreamingLLM(mistral, **opts).generate(gen) == StreamingLLM(llama, **opts).generate(gen)
