"""Method name → method object: where a new baseline is added (a class in its own module, a branch here,
its name in :data:`cepe.eval.methods.METHODS`).

Importing every method module here (rather than in :mod:`cepe.eval.methods`) keeps the imports one-way:
the method modules import the interface in :mod:`~cepe.eval.methods`, this module imports them all.
"""

from __future__ import annotations

from typing import Any

import torch

from cepe.eval.methods import METHODS, CepeMethod, DecoderMethod, Method
from cepe.eval.replug import Replug
from cepe.eval.streaming import StreamingLLM

METHOD_OPTIONS: dict[str, dict[str, type]] = {
    "cepe": {"chunk_length": int},
    "full": {},
    "truncated": {},
    "streamingllm": {"sink_tokens": int, "recent_tokens": int, "stride": int},
    "replug": {"temperature": float},
}
"""Each method's options (a config's ``methods:`` section) and their types."""


def check_method_options(options: dict[str, Any]) -> None:
    """Refuse an unknown method, an option a method does not take (a misspelt one would leave its default in
    place, unnoticed) or a value of the wrong kind, naming it, before any model loads."""
    for method, opts in options.items():
        if method not in METHOD_OPTIONS:
            raise ValueError(f"methods.{method}: unknown method; choose from {', '.join(METHOD_OPTIONS)}")
        if opts is None:
            continue
        if not isinstance(opts, dict):
            raise ValueError(f"methods.{method} must map option names to values, got {opts!r}")
        takes = METHOD_OPTIONS[method]
        for key, value in opts.items():
            if key not in takes:
                known = ", ".join(takes) or "none"
                raise ValueError(f"methods.{method}.{key}: not an option of {method} (its options: {known})")
            if value is None and key == "chunk_length":
                continue
            kind = takes[key]
            try:  # a bool or a fraction where an integer goes would be taken silently as 1 / 0 or cut
                if isinstance(value, bool) or (kind is int and float(value) != int(value)):
                    raise ValueError
                kind(value)
            except (TypeError, ValueError, OverflowError):
                raise ValueError(
                    f"methods.{method}.{key} must be a number ({kind.__name__}), got {value!r}"
                ) from None


def build_method(
    name: str,
    decoder: torch.nn.Module,
    cepe_model: torch.nn.Module | None = None,
    options: dict[str, Any] | None = None,
    **common: Any,
) -> Method:
    """Construct a method by name.

    Args:
        name: one of ``cepe, full, truncated, streamingllm, replug``.
        decoder: the plain HF causal LM used by the baselines.
        cepe_model: the CEPE model (required for ``cepe``).
        options: method-specific settings (``streamingllm``: ``sink_tokens``, ``recent_tokens``, ``stride``;
            ``replug``: ``temperature``; ``cepe``: ``chunk_length``).
        common: ``eos_token_id``, ``pad_token_id``, ``autocast_dtype``, ``batch_size``.
    """
    check_method_options({name: options})
    options = dict(options or {})
    if name == "cepe":
        if cepe_model is None:
            raise ValueError(
                "method 'cepe' needs a CEPE model: pass --model <CEPE adapter dir> (or drop 'cepe' from --methods)"
            )
        return CepeMethod(cepe_model, chunk_length=options.get("chunk_length"), **common)
    if name in ("full", "truncated"):
        m = DecoderMethod(decoder, **common)
        m.name = name
        return m
    if name == "streamingllm":
        return StreamingLLM(
            decoder,
            sink_tokens=int(options.get("sink_tokens", 4)),
            recent_tokens=int(options.get("recent_tokens", 2044)),
            stride=int(options.get("stride", 2048)),
            **common,
        )
    if name == "replug":
        return Replug(decoder, temperature=float(options.get("temperature", 1.0)), **common)
    raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
