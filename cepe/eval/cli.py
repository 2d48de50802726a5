"""``cepe eval <task> --model ... --config ...``: run one evaluation task and write JSON, markdown, PNG.

``--model`` is a CEPE adapter directory (``CepeForCausalLM.from_pretrained``), ``default`` / a decoder
directory or hub id (baselines only, unless ``--cepe-init`` attaches an untrained adapter for smoke
runs), or ``tiny`` (a random 2-layer model with a byte tokenizer, for smoke tests).
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

import torch

from cepe.eval.common import EvalSetup, config_from_dict, set_dotted
from cepe.eval.measure import cpu_count_note, seed_everything
from cepe.eval.tasks import TASKS

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _is_cepe_dir(path: Path) -> bool:
    if (path / "cepe_config.json").exists():
        return True
    cfg = path / "config.json"
    if cfg.exists():
        raw = json.loads(cfg.read_text())
        return "encoder_config" in raw or "LlamaForCausalContextLM" in raw.get("architectures", [])
    return False


def tiny_cepe(decoder: torch.nn.Module, chunk_length: int = 64) -> torch.nn.Module:
    """An untrained CEPE model around ``decoder`` with a tiny encoder (smoke runs and tests)."""
    from cepe.config import CepeConfig, EncoderConfig

    enc = EncoderConfig(
        vocab_size=decoder.config.vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    from cepe.modeling import CepeForCausalLM

    return CepeForCausalLM.from_decoder(decoder, CepeConfig(encoder=enc, chunk_length=chunk_length)).eval()


def load_setup(
    model: str,
    methods: list[str],
    device: str = "cpu",
    dtype: str = "fp32",
    tokenizer: str | None = None,
    cepe_init: bool = False,
    **kwargs: Any,
) -> EvalSetup:
    """Load the model bundle for ``--model`` (see the module docstring)."""
    torch_dtype = _DTYPES[dtype]
    cepe_model = None
    path = Path(model)
    if model == "tiny":
        from cepe.eval.testing import ByteTokenizer, tiny_decoder

        tok, decoder = ByteTokenizer(), tiny_decoder()
        if "cepe" in methods:
            cepe_model = tiny_cepe(decoder)
    elif path.is_dir() and _is_cepe_dir(path):
        from cepe.assets import load_tokenizer
        from cepe.modeling import CepeForCausalLM

        cepe_model = CepeForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
        decoder = cepe_model.decoder
        name = tokenizer or cepe_model.cepe_config.decoder_name_or_path
        if not name:
            raise ValueError(f"{path} names no decoder; pass --tokenizer <decoder dir or hub id>")
        tok = load_tokenizer(name)  # also a recorded .gguf file
    else:
        from cepe.assets import load_decoder

        decoder, tok = load_decoder(model, dtype=torch_dtype)
        if tokenizer:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(tokenizer)
        if "cepe" in methods:
            if not cepe_init:
                raise ValueError(
                    f"--model {model} is a plain decoder: 'cepe' needs a CEPE adapter dir, or --cepe-init to "
                    "attach an untrained adapter (smoke runs only)"
                )
            from cepe.modeling import CepeForCausalLM

            cepe_model = CepeForCausalLM.from_decoder(decoder).eval()
    decoder.to(device)
    if cepe_model is not None:
        cepe_model.to(device)
    return EvalSetup(tokenizer=tok, decoder=decoder, cepe_model=cepe_model, methods=methods, **kwargs)


def run_task(task: str, setup: EvalSetup, config: dict[str, Any]) -> dict[str, Any]:
    """Run ``task`` with a config dict (method options under ``methods:``); returns the result dict."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    module = importlib.import_module(f"cepe.eval.tasks.{task}")
    cfg = config_from_dict(module.Config, config, where=f"{task} config")
    seed_everything(setup.seed)
    result = module.run(setup, cfg)
    for row in result["rows"]:
        row.setdefault("task", task)
    return result


def _parse_value(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


def _run(args: argparse.Namespace) -> int:
    import yaml

    from cepe.eval.report import write_report

    config: dict[str, Any] = {}
    if args.config:
        p = Path(args.config)
        if not p.exists():
            raise FileNotFoundError(f"config file {p} does not exist")
        config = yaml.safe_load(p.read_text()) or {}
    for item in args.set or []:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        set_dotted(config, k, _parse_value(v))
    method_options = config.pop("methods", {}) or {}
    run_opts = config.pop("run", {}) or {}
    methods = [
        m.strip() for m in (args.methods or run_opts.get("methods", "truncated")).split(",") if m.strip()
    ]
    setup = load_setup(
        args.model,
        methods,
        device=args.device,
        dtype=args.dtype,
        tokenizer=args.tokenizer,
        cepe_init=args.cepe_init,
        method_options=method_options,
        autocast_dtype=_DTYPES[args.autocast] if args.autocast else None,
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
            "device": cpu_count_note() if args.device == "cpu" else args.device,
        }
    )
    paths = write_report(result, args.out, x_key=result.get("plot_x"))
    print(Path(paths["markdown"]).read_text())
    print(json.dumps(paths))
    return 0


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
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="weights dtype")
    p.add_argument("--autocast", choices=["bf16", "fp16"], help="autocast dtype for the forward passes")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--limit", type=int, help="cap examples per setting (quick runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cepe-init", action="store_true", help="attach an untrained adapter to a plain decoder")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_run)
