"""Core CLI commands: ``cepe generate`` (answer from a long context), ``cepe info`` and ``cepe export``
(the library functions are in :mod:`cepe.generation`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _cmd_generate(args: argparse.Namespace) -> int:
    from .generation import generate_from_context, load_model

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
    from .generation import load_model

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
