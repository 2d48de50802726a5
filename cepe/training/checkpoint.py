"""Atomic training checkpoints: trainable weights, optimizer, scheduler, RNG states, data position, step.

Layout of ``OUTPUT/checkpoints/step_000120/``: ``adapter/`` (a cepe adapter, ``save_pretrained``) or
``mlm/`` (the MLM model), ``optimizer.pt``, ``scheduler.pt``, ``rng_rank{r}.pt``, ``trainer_state.json``.
A checkpoint is written into a temporary sibling directory and renamed into place, so a killed run never
leaves a partial checkpoint under a ``step_*`` name.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from cepe.modeling import ADAPTER_WEIGHTS, CepeForCausalLM

STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def rng_state() -> dict[str, Any]:
    """This process's Python, NumPy and torch RNG states."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states from :func:`rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def checkpoint_dirs(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``output_dir/checkpoints`` as ``(step, path)``, oldest first."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: dict[str, Any],
    rng_states: list[dict[str, Any]],
    keep: int = 2,
    keep_steps: tuple[int, ...] = (),
) -> Path:
    """Write checkpoint ``step`` atomically and delete all but the newest ``keep`` (and ``keep_steps``).

    Args:
        model: the unwrapped stage model (:class:`CepeForCausalLM` or the MLM model).
        state: JSON-serialisable trainer state (step, data position, config fingerprint, ...).
        rng_states: one :func:`rng_state` per process (rank order).
    """
    root = Path(output_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step_{step:06d}-", dir=root))
    try:
        if isinstance(model, CepeForCausalLM):
            model.save_pretrained(tmp / "adapter")
        else:
            (tmp / "mlm").mkdir()
            tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
            save_file(tensors, tmp / "mlm" / "model.safetensors", metadata={"format": "pt"})
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        for r, s in enumerate(rng_states):
            torch.save(s, tmp / f"rng_rank{r}.pt")
        with open(tmp / STATE_FILE, "w") as f:
            json.dump(state, f, indent=2, sort_keys=True)
        old = _set_aside(final) if final.exists() else None
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    rotated = [(s, p) for s, p in checkpoint_dirs(output_dir) if s not in keep_steps]
    for _, gone in rotated[:-keep]:
        shutil.rmtree(_set_aside(gone), ignore_errors=True)
    for stale in root.glob(".old-step_*"):  # set aside by a save that was killed before removing it
        shutil.rmtree(stale, ignore_errors=True)
    return final


def _set_aside(path: Path) -> Path:
    """Rename a checkpoint out of the ``step_*`` names before deleting it: a kill part-way through the
    deletion must not leave a ``step_*`` directory that still holds its state file but lost its weights
    (:func:`checkpoint_dirs` would take it for complete)."""
    aside = Path(tempfile.mkdtemp(prefix=f".old-{path.name}-", dir=path.parent))
    os.replace(path, aside / path.name)
    return aside


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    rank: int = 0,
) -> dict[str, Any]:
    """Restore a checkpoint into ``model`` (unwrapped), ``optimizer`` and ``scheduler``, and this rank's RNG.

    Returns:
        The trainer state dict saved with it.
    """
    path = Path(path)
    if isinstance(model, CepeForCausalLM):
        model.load_adapter_state_dict(load_file(path / "adapter" / ADAPTER_WEIGHTS))
    else:
        model.load_state_dict(load_file(path / "mlm" / "model.safetensors"))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((path / STATE_FILE).read_text())
