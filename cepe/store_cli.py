"""``cepe context add | list | show | rm`` and ``cepe ask``: the context store on the command line.

``--model`` takes what ``cepe generate`` takes (an adapter directory, a released checkpoint, a decoder) or
``tiny``: a small random model with a byte tokenizer, built the same way in every process (tests and
smoke runs).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from .store import ContextStore, ask


def tiny_model(chunk_length: int = 16, seed: int = 0):
    """A deterministic tiny random CEPE model and byte tokenizer (same weights in every process).

    Returns:
        ``(model, tokenizer)``; cross-attention has non-zero weights so the context changes the output;
        generation runs to ``max_new_tokens`` (no end-of-sequence stop).
    """
    from .eval.cli import tiny_cepe
    from .eval.testing import ByteTokenizer, tiny_decoder

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


def load_model_and_tokenizer(name: str, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` for ``--model`` (see the module docstring), the model in ``dtype``."""
    if name == "tiny":
        model, tok = tiny_model()
        return model.to(dtype), tok
    from .commands import load_model

    model, tok, fresh = load_model(name, dtype=dtype)
    if fresh:
        print("note: untrained CEPE encoder (no adapter given): the context cannot help yet", file=sys.stderr)
    return model, tok


def _open(args: argparse.Namespace, with_model: bool) -> ContextStore:
    if not with_model:
        return ContextStore(args.store)
    model, tok = load_model_and_tokenizer(args.model)
    return ContextStore(args.store, model, tok, dtype=getattr(args, "dtype", "bf16"))


def _cmd_add(args: argparse.Namespace) -> int:
    store = _open(args, with_model=True)
    store.add_paths(args.paths, log=print)
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    rows = ContextStore(args.store).list()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        if "error" in r:
            print(f"{r['id']}  ERROR {r['error']}")
        else:
            print(f"{r['id']}  {r['n_tokens']:>8} tokens  {r['file_bytes'] / 2**20:8.2f} MiB  {r['name']}")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    print(json.dumps(ContextStore(args.store).show(args.id), indent=2))
    return 0


def _cmd_rm(args: argparse.Namespace) -> int:
    store = ContextStore(args.store)
    for cid in args.ids:
        store.remove(cid)
        print(f"removed {cid}")
    return 0


def _cmd_ask(args: argparse.Namespace) -> int:
    store = _open(args, with_model=True)
    ids = [i.strip() for i in args.context.split(",") if i.strip()]
    out = ask(
        store.model,
        store.tokenizer,
        store,
        args.question,
        ids,
        max_new_tokens=args.max_new_tokens,
        budget_tokens=args.budget,
        retriever=args.retriever,
        cross_attention_cache=args.cache,
    )
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(out["answer"])
        ctx = out["context"]
        used = ", ".join(
            f"{cid}: {sum(b - a for a, b in rs)} chunks" for cid, rs in ctx["chunks_used"].items()
        )
        how = f"selected by {ctx['retriever']}" if ctx["retrieved"] else "all chunks"
        print(
            f"[context: {ctx['context_tokens']} of {ctx['total_tokens']} tokens, {how}; {used}]",
            file=sys.stderr,
        )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``context`` (``add``, ``list``, ``show``, ``rm``) and ``ask`` to the ``cepe`` command."""
    p = sub.add_parser("context", help="encode documents once into a context store; list / show / remove")
    csub = p.add_subparsers(dest="context_command", metavar="ACTION", required=True)
    a = csub.add_parser("add", help="tokenize, chunk, encode and store files (directories: every text file)")
    a.add_argument("paths", nargs="+", metavar="FILE|DIR")
    a.add_argument("--store", required=True, help="store directory (created if missing)")
    a.add_argument("--model", default="default", help="CEPE adapter dir (as for `cepe generate`) or 'tiny'")
    a.add_argument(
        "--dtype", choices=["bf16", "fp32", "fp16"], default="bf16", help="storage dtype of a new store"
    )
    a.set_defaults(func=_cmd_add)
    a = csub.add_parser("list", help="the stored contexts")
    a.add_argument("--store", required=True)
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=_cmd_list)
    a = csub.add_parser("show", help="metadata of one stored context")
    a.add_argument("id")
    a.add_argument("--store", required=True)
    a.set_defaults(func=_cmd_show)
    a = csub.add_parser("rm", help="remove stored contexts")
    a.add_argument("ids", nargs="+", metavar="ID")
    a.add_argument("--store", required=True)
    a.set_defaults(func=_cmd_rm)

    p = sub.add_parser("ask", help="answer a question from stored contexts (no re-encoding)")
    p.add_argument("question")
    p.add_argument("--store", required=True)
    p.add_argument("--context", required=True, help="context id(s), comma-separated")
    p.add_argument("--model", default="default", help="the model that wrote the store")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=None, help="attend to at most this many context tokens")
    p.add_argument(
        "--retriever", choices=["bm25", "dense"], default="bm25", help="chunk selection over budget"
    )
    p.add_argument("--cache", choices=["kv", "states", "absorbed"], default=None)
    p.add_argument("--json", action="store_true", help="answer and context metadata as JSON")
    p.set_defaults(func=_cmd_ask)
