"""Seeding and cost measurement (throughput, peak memory) recorded next to every metric.

Peak memory:
- on CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (bytes held by tensors);
- on CPU (Linux): the process peak resident set size ``VmHWM`` from ``/proc/self/status``. Before a
  measurement the peak is reset by writing ``5`` to ``/proc/self/clear_refs`` so the number covers only the
  measured region; where that reset is not allowed the reported value is the lifetime peak and
  ``memory_source`` says so. The delta over the RSS at the start is reported as well.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from cepe.bench.memory import proc_status_bytes, reset_peak_rss


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
        self.cuda = torch.device(meter.device).type == "cuda" and torch.cuda.is_available()

    def __enter__(self) -> _Region:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.meter.memory_source = "torch.cuda.max_memory_allocated"
        else:
            reset = reset_peak_rss()
            self.meter.memory_source = "VmHWM (reset per region)" if reset else "VmHWM (process lifetime)"
            self.rss0 = proc_status_bytes("VmRSS") or 0
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            delta = peak
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
