"""Measurement shared by ``cepe bench`` and ``cepe eval``: seeding, timing, peak memory, kept bytes.

Peak memory, two complementary numbers:

1. **Kept bytes** (exact, allocator-independent, :func:`tensor_bytes`): the sum of ``nbytes`` of every
   tensor a region leaves behind (decoder K/V cache, Φ, cross-attention K/V), found by walking the
   returned objects; storages shared by several tensors are counted once.
2. **Peak resident memory** (measured): on Linux the kernel tracks the process's peak resident set size
   ``VmHWM`` in ``/proc/self/status``; writing ``5`` to ``/proc/self/clear_refs`` resets that peak to the
   current resident size. :class:`PeakRSS` (the benchmark, one fresh process per setting): release freed
   heap pages back to the system (``malloc_trim``), read ``VmRSS`` (the baseline), reset the peak, run the
   region, read ``VmHWM``; ``peak - baseline`` is what the region costs on top of the loaded model, and
   ``VmRSS`` after it, minus the baseline, is what it leaves resident. :class:`Meter` (evaluation, many
   regions per method): on CUDA ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``
   (bytes held by tensors); on CPU ``VmHWM`` reset per region and the delta over the RSS at its start.
   Where the reset is not permitted the lifetime peak is reported and flagged (``memory_source`` /
   ``method``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


@dataclass
class Meter:
    """Accumulates wall time and processed tokens of the measured regions of one method run.

    Usage::

        meter = Meter(device)
        with meter.measure(num_tokens):
            ...  # model calls
        meter.summary()  # {"tokens_per_s", "peak_memory_mb", ...}
    """

    device: torch.device | str = "cpu"
    seconds: float = 0.0
    tokens: int = 0
    peak_bytes: int = 0
    rss_delta_bytes: int = 0
    memory_source: str = field(default="")

    def measure(self, num_tokens: int) -> _Region:
        """Context manager timing a region that processes ``num_tokens`` tokens (context + input)."""
        return _Region(self, num_tokens)

    def summary(self) -> dict[str, float | int | str]:
        """Throughput and memory of everything measured so far."""
        return {
            "tokens": self.tokens,
            "seconds": round(self.seconds, 4),
            "tokens_per_s": round(self.tokens / self.seconds, 2) if self.seconds > 0 else 0.0,
            "peak_memory_mb": round(self.peak_bytes / 2**20, 2),
            "rss_delta_mb": round(self.rss_delta_bytes / 2**20, 2),
            "memory_source": self.memory_source,
        }


class _Region:
    def __init__(self, meter: Meter, num_tokens: int):
        self.meter, self.num_tokens = meter, num_tokens
        device = torch.device(meter.device)
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        # the meter's own device (``cuda:1``), not the current one; plain ``cuda`` is the current one
        self.args = (device,) if device.index is not None else ()

    def __enter__(self) -> _Region:
        if self.cuda:
            torch.cuda.synchronize(*self.args)
            torch.cuda.reset_peak_memory_stats(*self.args)
            self.meter.memory_source = "torch.cuda.max_memory_allocated"
            self.allocated0 = torch.cuda.memory_allocated(*self.args)  # resident before: the weights
        else:
            reset = reset_peak_rss()
            self.meter.memory_source = "VmHWM (reset per region)" if reset else "VmHWM (process lifetime)"
            self.rss0 = proc_status_bytes("VmRSS") or 0
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize(*self.args)
            peak = torch.cuda.max_memory_allocated(*self.args)
            delta = max(0, peak - self.allocated0)  # as on the CPU: above what was resident at the start
        else:
            peak = proc_status_bytes("VmHWM") or 0
            delta = max(0, peak - self.rss0)
        self.meter.seconds += time.perf_counter() - self.t0
        self.meter.tokens += int(self.num_tokens)
        self.meter.peak_bytes = max(self.meter.peak_bytes, peak)
        self.meter.rss_delta_bytes = max(self.meter.rss_delta_bytes, delta)


def cpu_count_note() -> str:
    """A short description of the compute used (for result files)."""
    n = os.cpu_count() or 0
    return f"{torch.cuda.get_device_name()}" if torch.cuda.is_available() else f"cpu x{n}"


def cpu_model_note(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The CPU's model name and its bf16 units, e.g. ``"AMD EPYC (avx512_bf16)"`` or ``"Intel(R) Xeon(R)
    Processor (amx_bf16, avx512_bf16)"`` (``"avx2"`` where it has neither), from ``/proc/cpuinfo``; None
    where that file does not say (not Linux). Result files record it: CPUs of other kinds round bf16
    differently (the decoder alone, the same weights, scored 10.125 on one and 10.129 on another), so two
    results compared to the fourth digit should say where they were computed."""
    try:
        with open(cpuinfo) as f:
            text = f.read()
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("model name", "flags") and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    if "model name" not in fields:
        return None
    flags = set(fields.get("flags", "").split())
    units = [f for f in ("amx_bf16", "avx512_bf16") if f in flags] or [f for f in ("avx2",) if f in flags]
    return f"{fields['model name']} ({', '.join(units)})" if units else fields["model name"]


def proc_status_bytes(key: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes, or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current resident size; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def release_free_memory() -> None:
    """Collect garbage and hand freed heap pages back to the system, so the next peak starts clean."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _tensors(obj: Any, seen: set[int]) -> Iterable[torch.Tensor]:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, seen)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from _tensors(v, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        for v in vars(obj).values():
            yield from _tensors(v, seen)


def tensor_bytes(*objs: Any) -> int:
    """Bytes of the distinct tensor storages reachable from ``objs`` (containers, dataclasses, caches)."""
    seen: set[int] = set()
    storages: dict[int, int] = {}
    for obj in objs:
        for t in _tensors(obj, seen):
            st = t.untyped_storage()
            storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
    return sum(storages.values())


class PeakRSS:
    """Context manager measuring the resident-memory cost of a region (see the module docstring).

    After the block: ``baseline``, ``peak`` and ``after`` (bytes), ``peak_delta`` and ``kept_delta``,
    and ``method`` (how the peak was obtained).
    """

    def __enter__(self) -> PeakRSS:
        release_free_memory()
        self.baseline = proc_status_bytes("VmRSS") or 0
        self.method = (
            "VmHWM reset per region" if reset_peak_rss() else "VmHWM process lifetime (reset denied)"
        )
        return self

    def __exit__(self, *exc: Any) -> None:
        self.peak = proc_status_bytes("VmHWM") or 0
        release_free_memory()  # what stays resident is then what the region's results hold
        self.after = proc_status_bytes("VmRSS") or 0
        self.peak_delta = max(0, self.peak - self.baseline)
        self.kept_delta = max(0, self.after - self.baseline)
