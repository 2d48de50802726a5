"""``cepe eval <task> --model ... --config ...``: run one evaluation task and write JSON, markdown, PNG.

The flags map onto :func:`cepe.eval.api.load_setup` and :func:`cepe.eval.api.run_task` (see there for what
``--model`` accepts). No torch import until the command runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from cepe.eval.tasks import TASKS

DTYPE_NAMES = ("bf16", "fp16", "fp32")


def _run(args: argparse.Namespace) -> int:
    from cepe.configio import apply_overrides, read_config_file
    from cepe.dtypes import torch_dtype
    from cepe.eval.api import load_setup, run_task
    from cepe.eval.report import write_report
    from cepe.measure import cpu_count_note

    config: dict[str, Any] = read_config_file(args.config, allow_empty=True) if args.config else {}
    config = apply_overrides(config, args.set or [], where=args.config or "--set")
    method_options = config.pop("methods", {}) or {}
    run_opts = config.pop("run", {}) or {}
    methods = [
        m.strip() for m in (args.methods or run_opts.get("methods", "truncated")).split(",") if m.strip()
    ]
    device = args.device or _default_device()
    setup = load_setup(
        args.model,
        methods,
        device=device,
        dtype=args.dtype,
        tokenizer=args.tokenizer,
        cepe_init=args.cepe_init,
        method_options=method_options,
        autocast_dtype=torch_dtype(args.autocast) if args.autocast else None,
        batch_size=args.batch_size,
        seed=args.seed,
        limit=args.limit,
        progress=not args.no_progress,
    )
    result = run_task(args.task, setup, config)
    result.update(
        {
            "model": args.model,
            "methods": methods,
            "method_options": method_options,
            "config": config,
            "seed": args.seed,
            "device": cpu_count_note() if device == "cpu" else device,
        }
    )
    paths = write_report(result, args.out, x_key=result.get("plot_x"))
    print(Path(paths["markdown"]).read_text())
    print(json.dumps(paths))
    return 0


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``cepe eval`` to the ``cepe`` command."""
    p = subparsers.add_parser(
        "eval", help="run an evaluation task (lm, ralm, qa, icl, longdoc, needle, ruler)"
    )
    p.add_argument("task", choices=TASKS)
    p.add_argument(
        "--model", default="default", help="CEPE adapter dir, decoder dir / hub id, 'default' or 'tiny'"
    )
    p.add_argument("--config", help="YAML task config (configs/eval/<task>.yaml)")
    p.add_argument("--methods", help="comma list of cepe,full,truncated,streamingllm,replug")
    p.add_argument("--set", action="append", help="override a config key: --set totals=[1024,2048]")
    p.add_argument("--out", default="results/eval", help="output directory")
    p.add_argument("--tokenizer", help="tokenizer dir / hub id (default: the decoder's)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="fp32", help="weights dtype")
    p.add_argument("--autocast", choices=["bf16", "fp16"], help="autocast dtype for the forward passes")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--limit", type=int, help="cap examples per setting (quick runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cepe-init", action="store_true", help="attach an untrained adapter to a plain decoder")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_run)
