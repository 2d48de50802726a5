"""Memory accounting for the benchmark.

Two complementary numbers per measured prefill:

1. **Kept bytes** (exact, allocator-independent): the sum of ``nbytes`` of every tensor the prefill
   leaves for generation (decoder K/V cache, Φ, cross-attention K/V), found by walking the returned
   objects; storages shared by several tensors are counted once.
2. **Peak resident memory** (measured): on Linux the kernel tracks the process's peak resident set size
   ``VmHWM`` in ``/proc/self/status``; writing ``5`` to ``/proc/self/clear_refs`` resets that peak to the
   current resident size. Each setting runs in a fresh process: load the model, warm up, release freed
   heap pages back to the system (``malloc_trim``), read ``VmRSS`` (the baseline), reset the peak, run the
   prefill, read ``VmHWM``. ``peak - baseline`` is what the prefill costs on top of the loaded model
   (activations, workspaces and the caches it keeps); ``VmRSS`` after it, minus the baseline, is what it
   leaves resident. Where the reset is not permitted the lifetime peak is reported and flagged.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Iterable
from typing import Any

import torch


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
