"""The training loop of every stage, on ``accelerate`` (one process, DDP or FSDP via ``accelerate launch``).

Step ``s`` consumes global examples ``[s·batch_size, (s+1)·batch_size)`` (see
:func:`cepe.training.data.example_indices`), each a pure function of its index, so the examples of a step
do not depend on the number of processes or on interruptions: ``--resume`` reproduces the losses of an
uninterrupted run exactly.

Outputs in ``output_dir``: ``train_config.json``, ``log.jsonl`` (one JSON record per logged step;
``--resume`` rewrites it to the records up to the checkpoint's step), ``checkpoints/step_*/`` and, at the
end, the stage artifact: a cepe adapter (``adapter_model.safetensors`` + ``cepe_config.json``, loadable by
``CepeForCausalLM.from_pretrained``) or, for ``mlm``, the encoder (``encoder_model.safetensors`` +
``encoder_config.json``, what ``init_encoder`` reads).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cepe import fileio
from cepe.alloc import jemalloc_active, purge
from cepe.config import is_adapter_key

from .checkpoint import checkpoint_dirs, load_checkpoint, rng_state, save_checkpoint
from .config import TrainConfig
from .data import (
    FOREIGN_OFFSET,
    at_layout,
    build_example,
    collate,
    corpus_digest,
    example_indices,
    needs_foreign,
    regroup_chunks,
    step_chunk_length,
    step_layout,
    window_source,
)
from .models import StageModule, build_model, save_encoder, set_train_mode, trainable_parameters
from .runctl import (
    DTYPE_NAMES,
    Signals,
    Stopped,
    decide_bf16,
    format_status,
    load_snapshot,
    read_snapshot,
    save_snapshot,
    settle_dtype,
    write_status,
)
from .speed import COST_MODEL, hold_frozen_linears, step_flops

LOG_FILE = "log.jsonl"
CONFIG_FILE = "train_config.json"
DIGESTS_FILE = "final_digests.json"


def cosine_schedule(optimizer: torch.optim.Optimizer, steps: int, warmup_ratio: float, min_lr_ratio: float):
    """Linear warmup over ``ceil(warmup_ratio·steps)`` steps, then cosine decay towards ``min_lr_ratio``·lr
    (reached at step ``steps``, one past the last).

    Kept by hand: transformers has no schedule with these per-step factors (``tests/test_kept_libraries.py``
    compares them). ``get_cosine_schedule_with_warmup`` has no floor and warms up from 0 (``s / warmup``,
    ours ``(s + 1) / warmup``); ``get_cosine_with_min_lr_schedule_with_warmup`` has the floor but the same
    warmup; ``get_cosine_with_min_lr_schedule_with_warmup_lr_rate`` has our warmup but decays one step ahead
    (``s - warmup + 1``). Any of them would change the learning rate of every step, hence the losses of
    committed runs and the resumption of running ones.
    """
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
    open), each ``optim.lr_by_name`` part's parameters at that part's rate (the first listed part a name
    contains), everything else at ``optim.lr``. A part whose parameters are all frozen (a rate a recipe
    inherits for parts its ``train_only`` leaves out) sets nothing.

    Raises:
        ValueError: an ``lr_by_name`` part matches no parameter of the model (a misspelt part).
    """
    trainable = {id(p) for p in params}
    rate: dict[int, float] = {}
    if cfg.optim.gate_lr is not None:
        for n, p in model.named_parameters():
            if n.endswith("cross_attn.gate") and id(p) in trainable:
                rate[id(p)] = cfg.optim.gate_lr
    for part, lr in (cfg.optim.lr_by_name or {}).items():
        matched = [p for n, p in model.named_parameters() if part in n]
        if not matched:
            names = [n for n, p in model.named_parameters() if id(p) in trainable]
            raise ValueError(
                f"optim.lr_by_name part {part!r} matches no parameter of the model; trainable names are like "
                f"{names[:3]}: use a part of one of them"
            )
        for p in matched:
            if id(p) in trainable:
                rate.setdefault(id(p), float(lr))
    if not rate:
        return [{"params": params}]
    groups = [{"params": [p for p in params if id(p) not in rate]}]
    for lr in dict.fromkeys(rate.values()):  # one group per rate, in the order first met
        groups.append({"params": [p for p in params if rate.get(id(p)) == lr], "lr": lr})
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
    """The records of ``output_dir/log.jsonl``. A last line that is not whole JSON is left out: the record a
    running trainer is appending, or the one a killed process left half-written (a resume rewrites the
    file up to its checkpoint's step).

    Raises:
        ValueError: a line before the last is not a JSON record (not a trainer's log).
    """
    path = Path(output_dir) / LOG_FILE
    if not path.is_file():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    records = []
    for i, (n, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{n}: not a JSON record; is this a trainer's {LOG_FILE}?") from None
    return records


def _tokens(batch: dict[str, torch.Tensor]) -> int:
    n = int(batch["input_ids"].numel())
    if "encoder_attention_mask" in batch:
        n += int(batch["encoder_attention_mask"].sum())
    return n


def _threads_note() -> str:
    """``"N threads"``, with a hint when fewer threads than this process's cores compute."""
    n = torch.get_num_threads()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or n
    if n < cores:
        return f"{n} threads on {cores} cores (set num_threads or OMP_NUM_THREADS to use them all)"
    return f"{n} threads"


def _allocator_note(device: torch.device) -> str:
    """On a CPU, which malloc serves the tensors: jemalloc where it serves this process (its kept pages
    purged after each step, :mod:`cepe.alloc`), else a hint (glibc's returns large freed tensors to the
    kernel; "Where a CPU step's time went" in docs/TRAINING.md)."""
    if device.type != "cpu":
        return ""
    if jemalloc_active():
        return ", jemalloc (purged each step)"
    return ", the system malloc (`. scripts/fast_alloc.sh` before this preloads jemalloc: faster CPU steps)"


def _print(enabled: bool, text: str) -> None:
    if enabled:
        print(text, flush=True)


def train(cfg: TrainConfig, resume: bool = False, allow_dtype_change: bool = False) -> Path:
    """Run (or resume) the stage described by ``cfg``; returns ``cfg.output_dir``.

    The recipe of every stage (the stage's losses and examples live in ``StageModule`` and
    ``build_example``): set up (:func:`_setup`: accelerator, resume point, compute dtype, model, optimizer,
    restored state), then steps (:func:`_step`, :meth:`_Run.log`, :meth:`_Run.checkpoint`), then save
    (:func:`_save_artifact`).

    Args:
        cfg: the stage config.
        resume: continue from the newest checkpoint in ``output_dir/checkpoints``; with none, from the
            weights-only snapshot in ``cfg.snapshot_dir`` if there is one (fresh optimizer state), else
            start fresh.
        allow_dtype_change: resume a run in another compute dtype than it was trained in.

    Raises:
        ValueError: ``output_dir`` already holds checkpoints and ``resume`` is False, the checkpoint was
            written with a different configuration, or in another compute dtype.
        Stopped: a signal asked the run to stop; the step it finished is checkpointed.
    """
    from tqdm.auto import tqdm

    # handlers first: a pause or stop sent while the models load is kept for the first step boundary
    # (SIGUSR1's default action would end the process)
    signals = Signals().install()
    try:
        run = _setup(cfg, resume, allow_dtype_change)
    except BaseException:
        signals.restore()
        raise
    bar = tqdm(
        total=cfg.steps,
        initial=run.start,
        desc=cfg.stage,
        unit="step",
        disable=not (cfg.progress and run.main),
    )
    prof = None
    prof_from = min(run.start + 1, cfg.steps - 1) if cfg.profile_steps else -1
    run.t_start = time.perf_counter()
    last_save = time.monotonic()
    timed: list[float] = []
    if run.main:
        write_status(run.out, run.status("running", run.start))  # "done" only once the output is saved
    end = cfg.stop_step
    try:
        for step in range(run.start, end):
            if step == prof_from:
                from torch.profiler import ProfilerActivity, profile

                prof = profile(activities=[ProfilerActivity.CPU], record_shapes=False)
                prof.__enter__()
            result = _step(run, step)
            done = step + 1
            if step > run.start:
                timed.append(result.dt)  # the first step of a process pays for warm-up
            if prof is not None and done >= prof_from + cfg.profile_steps:
                prof.__exit__(None, None, None)
                if run.main:
                    _write_profile(run.out, prof, done - prof_from, cfg.stage)
                prof = None
            run.recent.append((result.loss, result.dt))
            del run.recent[:-10]
            if run.main:
                run.log(bar, done, result)
            # stop / time-based checkpoint: rank 0 decides for every process
            due = cfg.save_every_minutes is not None and (
                time.monotonic() - last_save >= 60.0 * cfg.save_every_minutes
            )
            stop_sig, due = run.agree([signals.stop, due])
            if done % cfg.save_every == 0 or done in (cfg.steps, end) or due or stop_sig is not None:
                run.checkpoint(done)
                last_save = time.monotonic()
            if stop_sig is not None:
                if run.main:
                    write_status(run.out, run.status("stopped", done))
                raise Stopped(done, int(stop_sig))
            run.paused_s += _after_step(run, signals, done)
    finally:
        signals.restore()
        if prof is not None:  # the run ended before the profiled steps did
            prof.__exit__(None, None, None)
            if run.main:
                _write_profile(run.out, prof, cfg.steps - prof_from, cfg.stage)
        bar.close()
    _print_speed(run, timed)
    if end < cfg.steps:  # stop_after: the stage goes on in a later process
        done = max(run.start, end)
        if run.main:
            write_status(run.out, run.status("stopped", done))
            _print(
                True,
                f"{cfg.stage}: stopped after step {done} of {cfg.steps} (stop_after); "
                "rerun with --resume and a later stop_after (or none) to go on",
            )
        return run.out
    _save_artifact(run)
    if run.main:  # last: a stage that says "done" (the chain skips it) has its whole output
        write_status(run.out, run.status("done", cfg.steps))
    return run.out


@dataclass
class _StepResult:
    loss: float
    metrics: dict[str, float]
    lr: float
    grad_norm: float | None
    tokens: int
    dt: float


@dataclass
class _Run:
    """What the loop of one stage works with (built by :func:`_setup`)."""

    cfg: TrainConfig
    acc: Any  # accelerate.Accelerator
    out: Path
    accum: int  # micro-batches per optimizer step and process
    compute_dtype: str
    params: list[nn.Parameter]
    module: Any  # the StageModule as prepared by accelerate (DDP-wrapped with several processes)
    stage_module: StageModule
    optimizer: torch.optim.Optimizer
    scheduler: Any
    start: int = 0
    flops: dict[str, Any] = field(default_factory=dict)
    peak: float | None = None
    make: Callable[..., dict[str, torch.Tensor]] | None = None
    recent: list[tuple[float, float]] = field(default_factory=list)  # (loss, seconds) of the last steps
    t_start: float = 0.0
    paused_s: float = 0.0
    data_digest: str | None = None  # the corpus's (cepe.training.data.corpus_digest), read once a run

    @property
    def world(self) -> int:
        return self.acc.num_processes

    @property
    def rank(self) -> int:
        return self.acc.process_index

    @property
    def main(self) -> bool:
        return self.acc.is_main_process

    @property
    def inner(self) -> nn.Module:
        return self.stage_module.model

    def agree(self, values: list[Any]) -> list[Any]:
        """``values`` as rank 0 has them, on every process."""
        if self.world > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(values, from_process=0)
        return values

    def status(self, state: str, done: int) -> dict[str, Any]:
        """The record of ``status.json`` (see :mod:`cepe.training.runctl`)."""
        cfg, flops, peak = self.cfg, self.flops, self.peak
        dec_per_step, enc_per_step = flops["decoder_tokens"], flops["encoder_tokens"]
        losses_, secs = [x[0] for x in self.recent], [x[1] for x in self.recent if x[1] > 0]
        step_s = sum(secs) / len(secs) if secs else None
        return {
            "stage": cfg.stage,
            "state": state,
            "step": done,
            "steps": cfg.steps,
            "examples_seen": done * cfg.batch_size,
            "decoder_tokens_seen": done * dec_per_step,
            "encoder_tokens_seen": done * enc_per_step,
            "loss_recent": sum(losses_) / len(losses_) if losses_ else None,
            "decoder_tokens_per_s": dec_per_step / step_s if step_s else None,
            "encoder_tokens_per_s": enc_per_step / step_s if step_s else None,
            "flops_per_step": flops["total"],
            "peak_fraction": flops["total"] / step_s / peak if (step_s and peak) else None,
            "eta_s": (cfg.stop_step - done) * step_s if step_s else None,
            "compute_dtype": self.compute_dtype,
            "output_dir": str(self.out),
        }

    def log(self, bar: Any, done: int, r: _StepResult) -> None:
        """Main process: the progress bar, and every ``log_every`` steps a ``log.jsonl`` record."""
        cfg, flops, peak = self.cfg, self.flops, self.peak
        tok_s = r.tokens * self.world / max(r.dt, 1e-9)
        bar.update(1)
        frac = flops["total"] / r.dt / peak if peak else None
        bar.set_postfix(
            loss=f"{r.loss:.4f}",
            tok_s=f"{tok_s:.0f}",
            **({"peak": f"{100 * frac:.0f}%"} if frac else {}),
        )
        if done % cfg.log_every == 0 or done == cfg.steps:
            record = {
                "step": done,
                "loss": r.loss,
                **r.metrics,
                "lr": r.lr,
                "grad_norm": r.grad_norm,
                "tokens_per_s": tok_s,
                "decoder_tokens_per_s": flops["decoder_tokens"] / r.dt,
                "encoder_tokens_per_s": flops["encoder_tokens"] / r.dt,
                "flops_per_s": flops["total"] / r.dt,
                "peak_fraction": frac,
                "step_s": r.dt,
                "elapsed_s": time.perf_counter() - self.t_start - self.paused_s,
            }
            with open(self.out / LOG_FILE, "a") as f:
                f.write(json.dumps(record) + "\n")
            if bar.disable:  # no progress bar: one status line per logged step
                _print(True, format_status(self.out, self.status("running", done)))

    def checkpoint(self, done: int) -> None:
        """Every process: checkpoint after step ``done`` (rank 0 writes; also the snapshot)."""
        from accelerate.utils import gather_object

        cfg = self.cfg
        rngs = gather_object([rng_state()])
        if self.main:
            state = {
                "step": done,
                "examples_seen": done * cfg.batch_size,
                "fingerprint": cfg.fingerprint(),
                "data_digest": self.data_digest,
                "stage": cfg.stage,
                "world_size": self.world,
                "compute_dtype": self.compute_dtype,
            }
            save_checkpoint(
                self.out,
                done,
                self.inner,
                self.optimizer,
                self.scheduler,
                state,
                rngs,
                keep=cfg.keep_checkpoints,
                keep_steps=cfg.keep_steps,
            )
            if cfg.snapshot_dir:
                self.inner.eval()
                save_snapshot(cfg.snapshot_dir, self.inner, {**state, "steps": cfg.steps})
        self.acc.wait_for_everyone()


# ---------------------------------------------------------------------------------------------- setup
def _accelerator(cfg: TrainConfig) -> Any:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    if cfg.num_threads:
        torch.set_num_threads(int(cfg.num_threads))
    ddp = DistributedDataParallelKwargs(find_unused_parameters=cfg.stage in ("cepe", "ceped"))
    if cpu_only() and os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        raise ValueError(
            "FSDP was requested (accelerate launch --use_fsdp) but this machine has no GPU, and accelerate "
            "shards only over accelerator devices; on CPU launch without --use_fsdp (DDP over gloo)"
        )
    return Accelerator(kwargs_handlers=[ddp], cpu=cpu_only())


def _resume_point(
    cfg: TrainConfig, out: Path, resume: bool, digest: str | None = None
) -> tuple[list[tuple[int, Path]], dict[str, Any] | None, dict[str, Any] | None]:
    """(the checkpoints in ``out``, the newest one's trainer state or None, the snapshot's record or None),
    checked against ``cfg``'s fingerprint and the corpus's ``digest``."""
    existing = checkpoint_dirs(out)
    if existing and not resume:
        raise ValueError(
            f"{out} already holds checkpoints (newest step {existing[-1][0]}); pass --resume to continue "
            "or choose another output_dir"
        )
    saved: dict[str, Any] | None = None
    snapshot = None
    if resume and existing:
        saved = json.loads((existing[-1][1] / "trainer_state.json").read_text())
        if saved.get("fingerprint") != cfg.fingerprint():
            raise ValueError(
                f"checkpoint {existing[-1][1]} was written with a different configuration (fingerprint "
                f"{saved.get('fingerprint')} vs {cfg.fingerprint()}); resume with the same config and steps"
            )
    elif resume:
        snapshot = read_snapshot(cfg.snapshot_dir)
        if snapshot is not None and (
            snapshot.get("stage") != cfg.stage or snapshot.get("fingerprint") != cfg.fingerprint()
        ):
            raise ValueError(
                f"the snapshot in {cfg.snapshot_dir} is of stage {snapshot.get('stage')!r} with fingerprint "
                f"{snapshot.get('fingerprint')}, this run is {cfg.stage!r} with {cfg.fingerprint()}; continue "
                "with the config that wrote it, or point snapshot_dir elsewhere"
            )
    record = saved if saved is not None else snapshot
    if record is not None and record.get("data_digest") not in (None, digest):  # (None: written before)
        raise ValueError(
            f"the run in {out} was trained on another corpus in {cfg.data.corpus} (its index.json differs: "
            f"prepared again since?); resuming would not continue the same examples. Restore that corpus "
            "or start a new output_dir"
        )
    return existing, saved, snapshot


def _build_modules(cfg: TrainConfig, use_bf16: bool) -> tuple[nn.Module, list[nn.Parameter], StageModule]:
    """The stage's model (frozen decoder checked), its trainable parameters and the loss module."""
    model = build_model(cfg)
    params = trainable_parameters(model)
    if cfg.stage != "mlm":
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        bad = [n for n in names if not is_adapter_key(n)]
        if bad:
            raise RuntimeError(f"decoder parameters would train: {bad[:5]}")
        if use_bf16 and not cfg.reference_path:
            hold_frozen_linears(model.decoder, torch.bfloat16)
    module = StageModule(model, cfg)
    module.bf16 = use_bf16  # decided once, not re-timed at every forward
    if use_bf16 and not cfg.reference_path:
        for teacher in module._teacher:  # teacher_adapter: its decoder, as the student's (a tied head and
            hold_frozen_linears(teacher.decoder, torch.bfloat16)  # the output mixture's heads keep fp32)
    return model, params, module


def _optimizer(cfg: TrainConfig, model: nn.Module, params: list[nn.Parameter]) -> tuple[Any, Any]:
    optimizer = torch.optim.AdamW(
        param_groups(model, params, cfg),
        lr=cfg.optim.lr,
        betas=(cfg.optim.betas[0], cfg.optim.betas[1]),
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
    )
    return optimizer, cosine_schedule(optimizer, cfg.steps, cfg.optim.warmup_ratio, cfg.optim.min_lr_ratio)


def _restore(
    run: _Run, existing: list[tuple[int, Path]], saved: dict[str, Any] | None, snapshot: dict[str, Any] | None
) -> int:
    """Load the checkpoint (or the snapshot: weights only, the schedule stepped on); the step to start at."""
    cfg = run.cfg
    if saved is not None:
        step0, path = existing[-1]
        state = load_checkpoint(path, run.inner, run.optimizer, run.scheduler, rank=run.rank)
        start = int(state["step"])
        assert start == step0
        return start
    if snapshot is not None:
        load_snapshot(cfg.snapshot_dir, run.inner)
        start = min(int(snapshot["step"]), cfg.steps)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(start):
                run.scheduler.step()
        _print(
            run.main,
            f"{cfg.stage}: no checkpoint; continuing from the snapshot of step {start} in "
            f"{cfg.snapshot_dir} (weights only, fresh optimizer state)",
        )
        return start
    return 0


def _open_output(run: _Run) -> None:
    """Main process: write the config and keep the log records up to the start step."""
    if run.main:
        run.out.mkdir(parents=True, exist_ok=True)
        run.cfg.save(run.out / CONFIG_FILE)
        kept = [r for r in read_log(run.out) if r.get("step", 0) <= run.start] if run.start else []
        # atomically: a kill here keeps the whole history, not an empty file
        fileio.write_text(run.out / LOG_FILE, "".join(json.dumps(r) + "\n" for r in kept))


def _measure_peak(run: _Run, use_bf16: bool) -> float | None:
    """The matmul peak (FLOP/s) of the compute dtype, measured on rank 0 (None when not measured)."""
    cfg = run.cfg
    if cfg.peak_seconds <= 0:
        return None
    peak_box = [None]
    if run.main:
        from cepe.bench.runner import matmul_peak_flops

        # the benchmark's 4096² matmul in bf16 (tens of ms); 2048² in fp32, where one 4096² takes seconds
        # on a CPU; on an accelerator 8192² (a 4096² product is too short to fill it)
        dt = torch.bfloat16 if use_bf16 else torch.float32
        size = 8192 if run.acc.device.type != "cpu" else (4096 if use_bf16 else 2048)
        peak_box[0] = matmul_peak_flops(size, dt, cfg.peak_seconds, run.acc.device)
    return run.agree(peak_box)[0]


def example_maker(cfg: TrainConfig, inner: nn.Module | None = None) -> Callable[..., dict[str, torch.Tensor]]:
    """Global example index → the stage's example (with the teacher's top-k for CEPED). Without ``inner``
    (a CEPE stage only) the vocabulary is read from the decoder's config, no weights loaded."""
    if inner is None:
        if cfg.stage == "mlm":
            raise ValueError("the mlm stage's examples need its model (the encoder's [MASK] token)")
        from .models import decoder_vocab_size

        vocab = decoder_vocab_size(cfg)
    else:
        vocab = (
            int(inner.config.vocab_size) if cfg.stage != "mlm" else int(inner.encoder.config.vocab_size) - 1
        )
    source = window_source(cfg, vocab)
    mask_id = inner.encoder.config.mask_token_id if cfg.stage == "mlm" and inner is not None else None
    teacher = None
    if cfg.stage == "ceped" and not cfg.online_teacher:
        from .teacher import TeacherStore

        teacher = TeacherStore(cfg)
        need = cfg.steps * cfg.batch_size
        if teacher.num_examples < need:
            raise ValueError(
                f"the teacher pass in {cfg.teacher_dir} covers {teacher.num_examples} examples but training "
                f"reads {need} (steps × batch_size); rerun `cepe teacher` with this config"
            )
        missing = teacher.missing_shards(need)
        if missing:
            raise ValueError(
                f"the teacher pass in {cfg.teacher_dir} lacks {len(missing)} shard(s) of the {need} examples "
                f"training reads ({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}): it stopped "
                "early or is still running; rerun `cepe teacher` with this config (it resumes)"
            )

    def make(i: int, n_decoder: int | None = None, n_chunks: int | None = None) -> dict[str, torch.Tensor]:
        """Example ``i``; with ``n_decoder`` (``decoder_lengths``) and ``n_chunks`` (``context_chunks``),
        at that decoder length and chunk count."""
        foreign = source[i + FOREIGN_OFFSET] if needs_foreign(cfg, i) else None
        c, window = at_layout(cfg, source[i], n_decoder, n_chunks)
        ex = build_example(c, window, i, mask_id, foreign=foreign)
        if teacher is not None:
            ex["teacher_probs"], ex["teacher_indices"] = teacher.get(i)
        return ex

    return make


def micro_batch(
    cfg: TrainConfig,
    make: Callable[..., dict[str, torch.Tensor]],
    step: int,
    micro: int,
    rank: int = 0,
    world: int = 1,
    keep_index: bool = False,
) -> dict[str, torch.Tensor]:
    """Micro-batch ``micro`` of optimizer step ``step`` on process ``rank`` of ``world``, as training runs it:
    its examples at the micro-batch's drawn layout, collated, regrouped to its drawn chunk length (CPU).
    ``keep_index``: keep each example's index (``batch["index"]``; training drops it).

    The layout and chunk-length draws follow the micro-batch's place in the step (``micro·world + rank``,
    as its examples do), so a step's examples are the same whatever the number of processes."""
    idx = example_indices(step, cfg.batch_size, micro, cfg.micro_batch_size, rank, world)
    place = micro * world + rank
    batch = collate([make(i, *step_layout(cfg, step, place)) for i in idx])
    if not keep_index:
        batch.pop("index")
    length = step_chunk_length(cfg, step, place)
    return regroup_chunks(batch, length) if length is not None else batch


def taught_counts(cfg: TrainConfig, steps: int | None = None) -> dict[str, tuple[int, int]]:
    """How many examples of each kind the online teacher runs for over the first ``steps`` optimizer steps
    (default: all of ``cfg.steps``), one process: ``{kind: (examples, taught)}``, from the micro-batches
    training builds and the rule the stage module applies (:func:`cepe.training.models.teacher_rows`). Builds
    examples only: no model is loaded."""
    from .config import TASK_KINDS
    from .models import teacher_rows

    if not cfg.online_teacher:
        raise ValueError("taught_counts needs a config with online_teacher: true")
    if cfg.stage != "cepe":
        raise ValueError(f"taught_counts counts the examples of a cepe stage, got stage {cfg.stage!r}")
    make = example_maker(cfg)
    kinds = None if cfg.teacher_tasks is None else [TASK_KINDS.index(k) for k in cfg.teacher_tasks]
    out: dict[str, list[int]] = {}
    for step in range(cfg.steps if steps is None else steps):
        for micro in range(cfg.batch_size // cfg.micro_batch_size):
            batch = micro_batch(cfg, make, step, micro)
            n = batch["input_ids"].shape[0]
            rows = teacher_rows(batch, kinds, cfg.teacher_max_context)
            taught = torch.ones(n, dtype=torch.bool) if rows is None else rows
            names = [TASK_KINDS[int(t)] for t in batch["task"]] if "task" in batch else ["lm"] * n
            for name, t in zip(names, taught.tolist(), strict=True):
                c = out.setdefault(name, [0, 0])
                c[0] += 1
                c[1] += int(t)
    return {k: (v[0], v[1]) for k, v in out.items()}


def _setup(cfg: TrainConfig, resume: bool, allow_dtype_change: bool) -> _Run:
    """Everything before the first step, in a fixed order (resumed runs draw the same random numbers)."""
    acc = _accelerator(cfg)
    accum = cfg.grad_accum(acc.num_processes)
    out = Path(cfg.output_dir)
    digest = corpus_digest(cfg)
    existing, saved, snapshot = _resume_point(cfg, out, resume, digest)
    record = saved or snapshot or {}
    where = str(existing[-1][1]) if saved else f"snapshot {cfg.snapshot_dir}"
    use_bf16 = decide_bf16(cfg.bf16, acc.device, acc.num_processes)
    use_bf16 = settle_dtype(cfg.bf16, use_bf16, record.get("compute_dtype"), allow_dtype_change, where)

    model, params, module = _build_modules(cfg, use_bf16)
    optimizer, scheduler = _optimizer(cfg, model, params)
    module, optimizer = acc.prepare(module, optimizer)
    run = _Run(
        cfg=cfg,
        acc=acc,
        out=out,
        accum=accum,
        compute_dtype=DTYPE_NAMES[use_bf16],
        params=params,
        module=module,
        stage_module=acc.unwrap_model(module),
        optimizer=optimizer,
        scheduler=scheduler,
        data_digest=digest,
    )
    run.start = _restore(run, existing, saved, snapshot)
    _open_output(run)

    run.flops = step_flops(cfg, run.inner)
    run.peak = _measure_peak(run, use_bf16)
    _print(
        run.main,
        f"{cfg.stage}: compute {run.compute_dtype}"
        + ("" if cfg.reference_path else " (fast paths)" if cfg.stage != "mlm" else "")
        + f", {_threads_note()}{_allocator_note(run.acc.device)}, {run.world} process(es); "
        f"{run.flops['total'] / 1e12:.3f} TFLOP per step by the cost model ({COST_MODEL})"
        + (f"; {run.compute_dtype} matmul peak {run.peak / 1e9:.0f} GFLOP/s" if run.peak else ""),
    )
    run.make = example_maker(cfg, run.inner)
    if run.start == 0 and cfg.match_gate_calibrate:
        _calibrate_match_gate(run)
    run.recent = [(r["loss"], r.get("step_s", 0.0)) for r in read_log(out)][-10:]
    return run


def _calibrate_match_gate(run: _Run) -> None:
    """``match_gate_calibrate``: standardise fresh match-gate features on the stage's first micro-batches
    (the same examples on every process, in eval mode, the random state untouched)."""
    cfg, model = run.cfg, run.inner
    if not getattr(model.cepe_config, "match_gate", False):
        raise ValueError("match_gate_calibrate needs match gates: set cepe: {match_gate: true}")
    fresh = all(
        torch.equal(m.match_norm, torch.tensor([0.0, 1.0, 0.0, 1.0]).to(m.match_norm).repeat(m.num_heads, 1))
        for m in model.cross_attention_modules()
    )
    if not fresh:
        _print(run.main, "match gates: the init adapter's calibrated norms kept")
        return

    per_step = cfg.batch_size // cfg.micro_batch_size  # a step's micro-batches, over all processes

    def forward() -> None:
        for i in range(cfg.match_gate_calibrate):  # the first micro-batches, as training builds them
            batch = micro_batch(cfg, run.make, i // per_step, i % per_step)
            run.module({k: v.to(run.acc.device) for k, v in batch.items()})
            run.stage_module.release()

    model.eval()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        norms = model.calibrate_match_gate(forward)
    mean = torch.stack(list(norms.values())).mean((0, 1)).tolist()
    _print(
        run.main,
        f"match gates calibrated on {cfg.match_gate_calibrate} micro-batches: mean over heads "
        f"m {mean[0]:.2f} ± {mean[1]:.2f}, κ̂ {mean[2]:.3f} ± {mean[3]:.3f}",
    )


# ---------------------------------------------------------------------------------------------- a step
def _step(run: _Run, step: int) -> _StepResult:
    """One optimizer step: ``accum`` micro-batches (gradients synchronised on the last), clipping, AdamW,
    the schedule; the loss and metrics averaged over processes."""
    cfg, acc, module = run.cfg, run.acc, run.module
    set_train_mode(run.inner)
    t0 = time.perf_counter()
    losses: list[torch.Tensor] = []
    extra: dict[str, list[torch.Tensor]] = {}
    tokens = 0
    for micro in range(run.accum):
        batch = micro_batch(cfg, run.make, step, micro, run.rank, run.world)
        batch = {k: v.to(acc.device) for k, v in batch.items()}
        tokens += _tokens(batch)
        sync = acc.no_sync(module) if micro < run.accum - 1 else contextlib.nullcontext()
        with sync:
            loss, metrics = module(batch)
            acc.backward(loss / run.accum)
        run.stage_module.release()
        losses.append(loss.detach().float())
        for k, v in metrics.items():
            extra.setdefault(k, []).append(v.float())
    grad_norm = None
    if cfg.optim.max_grad_norm:
        grad_norm = acc.clip_grad_norm_(run.params, cfg.optim.max_grad_norm)
    lr = run.scheduler.get_last_lr()[0]
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    if acc.device.type == "cpu":  # jemalloc's kept pages back to the kernel: a step's footprint, not more
        purge()

    loss_value = acc.reduce(torch.stack(losses).mean(), "mean")
    return _StepResult(
        loss=float(loss_value),
        metrics=_reduce_metrics(run, extra),
        lr=lr,
        grad_norm=None if grad_norm is None else float(grad_norm),
        tokens=tokens,
        dt=time.perf_counter() - t0,
    )


def _reduce_metrics(run: _Run, extra: dict[str, list[torch.Tensor]]) -> dict[str, float]:
    """Each metric's mean over its micro-batches, then over the processes that logged it. A process logs
    only the kinds its micro-batches held (``lm_recall`` ...), so the processes first agree on the keys:
    every process then runs the same one reduction."""
    keys = list(extra)
    if run.world > 1:
        from accelerate.utils import gather_object

        keys = sorted({k for ks in gather_object([keys]) for k in ks})
    rows = [[float(torch.stack(extra[k]).mean()), 1.0] if k in extra else [0.0, 0.0] for k in keys]
    if not rows:
        return {}
    sums = run.acc.reduce(torch.tensor(rows, dtype=torch.float32, device=run.acc.device), "sum")
    return {k: float(sums[i, 0] / sums[i, 1]) for i, k in enumerate(keys)}


def _after_step(run: _Run, signals: Signals, done: int) -> float:
    """Write the status and wait while paused (SIGUSR1 / SIGUSR2); the seconds paused."""
    if not run.main:
        return signals.wait_while_paused()
    write_status(run.out, run.status("running", done))  # "done" once the stage's output is saved

    def on_pause() -> None:
        write_status(run.out, run.status("paused", done))
        _print(True, f"{run.cfg.stage}: paused after step {done} (SIGUSR2 resumes)")

    paused = signals.wait_while_paused(on_pause)
    if paused > 0 and signals.stop is None:  # resumed: say so now, not after the next step
        write_status(run.out, run.status("running", done))
        _print(True, f"{run.cfg.stage}: resumed after {paused:.0f} s paused")
    return paused


# ---------------------------------------------------------------------------------------------- save
def _print_speed(run: _Run, timed: list[float]) -> None:
    if not (timed and run.main):
        return
    flops, peak, mean = run.flops, run.peak, sum(timed) / len(timed)
    _print(
        True,
        f"{run.cfg.stage}: {len(timed)} timed steps, {mean:.2f} s/step, "
        f"{flops['decoder_tokens'] / mean:.0f} decoder tok/s, {flops['encoder_tokens'] / mean:.0f} encoder "
        f"tok/s, {flops['total'] / mean / 1e9:.0f} GFLOP/s"
        + (
            f" = {100 * flops['total'] / mean / peak:.1f}% of the {run.compute_dtype} matmul peak"
            if peak
            else ""
        ),
    )


def _save_artifact(run: _Run) -> None:
    """The stage's output (a cepe adapter, or the encoder for ``mlm``) and every process's weight digest."""
    from accelerate.utils import gather_object

    digests = gather_object([parameter_digest(run.params)])
    if run.main:
        run.inner.eval()
        if run.cfg.stage == "mlm":
            save_encoder(run.inner, run.out)
        else:
            run.inner.save_pretrained(run.out)
        fileio.write_text(run.out / DIGESTS_FILE, json.dumps(digests, indent=2) + "\n")  # atomic
        if len(set(digests)) > 1:
            warnings.warn(f"processes ended with different trainable weights: {digests}", stacklevel=3)
    run.acc.wait_for_everyone()


PROFILE_FILE = "profile.txt"


def _write_profile(out: Path, prof: Any, steps: int, stage: str) -> Path:
    """Write the per-op table of a ``torch.profiler`` run (self CPU time, top 40 ops) to ``profile.txt``."""
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    path = out / PROFILE_FILE
    tmp = out / f".{PROFILE_FILE}.tmp"
    tmp.write_text(
        f"# {stage}: torch.profiler over {steps} optimizer step(s), sorted by self CPU time\n{table}\n"
    )
    os.replace(tmp, path)
    print(f"{stage}: wrote the profile of {steps} step(s) to {path}", flush=True)
    return path
