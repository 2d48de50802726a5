"""Which compute dtype is fast here: bf16 where the hardware multiplies bf16 natively, fp32 elsewhere.

On CPUs with bf16 matrix units (AMX, AVX512-BF16) a bf16 matmul is several times faster than fp32; on
CPUs without them (AVX2 only) PyTorch emulates bf16 and the same matmul can be a hundred times slower.
Every ``"auto"`` dtype setting of ``cepe`` (the main job, training's ``bf16``, the benchmark's ``dtype``)
asks :func:`bf16_is_fast`. On x86 it reads the CPU's flags (AVX512-BF16, AMX), as PyTorch reports them;
elsewhere it times a small matmul in both dtypes, in interleaved pairs, once per process. The flags come
first because timing runs bf16 kernels before the model's: on an AMX CPU, after the timing, the first
forward passes of an evaluation gave another value in some runs (the first cell of ``lm_val``, 27.9515 or
27.9774 against 27.9656, in 6 of 19 fresh runs; in none of 16 without the timing; "Compute dtype" in
docs/TRAINING.md).

The environment variable ``CEPE_BF16`` overrides the measurement: ``1`` forces bf16, ``0`` forces fp32.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time

import torch

_FAST: dict[str, bool] = {}


def _seconds(a: torch.Tensor, b: torch.Tensor) -> float:
    t0 = time.perf_counter()
    torch.mm(a, b)
    return time.perf_counter() - t0


def _bf16_wins(a: torch.Tensor, b: torch.Tensor, rounds: int = 7) -> bool:
    """Time ``a @ b`` in fp32 and bf16 in interleaved pairs; True when bf16 wins most rounds.

    Interleaving puts a burst of load from another process on both dtypes alike, and a majority of
    rounds, unlike one best time each, is not decided by a single disturbed measurement."""
    a16, b16 = a.bfloat16(), b.bfloat16()
    for _ in range(2):  # kernel selection, allocation, clocks
        torch.mm(a, b)
        torch.mm(a16, b16)
    wins = sum(_seconds(a16, b16) < _seconds(a, b) for _ in range(rounds))
    return 2 * wins > rounds


def cpu_bf16_units() -> bool | None:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), from the flags PyTorch reads;
    None where PyTorch does not say (not x86, or a PyTorch without these queries)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return None
    flags = [
        getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    ]
    if any(f is None for f in flags):
        return None
    return any(bool(f()) for f in flags)


def bf16_is_fast(device: str | torch.device = "cpu") -> bool:
    """True when bf16 matrix products are faster than fp32 on ``device``.

    CUDA: the device reports native bf16 support. CPU: on x86 the CPU's bf16 units
    (:func:`cpu_bf16_units`); elsewhere a ``512 x 512 @ 512 x 512`` product is timed in both dtypes, in
    seven interleaved pairs, and bf16 must win most of them (20-40 ms on a 2-core CPU, once per process).
    ``CEPE_BF16=1`` / ``0`` overrides all three.
    """
    env = os.environ.get("CEPE_BF16", "").strip().lower()
    if env in ("1", "true", "yes"):
        return True
    if env in ("0", "false", "no"):
        return False
    if env:
        raise ValueError(f"CEPE_BF16 must be 1 or 0 (or unset to measure), got {env!r}")
    dev = torch.device(device)
    key = dev.type
    if key not in _FAST:
        if dev.type == "cuda":
            _FAST[key] = bool(torch.cuda.is_bf16_supported())
        elif dev.type == "cpu" and (units := cpu_bf16_units()) is not None:
            _FAST[key] = units
        elif dev.type == "cpu":
            g = torch.Generator().manual_seed(0)
            a, b = torch.randn(512, 512, generator=g), torch.randn(512, 512, generator=g)
            _FAST[key] = _bf16_wins(a, b)
        else:
            _FAST[key] = False
    return _FAST[key]


def resolve_bf16(setting: bool | str, device: str | torch.device = "cpu") -> bool:
    """``True`` / ``False`` as given; ``"auto"`` -> :func:`bf16_is_fast` on ``device``."""
    if setting == "auto":
        return bf16_is_fast(device)
    if isinstance(setting, bool):
        return setting
    raise ValueError(f"bf16 must be true, false or 'auto', got {setting!r}")


def autocast_dtype(device: str | torch.device = "cpu") -> torch.dtype | None:
    """``torch.bfloat16`` where bf16 is fast on ``device``, else None (run in fp32)."""
    return torch.bfloat16 if bf16_is_fast(device) else None


def autocast(device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
    """bf16 autocast on ``device`` where bf16 is fast there (:func:`autocast_dtype`), else a no-op (fp32): what
    the evaluations' ``--autocast auto`` runs, for probes and scripts."""
    dtype = autocast_dtype(device)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def describe(device: str | torch.device = "cpu") -> str:
    """One line for logs: which dtype ``"auto"`` picks on ``device`` and why."""
    if os.environ.get("CEPE_BF16", "").strip():
        return f"{'bf16' if bf16_is_fast(device) else 'fp32'} (set by CEPE_BF16)"
    if bf16_is_fast(device):
        return "bf16 autocast (bf16 matmul is faster than fp32 here)"
    return "fp32 (bf16 matmul is slower than fp32 on this machine; CEPE_BF16=1 forces bf16)"
