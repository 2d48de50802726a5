"""``cepe pretrain-encoder``, ``cepe train``, ``cepe teacher`` (see :mod:`cepe.training.trainer`) and ``cepe
fit-heads`` (:mod:`cepe.training.head_fit`).

All take ``--config FILE`` (YAML or JSON) plus ``--set key.sub=value`` overrides; several processes:
``accelerate launch [--num_processes N] -m cepe.training.cli train --stage cepe --config FILE``.
"""

from __future__ import annotations

import argparse

STAGE_CHOICES = ("warmup", "cepe", "ceped")


def _load(args: argparse.Namespace, stage: str):  # -> TrainConfig
    """The stage's :class:`~cepe.training.config.TrainConfig`: ``--config`` (optional when the flags give
    ``--output-dir`` and the data), then ``--set`` overrides, then the generated flags given."""
    from cepe.configio import flag_overrides

    from .config import load_config

    overrides = [*(args.set or []), *flag_overrides(args)]
    return load_config(args.config if args.config is not None else {}, overrides, stage=stage)


def _run_train(args: argparse.Namespace, stage: str) -> int:
    from .runctl import Stopped
    from .trainer import train

    cfg = _load(args, stage)
    try:
        out = train(cfg, resume=args.resume, allow_dtype_change=args.allow_dtype_change)
    except Stopped as stop:
        print(f"{cfg.output_dir}: {stop}")
        return 128 + stop.signum
    if cfg.stop_step == cfg.steps:
        print(f"wrote {out}")
    return 0


def show_status(dirs: list[str]) -> int:
    """Print one status line per run directory (default: every run under ``runs/`` that has one)."""
    from pathlib import Path

    from .runctl import STATUS_FILE, format_status, read_status

    paths = [Path(d) for d in dirs] or sorted(p.parent for p in Path("runs").glob(f"**/{STATUS_FILE}"))
    if not paths:
        print("no training run found (no runs/**/status.json); give the run directories: --status DIR ...")
        return 1
    for path in paths:
        st = read_status(path)
        print(f"{path}: no status (not started by this trainer)" if st is None else format_status(path, st))
    return 0


def _pretrain(args: argparse.Namespace) -> int:
    return _run_train(args, "mlm")


def _train(args: argparse.Namespace) -> int:
    if args.status is not None:
        return show_status(args.status)
    return _run_train(args, train_stage(args.stage, args.config))


def train_stage(stage: str | None, config: str | None) -> str:
    """The stage ``cepe train`` runs: ``--stage``, else the config file's ``stage`` (through ``extends:``)."""
    if stage is not None:
        return stage
    if config is not None:
        from cepe.configio import read_config_file

        found = read_config_file(config).get("stage")
        if found in STAGE_CHOICES:
            return str(found)
        if found is not None:
            raise ValueError(f"{config} says stage: {found!r}; cepe train runs {', '.join(STAGE_CHOICES)}")
    raise ValueError(
        "cepe train needs --stage, or --config FILE with a `stage:` key (or --status); e.g. "
        "cepe train --config configs/train/recipe/fast_warmup.yaml"
    )


def _teacher(args: argparse.Namespace) -> int:
    from accelerate import PartialState

    from .teacher import run_teacher
    from .trainer import cpu_only

    cfg = _load(args, "ceped")

    state = PartialState(cpu=cpu_only())
    out = run_teacher(
        cfg,
        num_examples=args.num_examples,
        rank=state.process_index,
        world_size=state.num_processes,
        progress=cfg.progress and state.is_main_process,
        device=state.device,
    )
    state.wait_for_everyone()
    print(f"wrote {out}")
    return 0


def _fit_heads(args: argparse.Namespace) -> int:
    from cepe.configio import config_from_args

    from .fit_config import HeadFitConfig
    from .head_fit import print_summary, run_head_fit

    print_summary(run_head_fit(config_from_args(HeadFitConfig, args, "fit-heads config")))
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    """``--config FILE``, ``--set KEY=VALUE`` and one flag per :class:`TrainConfig` field (``--steps``,
    ``--output-dir``, ``--no-progress``, ``--optim.lr``, ``--data.corpus``, ...) but ``stage``."""
    from cepe.configio import add_config_flags

    from .config import TrainConfig

    add_config_flags(
        p,
        TrainConfig,
        exclude=["stage"],
        aliases={"profile_steps": ["--profile"]},
        config_file="stage config (YAML or JSON), e.g. configs/train/mini/...; the flags below override it",
    )


def _run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint (or, with none, from the snapshot in snapshot_dir)",
    )
    p.add_argument(
        "--allow-dtype-change",
        action="store_true",
        help="resume in another compute dtype than the checkpoint was trained in",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``pretrain-encoder``, ``train``, ``teacher`` and ``fit-heads``."""
    p = subparsers.add_parser(
        "pretrain-encoder",
        help="masked-LM pre-training of the context encoder (stage 1)",
        description="Pre-train the bidirectional context encoder with masked LM (30%% masking, always the "
        "[MASK] token). The output directory is what later stages read as init_encoder.",
    )
    _common(p)
    _run_options(p)
    p.add_argument("--status", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_pretrain)

    p = subparsers.add_parser(
        "train",
        help="train CEPE: copy warmup, CEPE, or CEPED (distillation)",
        description="Train the encoder and cross-attention of a frozen decoder. Stages in order: warmup "
        "(copy), cepe, ceped (needs `cepe teacher` first). The output directory is a cepe adapter.",
    )
    p.add_argument(
        "--stage",
        choices=STAGE_CHOICES,
        help="the stage to train (default: the config file's `stage`; required without one, unless --status)",
    )
    _common(p)
    _run_options(p)
    p.add_argument(
        "--status",
        nargs="*",
        metavar="DIR",
        default=None,
        help="print stage, step, tokens seen, recent loss, tokens/s and ETA of the runs in DIR ... (default: "
        "every run under runs/) and exit",
    )
    p.set_defaults(func=_train)

    p = subparsers.add_parser(
        "teacher",
        help="CEPED teacher pass: store the decoder's top-k distributions on concat(C, X)",
        description="Run the instruction-tuned decoder on the full window of each CEPED example and store its "
        "top-k next-token probabilities (fp16) and ids (int32) in teacher_dir. Resumable.",
    )
    _common(p)
    p.add_argument("--num-examples", type=int, default=None, help="default: steps × batch_size")
    p.set_defaults(func=_teacher)

    from cepe.configio import add_config_flags

    from .fit_config import HeadFitConfig

    p = subparsers.add_parser(
        "fit-heads",
        help="fit the output mixture's heads in full batch on a recipe's recorded per-token statistics",
        description="Record, over a frozen reader, what the output mixture's loss needs at every scored token "
        "of a heads-only recipe's batches (its examples, layouts and dtype), then fit the mixing and copy "
        "heads to convergence by L-BFGS; every n-th example is held out and scored, with other adapters' heads "
        "on the same tokens (--compare). Writes OUTPUT_DIR/adapter, fit.json, fit.md, fit.png. Resumable.",
    )
    add_config_flags(
        p, HeadFitConfig, config_file="fit-heads config (YAML or JSON); the flags below override it"
    )
    p.set_defaults(func=_fit_heads)


def main(argv: list[str] | None = None) -> int:
    """Run these sub-commands without the rest of ``cepe`` (``python -m cepe.training.cli ...``)."""
    from cepe.cliutil import run

    parser = argparse.ArgumentParser(prog="cepe-train")
    register(parser.add_subparsers(dest="command", metavar="COMMAND"))
    return run(parser, argv)


if __name__ == "__main__":
    raise SystemExit(main())
