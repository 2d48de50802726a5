"""scripts/train_chain.sh and scripts/rebuild_choice.sh refuse to start a second chain (two trainers on
the same stage directories) while one runs, and say which."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tree(tmp_path: Path) -> Path:
    """A scratch checkout with the scripts, one recipe config and an empty virtual environment."""
    for rel in (
        "scripts/train_chain.sh",
        "scripts/rebuild_choice.sh",
        "configs/train/recipe/fast_warmup.yaml",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    (tmp_path / ".venv/bin").mkdir(parents=True)
    (tmp_path / ".venv/bin/activate").write_text("")
    (tmp_path / "runs/recipe").mkdir(parents=True)
    return tmp_path


def test_a_second_chain_is_refused_while_one_runs(tmp_path):
    root = _tree(tmp_path)
    (root / "runs/recipe/chain.pid").write_text(str(os.getpid()))  # a live process stands in for the chain
    proc = subprocess.run(
        ["bash", "scripts/train_chain.sh", "fast_warmup"], cwd=root, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert f"a chain is running already (pid {os.getpid()}" in proc.stderr
    assert not (root / "runs/recipe/chain.log").exists()  # nothing started


def test_the_rebuild_is_not_started_twice(tmp_path):
    root = _tree(tmp_path)
    (root / "runs/recipe/rebuild.pid").write_text(str(os.getpid()))
    proc = subprocess.run(["bash", "scripts/rebuild_choice.sh"], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0 and f"already running (pid {os.getpid()})" in proc.stdout
    assert not (root / "runs/recipe/rebuild.log").exists()
