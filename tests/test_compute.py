"""The "auto" compute dtype: measured once, overridable, validated."""

from __future__ import annotations

import pytest
import torch

from cepe import compute
from cepe.training.config import load_config


def test_override_and_resolution(monkeypatch):
    monkeypatch.setenv("CEPE_BF16", "1")
    assert compute.bf16_is_fast("cpu") and compute.resolve_bf16("auto") is True
    assert compute.autocast_dtype("cpu") is torch.bfloat16
    monkeypatch.setenv("CEPE_BF16", "0")
    assert compute.resolve_bf16("auto") is False and compute.autocast_dtype("cpu") is None
    assert compute.resolve_bf16(True) is True and compute.resolve_bf16(False) is False
    x = torch.randn(4, 4)
    with compute.autocast("cpu"):
        assert (x @ x).dtype is torch.float32  # fp32: no autocast
    monkeypatch.setenv("CEPE_BF16", "1")
    with compute.autocast("cpu"):
        assert (x @ x).dtype is torch.bfloat16
    monkeypatch.setenv("CEPE_BF16", "maybe")
    with pytest.raises(ValueError, match="CEPE_BF16 must be 1 or 0"):
        compute.bf16_is_fast("cpu")


def test_measurement_is_cached_and_boolean(monkeypatch):
    monkeypatch.delenv("CEPE_BF16", raising=False)
    first = compute.bf16_is_fast("cpu")
    assert isinstance(first, bool) and compute._FAST["cpu"] is first
    assert compute.bf16_is_fast("cpu") is first
    with pytest.raises(ValueError, match="bf16 must be true, false or 'auto'"):
        compute.resolve_bf16("yes")


def test_training_config_bf16_values(tmp_path):
    from pathlib import Path

    tiny = Path(__file__).resolve().parents[1] / "configs" / "train" / "tiny" / "mlm.yaml"
    assert load_config(tiny, [f"output_dir={tmp_path}"]).bf16 is False  # tiny configs: fp32 on any CPU
    assert load_config(tiny, [f"output_dir={tmp_path}", "bf16=auto"]).bf16 == "auto"
    with pytest.raises(ValueError, match="bf16 must be true, false or auto"):
        load_config(tiny, [f"output_dir={tmp_path}", "bf16=sometimes"])
    with pytest.raises(ValueError, match="decoder_dtype bfloat16 needs bf16"):
        load_config(tiny, [f"output_dir={tmp_path}", "decoder_dtype=bfloat16"])


def test_measurement_is_a_majority_of_interleaved_rounds(monkeypatch):
    """One disturbed round (another process's burst) does not decide; most rounds do."""
    a = b = torch.ones(4, 4)

    def timer(bf16_times):
        it = iter(bf16_times)
        return lambda x, y: next(it) if x.dtype == torch.bfloat16 else 1.0

    monkeypatch.setattr(compute, "_seconds", timer([0.5, 0.5, 9.0, 0.5, 0.5, 0.5, 0.5]))
    assert compute._bf16_wins(a, b) is True
    monkeypatch.setattr(compute, "_seconds", timer([2.0, 2.0, 0.1, 2.0, 2.0, 2.0, 2.0]))
    assert compute._bf16_wins(a, b) is False
    monkeypatch.setattr(compute, "_seconds", timer([0.5, 2.0, 0.5, 2.0, 0.5, 2.0, 2.0]))
    assert compute._bf16_wins(a, b) is False  # 3 of 7 is not a majority


def test_x86_reads_the_cpu_flags_and_times_nothing(monkeypatch):
    """On x86 the CPU's bf16 units decide, and no bf16 kernel runs before the model's (after the timing,
    an AMX CPU's first forward pass sometimes gave another value); elsewhere the timing decides."""
    monkeypatch.delenv("CEPE_BF16", raising=False)

    def no_timing(*a):
        raise AssertionError("timed on a CPU whose flags say it")

    monkeypatch.setattr(compute, "_seconds", no_timing)
    monkeypatch.setattr(compute.platform, "machine", lambda: "x86_64")
    for avx512_bf16, amx, fast in ((True, True, True), (True, False, True), (False, False, False)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        monkeypatch.setattr(compute, "_FAST", {})
        assert compute.cpu_bf16_units() is fast and compute.bf16_is_fast("cpu") is fast
    timed = []
    monkeypatch.setattr(compute, "_bf16_wins", lambda a, b: timed.append(a.shape) or True)
    for machine, missing in (("aarch64", None), ("x86_64", "_is_amx_tile_supported")):
        monkeypatch.setattr(compute.platform, "machine", lambda m=machine: m)
        if missing:
            monkeypatch.delattr(torch.cpu, missing)
        monkeypatch.setattr(compute, "_FAST", {})
        assert compute.cpu_bf16_units() is None and compute.bf16_is_fast("cpu") is True
    assert timed == [(512, 512), (512, 512)]
