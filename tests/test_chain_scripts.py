"""scripts/train_chain.sh and scripts/rebuild_choice.sh refuse to start a second chain (two trainers on
the same stage directories) while one runs, and say which."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
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


def _run_chain_with_exit(tmp_path: Path, code: int) -> str:
    """Run a two-stage chain whose ``cepe train`` exits with ``code``; return the chain's log."""
    root = _tree(tmp_path)
    shutil.copy(ROOT / "configs/train/recipe/fast_direct_copy.yaml", root / "configs/train/recipe/")
    (root / "runs/data/mini").mkdir(parents=True)
    (root / "runs/data/mini/summary.json").write_text("{}")
    fake = root / "fakebin/cepe"
    fake.parent.mkdir()
    fake.write_text(f'#!/usr/bin/env bash\necho "cepe $*"\nexit {code}\n')
    fake.chmod(0o755)
    (root / ".venv/bin/activate").write_text(f'export PATH="{fake.parent}:$PATH"\n')
    subprocess.run(
        ["bash", "scripts/train_chain.sh", "fast_warmup", "fast_direct_copy"], cwd=root, check=True
    )
    pid = int((root / "runs/recipe/chain.pid").read_text())
    for _ in range(600):  # the chain runs in the background: wait for it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    return (root / "runs/recipe/chain.log").read_text()


def test_a_stage_stopped_by_a_signal_stops_the_chain_as_a_stop_not_a_failure(tmp_path):
    log = _run_chain_with_exit(tmp_path, 128 + 15)  # cepe train after SIGTERM and its checkpoint
    assert "fast_warmup: stopped by signal 15 before its end" in log
    assert "failed" not in log and "fast_direct_copy" not in log  # the next stage does not start


def test_a_failing_stage_is_reported_with_its_exit_code(tmp_path):
    log = _run_chain_with_exit(tmp_path, 1)
    assert "fast_warmup: failed (exit 1), see runs/recipe/fast_warmup.log" in log
    assert "fast_direct_copy" not in log
