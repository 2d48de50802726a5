"""Evaluation suite: the paper's tasks, metrics and baselines (full, truncated, StreamingLLM, REPLUG).

Modules: :mod:`~cepe.eval.api` (``load_setup`` / ``run_task``: what the CLI, the main job and scripts
call), :mod:`~cepe.eval.tasks` (one module per task), :mod:`~cepe.eval.common` (the model bundle, the
per-method loop), :mod:`~cepe.eval.methods` (method interface, CEPE and decoder-only),
:mod:`~cepe.eval.streaming`, :mod:`~cepe.eval.replug`, :mod:`~cepe.eval.registry` (method name → class),
:mod:`~cepe.eval.metrics`, :mod:`~cepe.eval.report`, :mod:`~cepe.eval.cli` (``cepe eval`` flags).
Measurement (throughput, memory, seeding) is :mod:`cepe.measure`; tiny models are :mod:`cepe.tiny`.
"""
