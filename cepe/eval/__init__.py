"""Evaluation suite: the paper's tasks, metrics and baselines (full, truncated, StreamingLLM, REPLUG).

Modules: :mod:`~cepe.eval.metrics`, :mod:`~cepe.eval.methods` (method interface, CEPE and decoder-only),
:mod:`~cepe.eval.streaming`, :mod:`~cepe.eval.replug`, :mod:`~cepe.eval.measure` (throughput, memory,
seeding), :mod:`~cepe.eval.testing` (tiny model for smoke runs).
"""
