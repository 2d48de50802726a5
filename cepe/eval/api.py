"""The evaluation API: load a model bundle (:func:`load_setup`) and run a task on it (:func:`run_task`);
:func:`run_eval` does both from an :class:`~cepe.eval.config.EvalRunConfig` and writes the report.

``cepe eval`` (:mod:`cepe.eval.cli`) is :func:`run_eval`; the main job, the lm-evaluation-harness model and
the scripts call :func:`load_setup` and :func:`run_task`. ``model`` is a CEPE adapter directory
(``CepeForCausalLM.from_pretrained``), ``default`` / a decoder directory or hub id (baselines only, unless
``cepe_init`` attaches an untrained adapter for smoke runs), or ``tiny`` (a random 2-layer model with a
byte tokenizer, for smoke tests).

Typical use::

    from cepe.eval.api import load_setup, run_task
    setup = load_setup("adapters/smollm2-135m-cepe", ["cepe", "truncated"])
    result = run_task("lm", setup, {"totals": [4096]})

    # or, as `cepe eval lm --model ... --methods cepe,truncated --out results/lm`:
    from cepe.eval.config import EvalRunConfig
    result, paths = run_eval("lm", EvalRunConfig(model="adapters/smollm2-135m-cepe",
                                                 methods=["cepe", "truncated"], out="results/lm"),
                             {"totals": [4096]})
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cepe.configio import build
from cepe.dtypes import torch_dtype as to_torch_dtype
from cepe.eval.common import EvalSetup
from cepe.eval.config import DTYPES, EvalRunConfig
from cepe.eval.tasks import TASKS
from cepe.measure import cpu_count_note, cpu_model_note, seed_everything

if TYPE_CHECKING:
    import torch


def is_cepe_dir(path: Path) -> bool:
    """Whether ``path`` holds a cepe adapter (``cepe_config.json``) or a released checkpoint."""
    if (path / "cepe_config.json").exists():
        return True
    cfg = path / "config.json"
    if cfg.exists():
        raw = json.loads(cfg.read_text())
        return "encoder_config" in raw or "LlamaForCausalContextLM" in raw.get("architectures", [])
    return False


def load_setup(
    model: str,
    methods: list[str],
    device: str = "cpu",
    dtype: str = "fp32",
    tokenizer: str | None = None,
    cepe_init: bool = False,
    **kwargs: Any,
) -> EvalSetup:
    """Load the model bundle for ``model`` (see the module docstring); ``kwargs`` go to :class:`EvalSetup`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    torch_dtype = to_torch_dtype(dtype)
    cepe_model = None
    path = Path(model)
    if model == "tiny":
        from cepe.tiny import ByteTokenizer, tiny_cepe, tiny_decoder

        tok, decoder = ByteTokenizer(), tiny_decoder()
        if "cepe" in methods:
            cepe_model = tiny_cepe(decoder)
    elif path.is_dir() and is_cepe_dir(path):
        from cepe.assets import load_tokenizer
        from cepe.modeling import CepeForCausalLM

        cepe_model = CepeForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
        decoder = cepe_model.decoder
        name = tokenizer or cepe_model.cepe_config.decoder_name_or_path
        if not name:
            raise ValueError(f"{path} names no decoder; pass --tokenizer <decoder dir or hub id>")
        tok = load_tokenizer(name)  # also a recorded .gguf file
    else:
        from cepe.assets import load_decoder_model, load_tokenizer

        decoder = load_decoder_model(model, dtype=torch_dtype)
        tok = load_tokenizer(tokenizer or model)  # a decoder directory without tokenizer files: --tokenizer
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


def task_config(task: str, config: dict[str, Any] | None, where: str | None = None) -> Any:
    """``task``'s ``Config`` dataclass built from its settings (a task config file without its ``methods:``
    and ``run:`` sections); errors name ``where`` (default ``"<task> config"``) and the key."""
    return build(_task_module(task).Config, dict(config or {}), where=where or f"{task} config")


def _task_module(task: str) -> Any:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    return importlib.import_module(f"cepe.eval.tasks.{task}")


def run_task(task: str, setup: EvalSetup, config: dict[str, Any]) -> dict[str, Any]:
    """Run ``task`` on ``setup`` with its settings ``config`` (method options are ``setup.method_options``);
    returns the result dict."""
    cfg = task_config(task, config)
    seed_everything(setup.seed)
    result = _task_module(task).run(setup, cfg)
    for row in result["rows"]:
        row.setdefault("task", task)
    return result


def resolve_autocast(autocast: str | None, device: str | torch.device) -> torch.dtype | None:
    """The autocast dtype of ``EvalRunConfig.autocast``: None, a named dtype, or for ``auto`` bf16 where
    its matmuls are faster than fp32 on ``device`` (``cepe.compute.autocast_dtype``), else None."""
    if autocast == "auto":
        from cepe.compute import autocast_dtype

        return autocast_dtype(device)
    return to_torch_dtype(autocast) if autocast else None


def run_eval(
    task: str,
    run: EvalRunConfig,
    config: dict[str, Any] | None = None,
    method_options: dict[str, dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """``cepe eval <task>``: load ``run.model``, run ``task`` with its settings ``config`` (checked before the
    model loads) and the per-method ``method_options``, and write ``<task>.json``, ``.md`` and plots into
    ``run.out``. Returns ``(result, {"json": path, "markdown": path, ...})``."""
    from cepe.eval.report import write_report

    config = dict(config or {})
    method_options = dict(method_options or {})
    task_config(task, config)
    device = run.device or _default_device()
    setup = load_setup(
        run.model,
        run.methods,
        device=device,
        dtype=run.dtype,
        tokenizer=run.tokenizer,
        cepe_init=run.cepe_init,
        method_options=method_options,
        autocast_dtype=resolve_autocast(run.autocast, device),
        batch_size=run.batch_size,
        seed=run.seed,
        limit=run.limit,
        progress=run.progress,
    )
    if run.context_scale is not None:
        if setup.cepe_model is None:
            raise ValueError(
                "context_scale applies to a CEPE model; --model gave none (add cepe to --methods)"
            )
        setup.cepe_model.cepe_config.context_scale = float(run.context_scale)
    result = run_task(task, setup, config)
    result.update(
        {
            "model": run.model,
            "methods": run.methods,
            "method_options": method_options,
            "config": config,
            "seed": run.seed,
            "device": cpu_count_note() if device == "cpu" else device,
            **({"cpu": cpu} if device == "cpu" and (cpu := cpu_model_note()) else {}),
            # what the numbers were computed in: the weights' dtype and the autocast (none: the weights')
            "dtype": run.dtype,
            "autocast": str(setup.autocast_dtype).removeprefix("torch.") if setup.autocast_dtype else "none",
            **({"context_scale": run.context_scale} if run.context_scale is not None else {}),
        }
    )
    return result, write_report(result, run.out, x_key=result.get("plot_x"))


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
