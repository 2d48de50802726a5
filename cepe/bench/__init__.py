"""``cepe bench``: prefill throughput, peak memory and decode speed of CEPE against full context,
StreamingLLM and REPLUG on the same decoder, next to an analytical FLOP count.

Each setting runs in a fresh worker process (:mod:`cepe.bench.runner`) so its peak resident memory is its
own (see :mod:`cepe.measure` for the method). The run also measures the machine's bf16 (or fp32)
matmul peak and reports, per setting, the fraction of it that the setting achieved (analytical FLOPs from
:mod:`cepe.bench.flops` over measured seconds). Results: ``bench.json``, ``bench.png`` and a printed report.

Modules: :mod:`.config` (the run's dataclasses, no torch), :mod:`.api` (:func:`run_benchmark`),
:mod:`.runner` (one setting), :mod:`.flops` (cost model), :mod:`.report`, :mod:`.store_ttft`
(``cepe bench-store``), :mod:`.cli` (the flags). Names are imported lazily so that ``cepe --help`` does not
pay for torch.
"""

from __future__ import annotations

from cepe.lazy import lazy_getattr

_EXPORTS = {
    "BenchConfig": "config",
    "StoreBenchConfig": "config",
    "CostModel": "flops",
    "DecoderShape": "flops",
    "run_benchmark": "api",
    "run_store_bench": "store_ttft",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)
