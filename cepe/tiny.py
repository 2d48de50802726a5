"""Tiny random models, built in one place: the ``--model tiny`` of ``cepe eval`` / ``bench`` / ``context`` /
``serve``, the ``tiny_decoder`` of a training config, and the tests' decoders.

- :func:`random_decoder`: a random decoder of any family from config fields (seeded, eval mode);
- :func:`tiny_decoder`: the 2-layer byte-vocabulary Llama that goes with :class:`ByteTokenizer`;
- :func:`tiny_cepe`: an untrained CEPE model with a 1-layer encoder around a decoder;
- :func:`tiny_model`: the deterministic tiny CEPE model + byte tokenizer (same weights in every process).

The tokenizer maps UTF-8 bytes to ids 0..255 and adds ``<pad>`` 256, ``<s>`` 257, ``</s>`` 258, so any
text round-trips without training a vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ByteTokenizer:
    """Minimal tokenizer interface used by the evaluation tasks (``encode``/``decode``, special ids)."""

    pad_token_id = 256
    bos_token_id = 257
    eos_token_id = 258
    vocab_size = 259
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytes(int(i) for i in ids if int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def __call__(self, texts: str | list[str], add_special_tokens: bool = False) -> dict[str, list]:
        if isinstance(texts, str):
            return {"input_ids": self.encode(texts, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in texts]}


def random_decoder(family: str = "llama", seed: int = 0, **config: Any):
    """A randomly initialised decoder of ``family`` (a transformers ``model_type``) with the given config
    fields, in eval mode; ``torch.manual_seed(seed)`` right before the weights are drawn."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**config)).eval()
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **config)).eval()


def tiny_decoder(seed: int = 0, vocab_size: int = 259, max_positions: int = 4096):
    """A 2-layer random ``LlamaForCausalLM`` (hidden 32, 4 heads, 2 KV heads) in eval mode, with the
    special ids of :class:`ByteTokenizer`."""
    return random_decoder(
        "llama",
        seed,
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        pad_token_id=ByteTokenizer.pad_token_id,
        bos_token_id=ByteTokenizer.bos_token_id,
        eos_token_id=ByteTokenizer.eos_token_id,
    )


def tiny_cepe(decoder, chunk_length: int = 64):
    """An untrained CEPE model around ``decoder`` with a tiny encoder (smoke runs and tests)."""
    from cepe.config import CepeConfig, EncoderConfig
    from cepe.modeling import CepeForCausalLM

    enc = EncoderConfig(
        vocab_size=decoder.config.vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    return CepeForCausalLM.from_decoder(decoder, CepeConfig(encoder=enc, chunk_length=chunk_length)).eval()


def tiny_model(chunk_length: int = 16, seed: int = 0):
    """A deterministic tiny random CEPE model and byte tokenizer (same weights in every process).

    Returns:
        ``(model, tokenizer)``; cross-attention has non-zero weights so the context changes the output;
        generation runs to ``max_new_tokens`` (no end-of-sequence stop).
    """
    import torch

    decoder = tiny_decoder(seed=seed)
    torch.manual_seed(seed + 1)
    model = tiny_cepe(decoder, chunk_length=chunk_length)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for m in model.cross_attention_modules():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    # Never stops at end-of-sequence: a request's length is exactly its max_tokens (bounded, repeatable).
    model.decoder.generation_config.eos_token_id = None
    return model, ByteTokenizer()
