"""Configurations of ``cepe bench`` (:class:`BenchConfig`) and ``cepe bench-store`` (:class:`StoreBenchConfig`).

Plain dataclasses with no torch import, so the command line can be built without loading torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from cepe.config import CACHE_MODES  # cross-attention cache modes while decoding

PREFILL_METHODS = ("cepe", "full", "streamingllm", "replug")
DTYPE_NAMES = ("bf16", "fp32")  # the dtypes a bench runs in (torch dtypes: cepe.dtypes.torch_dtype)


@dataclass
class BenchConfig:
    """Everything that defines a benchmark run (saved into the result JSON).

    Attributes:
        model: decoder: ``"default"`` (SmolLM2-135M), ``"tiny"`` (2-layer random, for tests), a local
            directory or a hub id.
        random_init: build the decoder from its config with random weights instead of loading them.
        dtype: ``"bf16"`` (the fast path on CPUs with bf16 matmul units), ``"fp32"``, or ``"auto"`` (bf16
            where its matmuls beat fp32 here, see :mod:`cepe.compute`; resolved before any measurement).
        encoder_hidden / encoder_layers / encoder_heads: context encoder size (intermediate = 4 × hidden).
        chunk: encoder chunk length.
        window: decoder tokens (the CEPE decoder input, the StreamingLLM cache, one REPLUG pass).
        micro_batch: encoder chunks per encoder call.
        full_chunk: tokens per call of the chunked full-context prefill.
        replug_piece: context tokens per REPLUG pass.
        lengths: total tokens of the prefill settings.
        methods: prefill methods to run.
        max_tokens: per method, the longest length run (longer ones are skipped, reported as such).
        decode_context: context length of the decode settings (0 = no decode settings).
        decode_tokens: tokens generated (timed) per decode setting, after one untimed step.
        decode_modes: CEPE cache modes for decoding; full context is always included.
        decode_fill: ``"random"``: decode after caches of the right shape filled with random values
            (decode cost does not depend on them; avoids a slow full-context prefill) or ``"prefill"``.
        decode_cache: the decoder K/V cache while decoding, for every method alike: ``"static"``
            (preallocated for the context plus the new tokens, written in place; what ``generate(...,
            cache_implementation="static")`` uses) or ``"dynamic"`` (grows by concatenation each step, so a
            step copies the whole cache).
        repeats: timed prefills per setting (the best is reported). The untimed warm-up before them is
            one shorter prefill (``window + 2·chunk`` tokens, for kernels and thread pools), so with 1 the
            timed prefill is the first at its length: it includes the first touch of its buffers' pages,
            as a single real request does; 2 or more report a call at a length already run.
        compile: wrap the encoder layers and cross-attention blocks in ``torch.compile``.
        threads: torch intra-op threads (0 = torch's default).
        seed: seed of the random weights and token ids.
    """

    model: str = "default"
    random_init: bool = False
    dtype: str = field(default="auto", metadata={"choices": (*DTYPE_NAMES, "auto")})
    encoder_hidden: int = 256
    encoder_layers: int = 4
    encoder_heads: int = 4
    chunk: int = 256
    window: int = 2048
    micro_batch: int = 64
    full_chunk: int = 4096
    replug_piece: int = 1024
    lengths: list[int] = field(default_factory=lambda: [4096, 8192, 32768, 131072])
    methods: list[str] = field(
        default_factory=lambda: list(PREFILL_METHODS), metadata={"choices": PREFILL_METHODS}
    )
    max_tokens: dict[str, int] = field(
        default_factory=lambda: {"full": 32768, "replug": 32768, "streamingllm": 131072, "cepe": 131072}
    )
    decode_context: int = 32768
    decode_tokens: int = 16
    decode_modes: list[str] = field(
        default_factory=lambda: ["kv", "states", "absorbed"], metadata={"choices": CACHE_MODES}
    )
    decode_fill: str = field(default="random", metadata={"choices": ("random", "prefill")})
    decode_cache: str = field(default="static", metadata={"choices": ("static", "dynamic")})
    repeats: int = 1
    compile: bool = False
    threads: int = 0
    seed: int = 0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first inconsistent field."""
        if self.dtype not in DTYPE_NAMES and self.dtype != "auto":
            raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)} or 'auto', got {self.dtype!r}")
        bad = [m for m in self.methods if m not in PREFILL_METHODS]
        if bad:
            raise ValueError(f"unknown methods {bad}; choose from {', '.join(PREFILL_METHODS)}")
        bad = [m for m in self.decode_modes if m not in CACHE_MODES]
        if bad:
            raise ValueError(f"unknown decode_modes {bad}; choose from {', '.join(CACHE_MODES)}")
        for name, limit in self.max_tokens.items():
            if name not in PREFILL_METHODS or isinstance(limit, bool) or not isinstance(limit, int):
                raise ValueError(
                    f"max_tokens (--max-tokens METHOD=N) takes METHOD in {PREFILL_METHODS} and an integer N, "
                    f"got {name}={limit!r}"
                )
        if not 0 < self.replug_piece < self.window:
            raise ValueError(f"replug_piece must be in (0, window={self.window}), got {self.replug_piece}")
        if self.window <= 4:
            raise ValueError("window must exceed the 4 StreamingLLM sink tokens")
        for name in (
            "chunk",
            "micro_batch",
            "full_chunk",
            "repeats",
            "encoder_hidden",
            "encoder_layers",
            "encoder_heads",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.threads < 0:
            raise ValueError(f"threads must be 0 (torch's default) or more, got {self.threads}")
        if self.decode_tokens < 0:
            raise ValueError(
                f"decode_tokens must be 0 (no decode settings) or more, got {self.decode_tokens}"
            )
        if any(t <= 0 for t in self.lengths):
            raise ValueError(f"lengths must be positive, got {self.lengths}")
        if self.encoder_hidden % self.encoder_heads:
            raise ValueError("encoder_hidden must be divisible by encoder_heads")
        if self.decode_fill not in ("random", "prefill"):
            raise ValueError(f"decode_fill must be 'random' or 'prefill', got {self.decode_fill!r}")
        if self.decode_cache not in ("static", "dynamic"):
            raise ValueError(f"decode_cache must be 'static' or 'dynamic', got {self.decode_cache!r}")
        if self.decode_context and self.decode_context <= self.window:
            raise ValueError(f"decode_context must exceed the window ({self.window}) or be 0")

    def settings(self) -> list[dict[str, Any]]:
        """The settings to measure, in order (prefill by length, then decode)."""
        out: list[dict[str, Any]] = []
        for total in self.lengths:
            for m in self.methods:
                out.append({"kind": "prefill", "method": m, "tokens": int(total)})
        if self.decode_context and self.decode_tokens > 0:
            for mode in self.decode_modes:
                out.append({"kind": "decode", "method": "cepe", "mode": mode, "context": self.decode_context})
            out.append({"kind": "decode", "method": "full", "mode": None, "context": self.decode_context})
        return out

    def skipped(self, setting: dict[str, Any]) -> str | None:
        """Why a setting is not run by default (None when it runs)."""
        if setting["kind"] != "prefill":
            return None
        limit = self.max_tokens.get(setting["method"])
        if limit is not None and setting["tokens"] > limit:
            return f"{setting['method']} limited to {limit} tokens (raise with --max-tokens {setting['method']}=N)"
        return None

    def resolved(self) -> BenchConfig:
        """This config with ``dtype="auto"`` replaced by the dtype it picks on this machine."""
        if self.dtype != "auto":
            return self
        from cepe.compute import bf16_is_fast

        return BenchConfig.from_dict({**self.to_dict(), "dtype": "bf16" if bf16_is_fast("cpu") else "fp32"})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchConfig:
        return cls(**data)


@dataclass
class StoreBenchConfig:
    """One ``cepe bench-store`` run.

    Attributes:
        model: CEPE adapter directory (or ``"tiny"``).
        lengths: context lengths T.
        full_max_tokens: longest T for which full-context prefill is run.
        full_chunk: tokens per call of the chunked full-context prefill.
        dtype: dtype of the model for every path (``"fp32"`` or ``"bf16"``).
        store_dtype: dtype of the stored Φ.
        cache: cross-attention cache mode while producing the first token (``"states"``: K/V projected per
            layer and dropped; same first-token cost as ``"kv"`` without keeping 30 layers of K/V).
        threads: torch threads (0: torch's default).
        seed: seed of the random ids.
    """

    model: str = "adapters/smollm2-135m-cepe"
    lengths: list[int] = field(default_factory=lambda: [32768, 131072])
    full_max_tokens: int = 8192
    full_chunk: int = 2048
    dtype: str = field(default="fp32", metadata={"choices": DTYPE_NAMES})
    store_dtype: str = field(default="bf16", metadata={"choices": ("bf16", "fp32", "fp16")})
    cache: str = field(default="states", metadata={"choices": CACHE_MODES})
    threads: int = 0
    seed: int = 0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field no run could use (before any model loads)."""
        if not self.lengths or any(int(n) < 1 for n in self.lengths):
            raise ValueError(f"lengths must be positive token counts, got {self.lengths}")
        if self.full_chunk < 1:
            raise ValueError(f"full_chunk must be at least 1 token, got {self.full_chunk}")
        if self.full_max_tokens < 0:
            raise ValueError(f"full_max_tokens must be 0 or more, got {self.full_max_tokens}")
        if self.threads < 0:
            raise ValueError(f"threads must be 0 (torch's default) or more, got {self.threads}")
