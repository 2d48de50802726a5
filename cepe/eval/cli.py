"""``cepe eval <task> --model ... --config ...``: run one evaluation task and write JSON, markdown, PNG.

The run flags are generated from :class:`~cepe.eval.config.EvalRunConfig` (the arguments of
:func:`cepe.eval.api.run_eval`); ``--config`` is the task's YAML file (``configs/eval/<task>.yaml``: the
task's ``Config`` keys, per-method options under ``methods:``, optional run options under ``run:``) and
``--set key=value`` overrides its keys. No torch import until the command runs.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cepe.configio import add_config_flags, apply_overrides, flag_overrides, load_config, read_config_file
from cepe.eval.config import EvalRunConfig, split_task_file
from cepe.eval.tasks import TASKS


def load_eval_config(
    task: str, path: str | None = None, overrides: Iterable[str] = (), flags: Iterable[tuple[str, Any]] = ()
) -> tuple[EvalRunConfig, dict[str, Any], dict[str, Any]]:
    """``(run options, task settings, method options)`` from a task config file (or none), its ``--set``
    ``overrides`` (``key=value`` strings) and the run ``flags`` given (``(key, value)`` pairs, over the file's
    ``run:`` section). The task settings are checked against the task's ``Config`` (torch is imported for
    that); errors name the file and the key."""
    from cepe.eval.api import task_config

    where = path or "--set"
    raw = read_config_file(path, allow_empty=True) if path else {}
    settings, method_options, run = split_task_file(apply_overrides(raw, overrides, where=where))
    if not isinstance(method_options, dict):
        raise ValueError(f"{where}: methods must map a method name to its options, got {method_options!r}")
    from cepe.eval.registry import check_method_options

    try:
        check_method_options(method_options)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err
    run_cfg = load_config(EvalRunConfig, data=run, overrides=flags, where="run")
    try:
        task_config(task, settings)
    except ValueError as err:
        raise ValueError(f"{path}: {err}" if path else str(err)) from err
    return run_cfg, settings, method_options


def _run(args: argparse.Namespace) -> int:
    from cepe.eval.api import run_eval

    run, settings, method_options = load_eval_config(
        args.task, args.config, args.set or [], flag_overrides(args)
    )
    _, paths = run_eval(args.task, run, settings, method_options)
    print(Path(paths["markdown"]).read_text())
    print(json.dumps(paths))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``cepe eval`` to the ``cepe`` command."""
    p = subparsers.add_parser(
        "eval",
        help=f"run an evaluation task ({', '.join(TASKS)})",
        description="Run one evaluation task; every EvalRunConfig field is a flag (or a key of the config "
        "file's run: section).",
    )
    p.add_argument("task", choices=TASKS, help="the task (cepe.eval.tasks.<task>)")
    add_config_flags(
        p,
        EvalRunConfig,
        config_file="YAML task config (configs/eval/<task>.yaml): the task's keys, per-method options under "
        "methods:, run options under run:",
    )
    p.set_defaults(func=_run)
