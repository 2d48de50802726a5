"""``cepe.generation.generate_from_context`` without a chat template: the decoder reads the prompt inside the
special tokens its tokenizer adds by default (a Llama tokenizer's BOS), the kept context tokens after them."""

from __future__ import annotations

import torch

from cepe.generation import generate_from_context
from cepe.tiny import ByteTokenizer, tiny_model


class BosTokenizer(ByteTokenizer):
    """A byte tokenizer that, like a Llama one, adds its BOS by default."""

    def __call__(self, texts, add_special_tokens: bool = True):
        return super().__call__(texts, add_special_tokens)


def _decoder_input(monkeypatch, tok, **kw) -> list[int]:
    model, _ = tiny_model()
    seen = []

    def generate(input_ids, **_):
        seen.append(input_ids[0].tolist())
        return torch.cat([input_ids, input_ids[:, -1:]], dim=1)

    monkeypatch.setattr(model, "generate", generate)
    generate_from_context(
        model, tok, "the context of the question", "Why?", max_new_tokens=1, chat=False, **kw
    )
    return seen[0]


def test_plain_prompt_gets_the_tokenizers_special_tokens(monkeypatch):
    tok = BosTokenizer()
    assert _decoder_input(monkeypatch, tok) == [tok.bos_token_id, *b"Why?"]
    # kept context tokens come after the BOS, before the prompt
    assert _decoder_input(monkeypatch, tok, decoder_tokens=4) == [tok.bos_token_id, *b"tion", *b"Why?"]


def test_a_tokenizer_without_default_special_tokens_is_unchanged(monkeypatch):
    """SmolLM2's tokenizer (and the byte tokenizer) add none by default: the prompt's tokens alone, as before."""
    tok = ByteTokenizer()
    assert _decoder_input(monkeypatch, tok) == list(b"Why?")
    assert _decoder_input(monkeypatch, tok, decoder_tokens=4) == list(b"tionWhy?")
