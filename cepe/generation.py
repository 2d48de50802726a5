"""Loading a CEPE model by name and answering a prompt about a long context (the library behind
``cepe generate``, ``cepe ask`` and the main job's generation demo)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from .chunking import chunk_ids

# The seed of a fresh (untrained) CEPE encoder and cross-attention built around a plain decoder by
# :func:`load_model`: every process builds the same weights, so a context store written by one
# ``cepe context add --model <decoder>`` is readable by the next ``cepe ask`` / ``cepe serve`` (the store
# checks the adapter's fingerprint, which hashes those weights).
FRESH_ENCODER_SEED = 0


def load_model(model: str, dtype: torch.dtype = torch.float32):
    """Load a CEPE model: an adapter / released directory, or a plain decoder name (fresh encoder).

    A fresh encoder is initialised from :data:`FRESH_ENCODER_SEED` (the caller's global torch RNG is
    neither read nor advanced), so it is the same in every process and a context store written with it
    can be read again.

    Returns:
        ``(model, tokenizer, fresh)`` where ``fresh`` is True when the encoder is untrained.
    """
    from .assets import load_tokenizer
    from .modeling import ADAPTER_CONFIG, CepeForCausalLM

    path = Path(model)
    if (path / ADAPTER_CONFIG).exists() or (path / "config.json").exists() and _is_released(path):
        m = CepeForCausalLM.from_pretrained(path, dtype=dtype)
        tok_source = m.cepe_config.decoder_name_or_path or str(path)
        return m.eval(), load_tokenizer(tok_source), False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(FRESH_ENCODER_SEED)
        m = CepeForCausalLM.from_decoder(model, dtype=dtype)
    return m.eval(), load_tokenizer(model), True


def load_model_and_tokenizer(name: str, dtype=None):
    """``(model, tokenizer)`` for a ``--model`` argument: what :func:`load_model` takes, or ``tiny`` (the
    deterministic tiny model of :func:`cepe.tiny.tiny_model`); the model in ``dtype`` (default fp32). Says
    on stderr when the encoder is untrained."""
    dtype = torch.float32 if dtype is None else dtype
    if name == "tiny":
        from .tiny import tiny_model

        model, tok = tiny_model()
        return model.to(dtype), tok
    model, tok, fresh = load_model(name, dtype=dtype)
    if fresh:
        print("note: untrained CEPE encoder (no adapter given): the context cannot help yet", file=sys.stderr)
    return model, tok


def _is_released(path: Path) -> bool:
    with open(path / "config.json") as f:
        return "encoder_config" in json.load(f)


def _plain_prompt_ids(tokenizer, prompt: str, dec_ctx: list[int]) -> list[int]:
    """The decoder's input without a chat template: ``dec_ctx`` (context tokens kept in the decoder) then the
    prompt, inside the special tokens that the tokenizer adds by default to a text (``tokenizer(prompt)``,
    as a user would call it: a Llama tokenizer's BOS first; SmolLM2's adds none, the byte tokenizer none by
    default). Empty when both the kept context and the prompt have no tokens."""
    plain = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if not dec_ctx and not plain:
        return []
    full = list(tokenizer(prompt)["input_ids"])  # the tokenizer's default: its special tokens around the text
    n = len(plain)
    at = next((i for i in range(len(full) - n + 1) if full[i : i + n] == plain), None)
    if at is None:  # the special tokens are not around the text (a tokenizer that merges them): as it gives
        return list(dec_ctx) + full
    return full[:at] + list(dec_ctx) + plain + full[at + n :]


def generate_from_context(
    model,
    tokenizer,
    context: str,
    prompt: str,
    max_new_tokens: int = 64,
    decoder_tokens: int | None = None,
    cross_attention_cache: str | None = None,
    chat: bool = True,
) -> str:
    """Answer ``prompt`` about a long ``context``: the context goes to the encoder in chunks of
    ``chunk_length`` tokens, except its last ``decoder_tokens`` tokens, which stay in the decoder.
    ``chat``: the decoder reads the kept tokens and the prompt as a user turn of the tokenizer's chat
    template (when it has one); otherwise as plain text inside the special tokens the tokenizer adds by
    default (a Llama tokenizer's BOS first).

    Returns:
        The generated text (greedy decoding).
    """
    if decoder_tokens is not None and decoder_tokens < 0:
        raise ValueError(
            f"decoder_tokens must be 0 or more (context tokens kept in the decoder), got {decoder_tokens}"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    ctx_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    dec_ctx: list[int] = []
    if decoder_tokens:
        ctx_ids, dec_ctx = ctx_ids[:-decoder_tokens], ctx_ids[-decoder_tokens:]
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.decode(dec_ctx) + "\n\n" + prompt if dec_ctx else prompt
        prompt_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(prompt_ids, dict):
            prompt_ids = prompt_ids["input_ids"]
    else:
        prompt_ids = _plain_prompt_ids(tokenizer, prompt, dec_ctx)
    if not len(prompt_ids):
        raise ValueError("the prompt is empty (no tokens): give a question or an instruction")
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    enc_kwargs = {}
    if ctx_ids:
        chunks, mask = chunk_ids(ctx_ids, model.cepe_config.chunk_length, pad_id=tokenizer.pad_token_id or 0)
        enc_kwargs = {
            "encoder_input_ids": chunks[None].to(device),
            "encoder_attention_mask": mask[None].to(device),
        }
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        cross_attention_cache=cross_attention_cache,
        **enc_kwargs,
    )
    return tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True)
