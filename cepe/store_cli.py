"""``cepe context add | list | show | rm``, ``cepe ask`` and ``cepe serve``: the context store on the command
line (the server itself is :mod:`cepe.server`).

``--model`` takes what ``cepe generate`` takes (an adapter directory, a released checkpoint, a decoder) or
``tiny``: a small random model with a byte tokenizer, built the same way in every process (tests and
smoke runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from .serve_config import LOOPBACK, ServeLimits


def _open(args: argparse.Namespace, with_model: bool):
    from .store import ContextStore

    if not with_model:
        return ContextStore(args.store)
    from .generation import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(args.model)
    return ContextStore(args.store, model, tok, dtype=getattr(args, "dtype", "bf16"))


def _cmd_add(args: argparse.Namespace) -> int:
    store = _open(args, with_model=True)
    store.add_paths(args.paths, log=print)
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    rows = _open(args, with_model=False).list()
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
    print(json.dumps(_open(args, with_model=False).show(args.id), indent=2))
    return 0


def _cmd_rm(args: argparse.Namespace) -> int:
    store = _open(args, with_model=False)
    for cid in args.ids:
        store.remove(cid)
        print(f"removed {cid}")
    return 0


def _cmd_ask(args: argparse.Namespace) -> int:
    from .store import ask

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
    """Add ``context`` (``add``, ``list``, ``show``, ``rm``), ``ask`` and ``serve`` to the ``cepe`` command."""
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
    register_serve(sub)


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise ValueError(
            f"`cepe serve` needs the serve extra ({err.name} missing): pip install 'cepe[serve]'"
        ) from err
    import torch

    from .server import serve
    from .store import ContextStore

    if args.threads:
        torch.set_num_threads(args.threads)
    limits = ServeLimits(
        max_queue=args.max_queue,
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens,
        default_new_tokens=min(args.default_new_tokens, args.max_new_tokens),
        max_upload_bytes=args.max_upload_bytes,
        max_context_tokens=args.max_context_tokens,
        request_timeout_s=args.timeout,
        shutdown_grace_s=args.shutdown_grace,
    )
    api_key = os.environ.get("CEPE_API_KEY") or None
    if args.host not in LOOPBACK and not api_key and not args.no_auth:
        raise ValueError(
            f"--host {args.host} is reachable from other machines: set CEPE_API_KEY to require a bearer token "
            "(or pass --no-auth to serve without one)"
        )
    from .generation import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(args.model)
    store = ContextStore(args.store, model, tok, dtype=args.dtype)
    name = args.model_name or os.path.basename(os.path.normpath(args.model))
    print(f"cepe serve: {name} on http://{args.host}:{args.port} (limits {asdict(limits)})", file=sys.stderr)
    serve(model, tok, store, args.host, args.port, limits, api_key, args.no_auth, name, args.log_level)
    return 0


def register_serve(sub: argparse._SubParsersAction) -> None:
    """Add ``serve`` to the ``cepe`` command."""
    d = ServeLimits()
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server over a context store")
    p.add_argument("--model", default="default", help="CEPE adapter dir (as for `cepe generate`) or 'tiny'")
    p.add_argument("--store", required=True, help="context store directory (created if missing)")
    p.add_argument(
        "--dtype", choices=["bf16", "fp32", "fp16"], default="bf16", help="storage dtype of a new store"
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--no-auth", action="store_true", help="allow a non-loopback host without CEPE_API_KEY")
    p.add_argument("--model-name", default=None, help="model id reported to clients")
    p.add_argument("--max-queue", type=int, default=d.max_queue)
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--default-new-tokens", type=int, default=d.default_new_tokens)
    p.add_argument("--max-upload-bytes", type=int, default=d.max_upload_bytes)
    p.add_argument("--max-context-tokens", type=int, default=d.max_context_tokens)
    p.add_argument("--timeout", type=float, default=d.request_timeout_s, help="seconds per request")
    p.add_argument("--shutdown-grace", type=float, default=d.shutdown_grace_s)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(func=_cmd_serve)
