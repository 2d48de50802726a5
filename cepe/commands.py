"""Core CLI commands: ``cepe generate`` (answer from a long context) and ``cepe info``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .chunking import chunk_ids


def load_model(model: str, dtype: torch.dtype = torch.float32):
    """Load a CEPE model: an adapter / released directory, or a plain decoder name (fresh encoder).

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
    m = CepeForCausalLM.from_decoder(model, dtype=dtype)
    return m.eval(), load_tokenizer(model), True


def _is_released(path: Path) -> bool:
    with open(path / "config.json") as f:
        return "encoder_config" in json.load(f)


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

    Returns:
        The generated text (greedy decoding).
    """
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
        prompt_ids = dec_ctx + tokenizer(prompt, add_special_tokens=False)["input_ids"]
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    enc_kwargs = {}
    if ctx_ids:
        chunks, mask = chunk_ids(ctx_ids, model.cepe_config.chunk_length, pad_id=tokenizer.pad_token_id or 0)
        enc_kwargs = {"encoder_input_ids": chunks[None], "encoder_attention_mask": mask[None]}
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


def _cmd_generate(args: argparse.Namespace) -> int:
    model, tok, fresh = load_model(args.model)
    if fresh:
        print("note: untrained CEPE encoder (no adapter given): the context cannot help yet", file=sys.stderr)
    context = Path(args.context).read_text() if args.context else ""
    text = generate_from_context(
        model, tok, context, args.prompt, args.max_new_tokens, args.decoder_tokens, args.cache
    )
    print(text)
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    model, _, fresh = load_model(args.model)
    n_train = sum(p.numel() for p in model.trainable_parameters())
    n_all = sum(p.numel() for p in model.parameters())
    info = {
        "decoder": model.cepe_config.decoder_name_or_path,
        "decoder_layers_with_cross_attention": model.cross_layers,
        "encoder": model.cepe_config.encoder.__dict__,
        "chunk_length": model.cepe_config.chunk_length,
        "trainable_parameters": n_train,
        "total_parameters": n_all,
        "untrained_encoder": fresh,
    }
    print(json.dumps(info, indent=2))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from .modeling import CepeForCausalLM

    model = CepeForCausalLM.from_pretrained(args.model)
    if args.decoder_name:
        model.cepe_config.decoder_name_or_path = args.decoder_name
    model.save_pretrained(args.out, quantize=args.quantize)
    size = sum(f.stat().st_size for f in Path(args.out).iterdir() if f.is_file())
    print(f"wrote {args.out} ({size / 2**20:.1f} MiB)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``generate``, ``info`` and ``export`` to the ``cepe`` command."""
    p = sub.add_parser("generate", help="answer a prompt about a long context file")
    p.add_argument("--model", default="default", help="CEPE adapter dir, released checkpoint, or decoder")
    p.add_argument("--context", help="text file whose content goes (mostly) to the encoder")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--decoder-tokens", type=int, default=0, help="last context tokens kept in the decoder")
    p.add_argument("--cache", choices=["kv", "states", "absorbed"], default=None)
    p.set_defaults(func=_cmd_generate)
    p = sub.add_parser("export", help="re-save an adapter (e.g. int8 weight storage for shipping)")
    p.add_argument("--model", required=True, help="CEPE adapter dir")
    p.add_argument("--out", required=True)
    p.add_argument("--quantize", choices=["int8"], default=None)
    p.add_argument("--decoder-name", help="decoder name to record in the config (e.g. 'default')")
    p.set_defaults(func=_cmd_export)
    p = sub.add_parser("info", help="describe a CEPE model")
    p.add_argument("--model", default="default")
    p.set_defaults(func=_cmd_info)
