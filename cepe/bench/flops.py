"""Analytical cost model of prefill and decoding: matmul FLOPs and cache bytes.

Only matrix multiplications are counted (2 FLOPs per multiply-add): projections, MLPs, attention scores
and the attention-weighted sums, and the output head on the positions whose logits are kept. Norms,
rotary embeddings, softmax and element-wise work are ignored (they are a few percent at these sizes).
Causal attention counts only the query/key pairs the mask allows (``q·(q+1)/2`` for a fresh block),
i.e. the work an ideal kernel does. Gated (SwiGLU) MLPs are assumed, as in every supported family.

Shape legend: T total tokens, n decoder tokens, S = T - n encoder tokens, L chunk length, W window.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a decoder (or of the context encoder) that its cost depends on."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_hf_config(cls, cfg: Any) -> DecoderShape:
        """From a Hugging Face decoder config (Llama-like field names)."""
        heads = int(cfg.num_attention_heads)
        return cls(
            layers=int(cfg.num_hidden_layers),
            hidden=int(cfg.hidden_size),
            heads=heads,
            kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
            intermediate=int(cfg.intermediate_size),
            vocab=int(cfg.vocab_size),
        )

    @classmethod
    def from_encoder_config(cls, cfg: Any) -> DecoderShape:
        """From a :class:`cepe.config.EncoderConfig`."""
        return cls(
            layers=int(cfg.num_hidden_layers),
            hidden=int(cfg.hidden_size),
            heads=int(cfg.num_attention_heads),
            kv_heads=int(cfg.num_key_value_heads),
            head_dim=int(cfg.head_dim),
            intermediate=int(cfg.intermediate_size),
            vocab=int(cfg.vocab_size),
        )

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @property
    def linear_params_per_layer(self) -> int:
        """Weights one token multiplies in a layer: q, k, v, o projections and the gated MLP."""
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return d * q + 2 * d * kv + q * d + 3 * d * self.intermediate

    def kv_bytes_per_token(self, bytes_per_elem: int = 2) -> int:
        """Bytes of self-attention key/value cache one token occupies (all layers)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_elem


def causal_pairs(past: int, new: int) -> int:
    """Query/key pairs of ``new`` causal queries appended after ``past`` cached keys."""
    return new * past + new * (new + 1) // 2


def decoder_flops(shape: DecoderShape, past: int, new: int, logits: int = 1) -> int:
    """FLOPs of one decoder call on ``new`` tokens after ``past`` cached tokens, keeping ``logits`` rows."""
    linear = 2 * new * shape.layers * shape.linear_params_per_layer
    attn = 4 * causal_pairs(past, new) * shape.heads * shape.head_dim * shape.layers
    return linear + attn + 2 * logits * shape.hidden * shape.vocab


def encoder_flops(shape: DecoderShape, tokens: int, chunk: int) -> int:
    """FLOPs of encoding ``tokens`` context tokens in independent bidirectional chunks of ``chunk``."""
    full, rest = divmod(tokens, chunk)
    pairs = full * chunk * chunk + rest * rest
    linear = 2 * tokens * shape.layers * shape.linear_params_per_layer
    return linear + 4 * pairs * shape.heads * shape.head_dim * shape.layers


def cross_attention_flops(
    dec: DecoderShape, d_enc: int, layers: int, queries: int, keys: int, mode: str, project_keys: bool
) -> int:
    """FLOPs of ``layers`` cross-attention blocks: ``queries`` decoder tokens over ``keys`` encoder states.

    ``mode`` ``"kv"``/``"states"`` attend with projected keys (``project_keys``: whether K/V of all keys
    are projected in this call: always for ``"states"``, once for ``"kv"``); ``"absorbed"`` folds the
    key/value projections into the query and output, attending over the ``d_enc``-wide states directly.
    """
    hq = dec.heads * dec.head_dim
    qo = 2 * queries * 2 * dec.hidden * hq  # q_proj and o_proj
    if mode == "absorbed":
        fold = 2 * queries * 2 * hq * d_enc  # W_kᵀ q and W_v (Σ p φ)
        attn = 4 * queries * keys * dec.heads * d_enc
        return layers * (qo + fold + attn)
    proj = 2 * keys * 2 * d_enc * dec.kv_heads * dec.head_dim if project_keys else 0
    attn = 4 * queries * keys * dec.heads * dec.head_dim
    return layers * (qo + proj + attn)


@dataclass(frozen=True)
class CostModel:
    """The cost of each benchmarked method for one decoder/encoder pair.

    Attributes:
        dec: decoder sizes. enc: encoder sizes. cross_layers: decoder layers with cross-attention.
        window: decoder tokens (CEPE's decoder input, StreamingLLM's cache, REPLUG's pass length).
        chunk: encoder chunk length. full_chunk: tokens per call of the chunked full-context prefill.
        replug_piece: context tokens per REPLUG pass (the pass also reads ``window - replug_piece`` input).
        stream_sink: StreamingLLM attention sinks.
    """

    dec: DecoderShape
    enc: DecoderShape
    cross_layers: int
    window: int = 2048
    chunk: int = 256
    full_chunk: int = 4096
    replug_piece: int = 1024
    stream_sink: int = 4

    def split(self, total: int) -> tuple[int, int]:
        """CEPE's ``(decoder tokens n, encoder tokens S)`` for ``total`` tokens: the last ``window`` tokens
        go to the decoder, the rest to the encoder."""
        n = min(self.window, total)
        return n, total - n

    def cepe_prefill(self, total: int, mode: str = "states") -> int:
        n, s = self.split(total)
        flops = decoder_flops(self.dec, 0, n) + encoder_flops(self.enc, s, self.chunk)
        if s:
            flops += cross_attention_flops(self.dec, self.enc.hidden, self.cross_layers, n, s, mode, True)
        return flops

    def full_prefill(self, total: int) -> int:
        flops, done = 0, 0
        while done < total:
            step = min(self.full_chunk, total - done)
            flops += decoder_flops(self.dec, done, step, logits=1)
            done += step
        return flops

    def streaming_prefill(self, total: int) -> int:
        """Reading ``total`` tokens ``window`` at a time, scoring the last one: every call keeps one logit
        row, and the last keeps two when it reads two tokens or more (scoring the last token needs the
        prediction at the position before it)."""
        flops, cache, done = 0, 0, 0
        while done < total:
            step = min(self.window, total - done)
            rows = 2 if done + step == total and step >= 2 else 1
            flops += decoder_flops(self.dec, cache, step, logits=rows)
            cache = min(cache + step, self.window)  # sinks + recent tokens
            done += step
        return flops

    def replug_passes(self, total: int) -> tuple[int, int]:
        """``(passes, input tokens)``: the last ``window - replug_piece`` tokens are the input, every
        ``replug_piece`` tokens before them one pass."""
        inp = min(self.window - self.replug_piece, total)
        return max(1, math.ceil((total - inp) / self.replug_piece)), inp

    def replug_prefill(self, total: int) -> int:
        passes, inp = self.replug_passes(total)
        ctx = total - inp
        flops = 0
        for p in range(passes):
            piece = min(self.replug_piece, ctx - p * self.replug_piece) if ctx else 0
            flops += decoder_flops(self.dec, 0, piece + inp, logits=2)
        return flops

    def prefill(self, method: str, total: int) -> int:
        """Prefill FLOPs of ``method`` (``cepe``, ``full``, ``streamingllm``, ``replug``) on ``total`` tokens."""
        fns = {
            "cepe": self.cepe_prefill,
            "full": self.full_prefill,
            "streamingllm": self.streaming_prefill,
            "replug": self.replug_prefill,
        }
        if method not in fns:
            raise ValueError(f"no cost model for method {method!r}; known: {sorted(fns)}")
        return fns[method](total)

    def decode_step(self, method: str, context: int, mode: str = "kv") -> int:
        """FLOPs of generating one token after ``context`` tokens (``method`` ``full`` or ``cepe``)."""
        if method == "full":
            return decoder_flops(self.dec, context, 1)
        n, s = self.split(context)
        flops = decoder_flops(self.dec, n, 1)
        return flops + cross_attention_flops(
            self.dec, self.enc.hidden, self.cross_layers, 1, s, mode, project_keys=mode == "states"
        )

    def cache_bytes(self, method: str, total: int, mode: str = "states", bytes_per_elem: int = 2) -> int:
        """Bytes of the caches a prefill keeps for generation: decoder K/V (plus Φ, or per-layer
        cross-attention K/V in mode ``"kv"``, for CEPE)."""
        kv_tok = self.dec.kv_bytes_per_token(bytes_per_elem)
        if method == "full":
            return total * kv_tok
        if method == "streamingllm":
            return min(total, self.window) * kv_tok
        if method == "replug":
            return 0
        n, s = self.split(total)
        if mode == "kv":
            per = 2 * self.cross_layers * self.dec.kv_heads * self.dec.head_dim * bytes_per_elem
        else:
            per = self.enc.hidden * bytes_per_elem
        return n * kv_tok + s * per

    def cepe_extra_memory_fraction(self) -> float:
        """Bytes CEPE keeps per extra context token (Φ) over a full-context K/V cache's bytes per token:
        ``d_enc / (2 · layers · kv_heads · head_dim)``."""
        return self.enc.hidden / (2 * self.dec.layers * self.dec.kv_heads * self.dec.head_dim)
