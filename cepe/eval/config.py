"""The run options of an evaluation (:class:`EvalRunConfig`): the flags of ``cepe eval`` and the arguments of
:func:`cepe.eval.api.run_eval`. A plain dataclass with no torch import, so the command line is built without
loading torch.

A task's own settings (``totals``, ``sources``, ...) are its module's ``Config`` (``cepe.eval.tasks.<task>``);
a task config file (``configs/eval/<task>.yaml``) holds them, per-method options under ``methods:`` and,
optionally, run options under ``run:`` (:func:`split_task_file`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

METHODS = ("cepe", "full", "truncated", "streamingllm", "replug")
"""The evaluation methods: CEPE and the baselines (:mod:`cepe.eval.registry` builds them)."""
DTYPES = ("fp32", "bf16", "fp16")  # weight / autocast dtypes of an evaluation (cepe.dtypes.torch_dtype)


@dataclass
class EvalRunConfig:
    """How to run an evaluation task (which model, methods and compute); the same for every task.

    Attributes:
        model: a CEPE adapter directory, a decoder directory or hub id (baselines only, unless
            ``cepe_init``), ``default`` (the packaged decoder) or ``tiny`` (a random test model).
        methods: methods to compare (``cepe``, ``full``, ``truncated``, ``streamingllm``, ``replug``);
            several values or one comma-separated list (``--methods cepe,truncated``).
        device: ``cpu``, ``cuda``, ... (default: cuda when available, else cpu).
        dtype: weights dtype.
        autocast: autocast dtype for the forward passes (default: none, the weights dtype); ``auto`` =
            bf16 where its matmuls are faster than fp32 on this machine (bf16 matrix units), else none
            (``cepe.compute``; ``CEPE_BF16=1`` / ``0`` forces either).
        batch_size: requests of equal length scored per forward pass.
        limit: cap on examples per setting (quick runs; default: the task config's counts).
        seed: run seed (seeded before the task runs).
        out: output directory of ``<task>.json``, ``<task>.md`` and the plots.
        tokenizer: tokenizer directory or hub id (default: the decoder's).
        cepe_init: attach an untrained adapter to a plain decoder (smoke runs only).
        progress: show progress bars.
        context_scale: override the adapter's ``context_scale`` (the multiplier on its cross-attention
            outputs; default: the adapter's own, 1.0 unless calibrated).
    """

    model: str = "default"
    methods: list[str] = field(default_factory=lambda: ["truncated"])
    device: str | None = None
    dtype: str = field(default="fp32", metadata={"choices": tuple(sorted(DTYPES))})
    autocast: str | None = field(default=None, metadata={"choices": ("auto", "bf16", "fp16")})
    batch_size: int = 8
    limit: int | None = None
    seed: int = 0
    out: str = "results/eval"
    tokenizer: str | None = None
    cepe_init: bool = False
    progress: bool = True
    context_scale: float | None = None

    def __post_init__(self) -> None:
        self.methods = [m.strip() for item in self.methods for m in str(item).split(",") if m.strip()]
        if not self.methods:
            raise ValueError("methods: name at least one method")
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise ValueError(f"methods: unknown {bad}; choose from {', '.join(METHODS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.autocast is not None and self.autocast not in ("auto", "bf16", "fp16"):
            raise ValueError(f"autocast must be auto, bf16 or fp16, got {self.autocast!r}")
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if self.context_scale is not None and not 0 <= self.context_scale < float("inf"):
            raise ValueError(f"context_scale must be a finite number >= 0, got {self.context_scale}")
        if self.limit is not None and self.limit <= 0:
            raise ValueError(f"limit must be positive, got {self.limit}")


def split_task_file(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(task settings, method options, run options)`` of a task config mapping: the ``methods:`` and
    ``run:`` sections taken out (a ``run.methods`` string is the comma list it always was)."""
    task = dict(data)
    method_options = task.pop("methods", None) or {}
    run = dict(task.pop("run", None) or {})
    if isinstance(run.get("methods"), str):
        run["methods"] = [run["methods"]]
    return task, method_options, run
