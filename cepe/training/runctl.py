"""Run control of a training stage: the compute dtype decided once, signals (stop / pause / resume),
the status file that ``cepe train --status`` reads, and weights-only snapshots that carry a stage to a new
machine.

Signals (to the training process, e.g. ``kill -USR1 PID``): ``SIGTERM`` / ``SIGINT`` finish the running
step, write a checkpoint and exit (``--resume`` continues with identical losses); ``SIGUSR1`` pauses after
the running step (nothing is lost; the status says ``paused``); ``SIGUSR2`` resumes. ``SIGSTOP`` /
``SIGCONT`` also pause and resume at any point, without a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from cepe.fileio import write_json

STATUS_FILE = "status.json"
SNAPSHOT_FILE = "snapshot.json"
DTYPE_NAMES = {True: "bfloat16", False: "float32"}


# ------------------------------------------------------------------------------------------ dtype
def decide_bf16(setting: bool | str, device: torch.device, world: int) -> bool:
    """``bf16`` as given, or for ``"auto"`` the choice of rank 0 broadcast to every process (one
    timing, one answer: processes never train in different precisions)."""
    from cepe.compute import resolve_bf16

    choice = [resolve_bf16(setting, device)]
    if world > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(choice, from_process=0)
    return bool(choice[0])


def settle_dtype(
    setting: bool | str, decided: bool, recorded: str | None, allow_change: bool, where: str
) -> bool:
    """The compute dtype of a resumed run: what the run recorded, unless told otherwise.

    Args:
        setting: the config's ``bf16`` (``True`` / ``False`` / ``"auto"``).
        decided: what this machine resolved now (:func:`decide_bf16`).
        recorded: ``"bfloat16"`` / ``"float32"`` from the checkpoint or snapshot (None: a run from before
            the dtype was recorded, or a fresh run).
        allow_change: accept a change of dtype (``--allow-dtype-change``).
        where: the checkpoint, for the error message.

    Raises:
        ValueError: the run was trained in another dtype than would be used now, and ``allow_change`` is
            False. ``"auto"`` without ``CEPE_BF16`` is not a request: it keeps the recorded dtype.
    """
    if recorded is None or allow_change:
        return decided
    if recorded not in DTYPE_NAMES.values():
        raise ValueError(f"{where} records an unknown compute dtype {recorded!r}")
    rec = recorded == "bfloat16"
    if rec == decided:
        return decided
    forced = os.environ.get("CEPE_BF16", "").strip()
    if setting == "auto" and not forced:
        return rec  # the machine's timing changed its mind; the run keeps its dtype
    how = f"CEPE_BF16={forced}" if forced else f"bf16: {setting}"
    raise ValueError(
        f"{where} was trained in {recorded} but this run would compute in {DTYPE_NAMES[decided]} ({how}); "
        "resume in the same dtype, or pass --allow-dtype-change (train(..., allow_dtype_change=True)) to "
        "continue in the new one"
    )


# ------------------------------------------------------------------------------------------ signals
class Signals:
    """Flags set by SIGTERM / SIGINT (``stop``) and SIGUSR1 / SIGUSR2 (pause / resume), read between steps.

    Installed only in the main thread (signal handlers cannot be set elsewhere); the previous handlers
    come back on :meth:`restore`.
    """

    def __init__(self) -> None:
        self.stop: int | None = None  # the signal number that asked to stop
        self.paused = False
        self._old: dict[int, Any] = {}

    def install(self) -> Signals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig, fn in (
            (signal.SIGTERM, self._on_stop),
            (signal.SIGINT, self._on_stop),
            (signal.SIGUSR1, self._on_pause),
            (signal.SIGUSR2, self._on_resume),
        ):
            self._old[sig] = signal.signal(sig, fn)
        return self

    def restore(self) -> None:
        for sig, fn in self._old.items():
            signal.signal(sig, fn)
        self._old = {}

    def _on_stop(self, signum, frame) -> None:
        if self.stop is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C does not wait for the step
        self.stop = signum
        self.paused = False

    def _on_pause(self, signum, frame) -> None:
        self.paused = True

    def _on_resume(self, signum, frame) -> None:
        self.paused = False

    def wait_while_paused(self, on_pause=None) -> float:
        """Block while paused (and not stopping); returns the seconds spent paused."""
        if not self.paused:
            return 0.0
        t0 = time.monotonic()
        if on_pause is not None:
            on_pause()
        while self.paused and self.stop is None:
            time.sleep(0.2)
        return time.monotonic() - t0


class Stopped(Exception):
    """The run stopped on a signal after checkpointing step ``step``."""

    def __init__(self, step: int, signum: int) -> None:
        super().__init__(f"stopped by signal {signum} after checkpointing step {step}; rerun with --resume")
        self.step, self.signum = step, signum


# ------------------------------------------------------------------------------------------ files
def write_json_atomic(path: str | Path, data: dict[str, Any]) -> None:
    """Atomically write ``data`` as sorted, indented JSON (see :mod:`cepe.fileio`)."""
    write_json(path, data, indent=2, sort_keys=True)


def write_status(output_dir: str | Path, status: dict[str, Any]) -> None:
    """Atomically write ``output_dir/status.json`` (what ``cepe train --status`` shows)."""
    write_json_atomic(Path(output_dir) / STATUS_FILE, {**status, "pid": os.getpid(), "updated": time.time()})


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists (also when it belongs to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def read_status(output_dir: str | Path) -> dict[str, Any] | None:
    """The status of the run in ``output_dir`` (None if it never started); a run whose process is gone
    while it claimed to be running is reported as ``stopped``."""
    path = Path(output_dir) / STATUS_FILE
    if not path.is_file():
        return status_from_log(output_dir)
    st = json.loads(path.read_text())
    if st.get("state") in ("running", "paused") and st.get("pid") and not pid_alive(int(st["pid"])):
        st["state"] = "stopped (process gone)"
    return st


def status_from_log(output_dir: str | Path) -> dict[str, Any] | None:
    """A status rebuilt from ``train_config.json`` and ``log.jsonl`` alone (runs of trainers that wrote no
    ``status.json``); the state is a guess from how recently the log was written."""
    root = Path(output_dir)
    cfg_file, log_file = root / "train_config.json", root / "log.jsonl"
    if not (cfg_file.is_file() and log_file.is_file()):
        return None
    cfg = json.loads(cfg_file.read_text())
    log = [json.loads(ln) for ln in log_file.read_text().splitlines() if ln.strip()]
    if not log:
        return None
    stage, b = cfg["stage"], int(cfg["batch_size"])
    if stage == "mlm":
        dec, enc = 0, b * int(cfg["mlm_seq_length"])
    elif stage == "warmup":
        dec = b * int(cfg.get("warmup_decoder_tokens") or cfg["warmup_tokens"])
        enc = b * int(cfg["warmup_tokens"])
    else:
        dec, enc = b * int(cfg["n_decoder"]), b * int(cfg["n_chunks"]) * int(cfg["chunk_length"])
    recent = log[-10:]
    secs = [r["step_s"] for r in recent if r.get("step_s")]
    step_s = sum(secs) / len(secs) if secs else None
    step, steps = int(log[-1]["step"]), int(cfg["steps"])
    age = time.time() - log_file.stat().st_mtime
    fresh = step_s is not None and age < max(120.0, 5 * step_s * int(cfg.get("log_every") or 1))
    return {
        "stage": stage,
        "state": "done" if step >= steps else ("running (from log)" if fresh else "stopped (from log)"),
        "step": step,
        "steps": steps,
        "decoder_tokens_seen": step * dec,
        "encoder_tokens_seen": step * enc,
        "loss_recent": sum(r["loss"] for r in recent) / len(recent),
        "decoder_tokens_per_s": dec / step_s if step_s else None,
        "encoder_tokens_per_s": enc / step_s if step_s else None,
        "eta_s": (steps - step) * step_s if step_s else None,
        "updated": log_file.stat().st_mtime,
    }


def format_status(output_dir: str | Path, st: dict[str, Any]) -> str:
    """One line: stage, state, step, tokens seen, recent loss, tokens/s, ETA."""
    loss = st.get("loss_recent")
    age = time.time() - float(st.get("updated", time.time()))
    parts = [
        f"{output_dir}: {st.get('stage')} {st.get('state')}",
        f"step {st.get('step')}/{st.get('steps')}",
        f"tokens seen {st.get('decoder_tokens_seen', 0):,} dec + {st.get('encoder_tokens_seen', 0):,} enc",
        f"loss {loss:.4f}" if loss is not None else "loss ?",
        f"{st.get('decoder_tokens_per_s') or 0:.0f} dec tok/s, {st.get('encoder_tokens_per_s') or 0:.0f} enc tok/s",
    ]
    if st.get("peak_fraction") is not None:
        parts.append(f"{100 * st['peak_fraction']:.1f}% of matmul peak")
    if str(st.get("state")).startswith("running"):
        parts.append(f"ETA {_duration(st.get('eta_s'))}")
    parts.append(f"updated {_duration(age)} ago")
    return ", ".join(parts)


# ------------------------------------------------------------------------------------------ snapshots
def save_snapshot(snapshot_dir: str | Path, model: torch.nn.Module, state: dict[str, Any]) -> Path:
    """Replace ``snapshot_dir`` atomically with the trainable weights of ``model`` and ``snapshot.json``
    (``state``: stage, step, fingerprint, compute dtype). A cepe adapter, or for the MLM stage the files
    :func:`cepe.training.models.save_encoder` writes."""
    from cepe.modeling import CepeForCausalLM

    from .models import save_encoder

    final = Path(snapshot_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    _recover_snapshot(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        if isinstance(model, CepeForCausalLM):
            model.save_pretrained(tmp)
        else:
            save_encoder(model, tmp)
        write_json_atomic(tmp / SNAPSHOT_FILE, state)
        old = final.with_name(f".{final.name}.old")
        if old.exists():
            shutil.rmtree(old)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _recover_snapshot(final: Path) -> None:
    """Put back the previous snapshot where a save was killed between its two renames (``final`` gone, its
    previous copy still kept aside as ``.NAME.old``)."""
    old = final.with_name(f".{final.name}.old")
    if not final.exists() and (old / SNAPSHOT_FILE).is_file():
        os.replace(old, final)


def read_snapshot(snapshot_dir: str | Path | None) -> dict[str, Any] | None:
    """``snapshot.json`` of ``snapshot_dir``, or None when there is none (a save killed between its renames
    leaves the previous snapshot, which is put back and read)."""
    if not snapshot_dir:
        return None
    _recover_snapshot(Path(snapshot_dir))
    path = Path(snapshot_dir) / SNAPSHOT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def load_snapshot(snapshot_dir: str | Path, model: torch.nn.Module) -> None:
    """Load the weights of a snapshot into ``model`` (strict)."""
    from safetensors.torch import load_file

    from cepe.modeling import ADAPTER_WEIGHTS, CepeForCausalLM

    from .models import MLM_WEIGHTS

    root = Path(snapshot_dir)
    _recover_snapshot(root)
    if isinstance(model, CepeForCausalLM):
        model.load_adapter_state_dict(load_file(root / ADAPTER_WEIGHTS))
    else:
        model.load_state_dict(load_file(root / MLM_WEIGHTS))
