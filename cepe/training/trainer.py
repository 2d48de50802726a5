"""The training loop of every stage, on ``accelerate`` (one process, DDP or FSDP via ``accelerate launch``).

Step ``s`` consumes global examples ``[s·batch_size, (s+1)·batch_size)`` (see
:func:`cepe.training.data.example_indices`), each a pure function of its index, so the examples of a step
do not depend on the number of processes or on interruptions: ``--resume`` reproduces the losses of an
uninterrupted run exactly.

Outputs in ``output_dir``: ``train_config.json``, ``log.jsonl`` (one JSON record per logged step),
``checkpoints/step_*/`` and, at the end, the stage artifact: a cepe adapter (``adapter_model.safetensors``
+ ``cepe_config.json``, loadable by ``CepeForCausalLM.from_pretrained``) or, for ``mlm``, the encoder
(``encoder_model.safetensors`` + ``encoder_config.json``, what ``init_encoder`` reads).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint import checkpoint_dirs, load_checkpoint, rng_state, save_checkpoint
from .config import TrainConfig
from .data import build_example, collate, example_indices, window_source
from .models import StageModule, build_model, save_encoder, set_train_mode, trainable_parameters

LOG_FILE = "log.jsonl"
CONFIG_FILE = "train_config.json"
DIGESTS_FILE = "final_digests.json"


def cosine_schedule(optimizer: torch.optim.Optimizer, steps: int, warmup_ratio: float, min_lr_ratio: float):
    """Linear warmup over ``ceil(warmup_ratio·steps)`` steps, then cosine decay to ``min_lr_ratio``·lr."""
    warmup = math.ceil(warmup_ratio * steps) if warmup_ratio > 0 else 0

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        progress = min(1.0, (s - warmup) / max(1, steps - warmup))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def param_groups(model: nn.Module, params: list[nn.Parameter], cfg: TrainConfig) -> list[dict[str, Any]]:
    """AdamW parameter groups: the cross-attention head gates at ``optim.gate_lr`` when set (a gate moves
    about one learning rate per Adam step, so at the weights' rate it would need thousands of steps to
    open), everything else at ``optim.lr``."""
    if cfg.optim.gate_lr is None:
        return [{"params": params}]
    gates = {id(p) for n, p in model.named_parameters() if n.endswith("cross_attn.gate")}
    rest = [p for p in params if id(p) not in gates]
    gated = [p for p in params if id(p) in gates]
    groups = [{"params": rest}]
    if gated:
        groups.append({"params": gated, "lr": cfg.optim.gate_lr})
    return groups


def cpu_only() -> bool:
    """True when no GPU-like device is present (then several processes use gloo on the CPU)."""
    xpu = getattr(torch, "xpu", None)
    return not (torch.cuda.is_available() or (xpu is not None and xpu.is_available()))


def parameter_digest(params: list[nn.Parameter]) -> str:
    """SHA-256 of the bytes of ``params`` (to check that processes hold identical weights)."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def read_log(output_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``output_dir/log.jsonl``."""
    path = Path(output_dir) / LOG_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _tokens(batch: dict[str, torch.Tensor]) -> int:
    n = int(batch["input_ids"].numel())
    if "encoder_attention_mask" in batch:
        n += int(batch["encoder_attention_mask"].sum())
    return n


def train(cfg: TrainConfig, resume: bool = False) -> Path:
    """Run (or resume) the stage described by ``cfg``; returns ``cfg.output_dir``.

    Args:
        cfg: the stage config.
        resume: continue from the newest checkpoint in ``output_dir/checkpoints`` (starts fresh when there
            is none).

    Raises:
        ValueError: ``output_dir`` already holds checkpoints and ``resume`` is False, or the checkpoint was
            written with a different configuration.
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, gather_object
    from tqdm.auto import tqdm

    if cfg.num_threads:
        torch.set_num_threads(int(cfg.num_threads))
    ddp = DistributedDataParallelKwargs(find_unused_parameters=cfg.stage in ("cepe", "ceped"))
    if cpu_only() and os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        raise ValueError(
            "FSDP was requested (accelerate launch --use_fsdp) but this machine has no GPU, and accelerate "
            "shards only over accelerator devices; on CPU launch without --use_fsdp (DDP over gloo)"
        )
    acc = Accelerator(kwargs_handlers=[ddp], cpu=cpu_only())
    world, rank = acc.num_processes, acc.process_index
    accum = cfg.grad_accum(world)
    out = Path(cfg.output_dir)
    existing = checkpoint_dirs(out)
    if existing and not resume:
        raise ValueError(
            f"{out} already holds checkpoints (newest step {existing[-1][0]}); pass --resume to continue "
            "or choose another output_dir"
        )

    model = build_model(cfg)
    params = trainable_parameters(model)
    if cfg.stage != "mlm":
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        bad = [n for n in names if not (n.startswith("encoder.") or ".cross_attn." in n)]
        if bad:
            raise RuntimeError(f"decoder parameters would train: {bad[:5]}")
    module = StageModule(model, cfg)
    optimizer = torch.optim.AdamW(
        param_groups(model, params, cfg),
        lr=cfg.optim.lr,
        betas=(cfg.optim.betas[0], cfg.optim.betas[1]),
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
    )
    scheduler = cosine_schedule(optimizer, cfg.steps, cfg.optim.warmup_ratio, cfg.optim.min_lr_ratio)
    module, optimizer = acc.prepare(module, optimizer)
    stage_module: StageModule = acc.unwrap_model(module)
    inner = stage_module.model

    start = 0
    if resume and existing:
        step0, path = existing[-1]
        saved = json.loads((path / "trainer_state.json").read_text())
        if saved.get("fingerprint") != cfg.fingerprint():
            raise ValueError(
                f"checkpoint {path} was written with a different configuration (fingerprint "
                f"{saved.get('fingerprint')} vs {cfg.fingerprint()}); resume with the same config and steps"
            )
        state = load_checkpoint(path, inner, optimizer, scheduler, rank=rank)
        start = int(state["step"])
        assert start == step0
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        cfg.save(out / CONFIG_FILE)
        kept = [r for r in read_log(out) if r.get("step", 0) <= start] if start else []
        (out / LOG_FILE).write_text("".join(json.dumps(r) + "\n" for r in kept))

    vocab = int(inner.config.vocab_size) if cfg.stage != "mlm" else int(inner.encoder.config.vocab_size) - 1
    source = window_source(cfg, vocab)
    mask_id = inner.encoder.config.mask_token_id if cfg.stage == "mlm" else None
    teacher = None
    if cfg.stage == "ceped":
        from .teacher import TeacherStore

        teacher = TeacherStore(cfg)
        need = cfg.steps * cfg.batch_size
        if teacher.num_examples < need:
            raise ValueError(
                f"the teacher pass in {cfg.teacher_dir} covers {teacher.num_examples} examples but training "
                f"reads {need} (steps × batch_size); rerun `cepe teacher` with this config"
            )

    def make(i: int) -> dict[str, torch.Tensor]:
        ex = build_example(cfg, source[i], i, mask_id)
        if teacher is not None:
            ex["teacher_probs"], ex["teacher_indices"] = teacher.get(i)
        return ex

    bar = tqdm(
        total=cfg.steps,
        initial=start,
        desc=cfg.stage,
        unit="step",
        disable=not (cfg.progress and acc.is_main_process),
    )
    t_start = time.perf_counter()
    for step in range(start, cfg.steps):
        set_train_mode(inner)
        t0 = time.perf_counter()
        losses: list[torch.Tensor] = []
        extra: dict[str, list[torch.Tensor]] = {}
        tokens = 0
        for micro in range(accum):
            idx = example_indices(step, cfg.batch_size, micro, cfg.micro_batch_size, rank, world)
            batch = {k: v.to(acc.device) for k, v in collate([make(i) for i in idx]).items()}
            batch.pop("index")
            tokens += _tokens(batch)
            sync = acc.no_sync(module) if micro < accum - 1 else contextlib.nullcontext()
            with sync:
                loss, metrics = module(batch)
                acc.backward(loss / accum)
            stage_module.release()
            losses.append(loss.detach().float())
            for k, v in metrics.items():
                extra.setdefault(k, []).append(v.float())
        grad_norm = None
        if cfg.optim.max_grad_norm:
            grad_norm = acc.clip_grad_norm_(params, cfg.optim.max_grad_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        loss_value = acc.reduce(torch.stack(losses).mean(), "mean")
        metric_values = {k: float(acc.reduce(torch.stack(v).mean(), "mean")) for k, v in extra.items()}
        dt = time.perf_counter() - t0
        tok_s = tokens * world / max(dt, 1e-9)
        done = step + 1
        if acc.is_main_process:
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss_value):.4f}", tok_s=f"{tok_s:.0f}")
            if done % cfg.log_every == 0 or done == cfg.steps:
                record = {
                    "step": done,
                    "loss": float(loss_value),
                    **metric_values,
                    "lr": lr,
                    "grad_norm": None if grad_norm is None else float(grad_norm),
                    "tokens_per_s": tok_s,
                    "step_s": dt,
                    "elapsed_s": time.perf_counter() - t_start,
                }
                with open(out / LOG_FILE, "a") as f:
                    f.write(json.dumps(record) + "\n")
        if done % cfg.save_every == 0 or done == cfg.steps:
            rngs = gather_object([rng_state()])
            if acc.is_main_process:
                state = {
                    "step": done,
                    "examples_seen": done * cfg.batch_size,
                    "fingerprint": cfg.fingerprint(),
                    "stage": cfg.stage,
                    "world_size": world,
                }
                save_checkpoint(
                    out, done, inner, optimizer, scheduler, state, rngs, keep=cfg.keep_checkpoints
                )
            acc.wait_for_everyone()
    bar.close()

    digests = gather_object([parameter_digest(params)])
    if acc.is_main_process:
        inner.eval()
        if cfg.stage == "mlm":
            save_encoder(inner, out)
        else:
            inner.save_pretrained(out)
        (out / DIGESTS_FILE).write_text(json.dumps(digests, indent=2) + "\n")
        if len(set(digests)) > 1:
            warnings.warn(f"processes ended with different trainable weights: {digests}", stacklevel=2)
    acc.wait_for_everyone()
    return out
