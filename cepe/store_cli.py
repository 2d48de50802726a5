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
from dataclasses import asdict, replace
from typing import Any

from .configio import add_config_flags, add_const_flag, config_from_args
from .serve_config import LOOPBACK, SERVE_LIMIT_FLAGS, AskConfig, ContextAddConfig, ServeConfig, StoreConfig


def _open(cfg: StoreConfig | ContextAddConfig | AskConfig, with_model: bool):
    from .store import ContextStore

    if not with_model:
        return ContextStore(cfg.store)
    from .generation import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(cfg.model)
    return ContextStore(cfg.store, model, tok, dtype=getattr(cfg, "dtype", "bf16"))


def _cmd_add(args: argparse.Namespace) -> int:
    store = _open(config_from_args(ContextAddConfig, args, "context add config"), with_model=True)
    store.add_paths(args.paths, log=print)
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    cfg = config_from_args(StoreConfig, args, "context list config")
    rows = _open(cfg, with_model=False).list()
    if cfg.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        if "error" in r:
            print(f"{r['id']}  ERROR {r['error']}")
        else:
            print(f"{r['id']}  {r['n_tokens']:>8} tokens  {r['file_bytes'] / 2**20:8.2f} MiB  {r['name']}")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    store = _open(config_from_args(StoreConfig, args, "context show config"), with_model=False)
    print(json.dumps(store.show(args.id), indent=2))
    return 0


def _cmd_rm(args: argparse.Namespace) -> int:
    store = _open(config_from_args(StoreConfig, args, "context rm config"), with_model=False)
    for cid in args.ids:
        store.remove(cid)
        print(f"removed {cid}")
    return 0


def ask_question(cfg: AskConfig, question: str) -> dict[str, Any]:
    """``cepe ask``: :func:`cepe.store.ask` with the model and store of ``cfg``."""
    from .store import ask

    store = _open(cfg, with_model=True)
    return ask(
        store.model,
        store.tokenizer,
        store,
        question,
        cfg.context_ids(),
        max_new_tokens=cfg.max_new_tokens,
        budget_tokens=cfg.budget,
        retriever=cfg.retriever,
        cross_attention_cache=cfg.cache,
    )


def _cmd_ask(args: argparse.Namespace) -> int:
    cfg = config_from_args(AskConfig, args, "ask config")
    out = ask_question(cfg, args.question)
    if cfg.json:
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
    add_config_flags(a, ContextAddConfig)
    a.set_defaults(func=_cmd_add)
    a = csub.add_parser("list", help="the stored contexts")
    add_config_flags(a, StoreConfig)
    a.set_defaults(func=_cmd_list)
    a = csub.add_parser("show", help="metadata of one stored context")
    a.add_argument("id")
    add_config_flags(a, StoreConfig, exclude=["json"])
    a.set_defaults(func=_cmd_show)
    a = csub.add_parser("rm", help="remove stored contexts")
    a.add_argument("ids", nargs="+", metavar="ID")
    add_config_flags(a, StoreConfig, exclude=["json"])
    a.set_defaults(func=_cmd_rm)

    p = sub.add_parser("ask", help="answer a question from stored contexts (no re-encoding)")
    p.add_argument("question")
    add_config_flags(p, AskConfig)
    p.set_defaults(func=_cmd_ask)
    register_serve(sub)


def run_server(cfg: ServeConfig, api_key: str | None = None) -> None:
    """``cepe serve``: load ``cfg.model``, open the store and run :func:`cepe.server.serve` until SIGTERM.

    Raises:
        ValueError: the serve extra is not installed, a negative ``threads``, a ``port`` outside 0..65535,
            or a non-loopback ``host`` without ``api_key`` and without ``allow_no_auth`` (checked before the
            model loads).
    """
    if cfg.threads < 0:
        raise ValueError(f"--threads must be 0 (torch's default) or more, got {cfg.threads}")
    if not 0 <= cfg.port <= 65535:
        raise ValueError(f"--port must be a TCP port in 0..65535, got {cfg.port}")
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

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    limits = replace(
        cfg.limits, default_new_tokens=min(cfg.limits.default_new_tokens, cfg.limits.max_new_tokens)
    )
    if cfg.host not in LOOPBACK and not api_key and not cfg.allow_no_auth:
        raise ValueError(
            f"--host {cfg.host} is reachable from other machines: set CEPE_API_KEY to require a bearer token "
            "(or pass --no-auth to serve without one)"
        )
    from .generation import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(cfg.model)
    store = ContextStore(cfg.store, model, tok, dtype=cfg.dtype)
    name = cfg.model_name or os.path.basename(os.path.normpath(cfg.model))
    print(f"cepe serve: {name} on http://{cfg.host}:{cfg.port} (limits {asdict(limits)})", file=sys.stderr)
    serve(model, tok, store, cfg.host, cfg.port, limits, api_key, cfg.allow_no_auth, name, cfg.log_level)


def _cmd_serve(args: argparse.Namespace) -> int:
    run_server(config_from_args(ServeConfig, args, "serve config"), os.environ.get("CEPE_API_KEY") or None)
    return 0


def register_serve(sub: argparse._SubParsersAction) -> None:
    """Add ``serve`` to the ``cepe`` command."""
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server over a context store",
        description="Serve a model over a context store (CEPE_API_KEY: the bearer token clients must send). "
        "Every ServeConfig field is a flag (or a --config key); the limits also have short flags.",
    )
    add_config_flags(
        p,
        ServeConfig,
        aliases=SERVE_LIMIT_FLAGS,
        config_file="ServeConfig fields, YAML or JSON (limits under limits:); the flags below override it",
    )
    add_const_flag(p, "--no-auth", "allow_no_auth", True, help="= --allow-no-auth")
    p.set_defaults(func=_cmd_serve)
