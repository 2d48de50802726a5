"""The ``slow`` and ``multiproc`` markers are enforced (tests/conftest.py): an unmarked test cannot load the
real default decoder or start Python, so the quick tier (``-m "not slow and not multiproc"``) never does."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_unmarked_test_cannot_start_python_or_load_the_default_decoder():
    with pytest.raises(RuntimeError, match="mark it @pytest.mark.multiproc"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    from cepe.assets import load_decoder_model, resolve_decoder

    with pytest.raises(RuntimeError, match="mark it @pytest.mark.slow"):
        resolve_decoder("default")
    with pytest.raises(RuntimeError, match="mark it @pytest.mark.slow"):
        load_decoder_model("default")
    assert subprocess.run(["git", "--version"], capture_output=True).returncode == 0  # other programs run


@pytest.mark.multiproc
def test_marked_test_starts_python():
    out = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "42"


def test_markers_are_declared_and_strict():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    conf = (root / "pyproject.toml").read_text()
    assert 'addopts = "--strict-markers"' in conf
    assert '"slow: ' in conf and '"multiproc: ' in conf
    script = (root / "scripts" / "test.sh").read_text()
    assert '-m "not slow and not multiproc"' in script and '-m "slow or multiproc"' in script
