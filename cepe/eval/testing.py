"""Tiny random decoder and byte-level tokenizer for smoke runs and tests (``--model tiny``).

The tokenizer maps UTF-8 bytes to ids 0..255 and adds ``<pad>`` 256, ``<s>`` 257, ``</s>`` 258, so any
text round-trips without training a vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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


def tiny_decoder(seed: int = 0, vocab_size: int = 259, max_positions: int = 4096):
    """A 2-layer random ``LlamaForCausalLM`` (hidden 32, 4 heads, 2 KV heads) in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
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
    return LlamaForCausalLM(cfg).eval()
