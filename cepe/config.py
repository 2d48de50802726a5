"""Validated configuration dataclasses, saved as JSON next to the adapter weights."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Literal

# The copy head's own inputs (CepeConfig fields), in the order the head reads them (cepe.mixture.head_inputs).
COPY_HEAD_INPUTS = (
    "mix_copy_prob",
    "mix_copy_near",
    "mix_copy_sure",
    "mix_copy_top",
    "mix_copy_read",
    "mix_copy_count",
)

CacheMode = Literal["kv", "states", "absorbed"]
AttnImpl = Literal["sdpa", "eager"]
InitMode = Literal["zero", "copy", "gate"]
ScoreScaling = Literal["none", "yarn"]

CACHE_MODES = ("kv", "states", "absorbed")
ATTN_IMPLS = ("sdpa", "eager")
INIT_MODES = ("zero", "copy", "gate")
SCORE_SCALINGS = ("none", "yarn")


def check(cond: bool, msg: str) -> None:
    """Raise ``ValueError(msg)`` unless ``cond`` (the configs' validation helper)."""
    if not cond:
        raise ValueError(msg)


def is_int(value: Any) -> bool:
    """A whole number given as one (``int``, numpy's integers), not a bool and not a float such as ``2.0``
    (as ``mix_match`` and ``length_scale`` always required: a config's counts are written as integers)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite real number (int or float), not a bool and not a string."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_positive_int(value: Any, name: str, what: str = "") -> None:
    """Raise ``ValueError`` unless ``value`` is a whole number > 0 (``name``, ``what`` it counts: the message)."""
    check(is_int(value) and value > 0, f"{name} must be a positive whole number{what}, got {value!r}")


@dataclass
class EncoderConfig:
    """Architecture of the bidirectional context encoder (Llama-style: RMSNorm, RoPE, SwiGLU).

    The encoder shares the decoder's vocabulary; ``vocab_size`` may exceed the decoder's by one extra
    ``[MASK]`` token used only by masked-LM pre-training (``mask_token_id``). ``causal`` runs each chunk
    left-to-right instead of bidirectionally (as the decoder itself reads text; an option for encoders
    built from the decoder's own layers, see :func:`encoder_config_from_decoder`). ``output_size`` adds a
    learned down-projection (``out_proj``, no bias) after the final norm, so that Φ, what the ``states``
    and ``absorbed`` caches and the context store keep per token, has that width instead of
    ``hidden_size`` (None: no projection); see :attr:`state_size`.
    """

    vocab_size: int
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    mask_token_id: int | None = None
    initializer_range: float = 0.02
    causal: bool = False
    output_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_attention_heads"):  # what the defaults below are computed from
            check_positive_int(getattr(self, name), f"encoder {name}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            check(
                self.hidden_size % self.num_attention_heads == 0,
                f"encoder hidden_size {self.hidden_size} must be divisible by num_attention_heads "
                f"{self.num_attention_heads} (or give head_dim)",
            )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first inconsistent field."""
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
        ):
            check_positive_int(getattr(self, name), f"encoder {name}")
        check(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"encoder num_attention_heads {self.num_attention_heads} must be a multiple of "
            f"num_key_value_heads {self.num_key_value_heads}",
        )
        check(self.head_dim % 2 == 0, f"encoder head_dim must be even for RoPE, got {self.head_dim}")
        check(
            is_number(self.rms_norm_eps) and self.rms_norm_eps > 0,
            f"encoder rms_norm_eps must be a finite number > 0 (1e-5, say), got {self.rms_norm_eps!r}",
        )
        check(
            is_number(self.rope_theta) and self.rope_theta > 0,
            f"encoder rope_theta (RoPE's base) must be a finite number > 0 (10000.0, say), got {self.rope_theta!r}",
        )
        check(
            self.output_size is None
            or (is_int(self.output_size) and 0 < self.output_size <= self.hidden_size),
            f"encoder output_size (the width of Φ after the down-projection) must be a whole number in "
            f"1..hidden_size ({self.hidden_size}), or null for no projection; got {self.output_size!r}",
        )
        if self.mask_token_id is not None:
            check(
                is_int(self.mask_token_id) and 0 <= self.mask_token_id < self.vocab_size,
                f"mask_token_id {self.mask_token_id!r} outside the encoder vocabulary ({self.vocab_size})",
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EncoderConfig:
        """An encoder config from its saved fields (a saved ``CepeConfig``'s ``encoder``), refusing unknown keys."""
        check(isinstance(data, dict), f"an encoder config must be a mapping of its fields, got {data!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        check(not unknown, f"unknown EncoderConfig keys {unknown}; known keys are {sorted(known)}")
        check(
            "vocab_size" in data, "an encoder config needs vocab_size (the decoder's, plus any [MASK] token)"
        )
        return cls(**data)

    @property
    def state_size(self) -> int:
        """D_enc, the width of Φ: ``output_size`` with a down-projection, else ``hidden_size``."""
        return int(self.output_size or self.hidden_size)


@dataclass
class CepeConfig:
    """Everything CEPE adds to a frozen decoder.

    Attributes:
        encoder: the context encoder's architecture.
        decoder_name_or_path: the base decoder (hub id, local dir, or ``"default"``).
        cross_attention_layers: decoder layer indices that get cross-attention (None = all).
        num_cross_attn_layers: the official form: cross-attention in the LAST this-many layers.
            Mutually exclusive with ``cross_attention_layers``.
        chunk_length: L, encoder tokens per chunk.
        init_mode: ``"zero"`` (paper: o_proj zero), ``"copy"`` (released code: o_proj copied) or
            ``"gate"`` (o_proj copied, each head scaled by its own ``tanh(gate)`` that starts at zero,
            Flamingo style); q/k/v are always copied from the layer's self-attention, k/v sliced to the
            encoder width, the query norm copied from ``post_attention_layernorm`` (released code).
        attn_implementation: cross-attention (and encoder) kernel: ``"sdpa"`` or ``"eager"`` reference.
        cross_attention_cache: default generation cache mode: ``"kv"``, ``"states"`` or ``"absorbed"``.
        score_scaling: ``"yarn"`` multiplies cross-attention scores by ``(1 + 0.1 ln s)^2`` with
            ``s = context tokens / train_context_tokens`` when ``s > 1`` (long inputs, Appendix "Needle").
        train_context_tokens: encoder tokens per example seen in training (needed by score scaling).
        encoder_micro_batch: chunks encoded per encoder call (bounds activation memory at 128K tokens).
        pack_keys: drop padded encoder positions before cross-attention (keys carry no position).
        decoder_vocab_size: filled from the decoder; the encoder must share this vocabulary.
        share_embeddings: the encoder reads tokens through the decoder's own (frozen) input embeddings
            instead of a table of its own (the adapter then stores no vocabulary-sized matrix; needs
            ``encoder.hidden_size`` = the decoder's width and ``encoder.vocab_size`` = its vocabulary).
        mirror_self_attention: initialise cross-attention so that, on Φ made of the decoder's own
            normalised hidden states, its scores are the layer's self-attention scores: the query norm is
            copied from ``input_layernorm`` and that norm's weight is folded into k/v (needs D_enc = D_dec).
            Off (default) gives the released code's init: norm from ``post_attention_layernorm``.
        null_key: give every cross-attention KV head a learned "no match" key with a zero value (starts at
            zero): a query that finds nothing in the context can attend there, so a head's output shrinks
            on such tokens instead of always adding a mix of context values (beyond the released code:
            its checkpoint layout has no such parameter). The ``absorbed`` cache then projects keys as
            ``states`` does (same result).
        token_gate: a per-token strength for every cross-attention head, ``2·σ(w·RMSNorm(h) + b)`` from the
            layer's normed decoder state, zero-initialised (exactly 1: an adapter gains it without changing
            its function), so a token can read less of the context where nothing in it helps (beyond the
            released code: its checkpoint layout has no such parameter).
        match_gate: a per-token strength for every cross-attention head from how strongly its query matches
            the context: ``2·σ(a·m + c·κ̂ + b)``, with m the log-mean-exp of the head's scores over the real
            keys and κ̂ = (log n − entropy) / log n its attention's concentration (no gradient flows through
            m and κ̂), added to the token gate's logit when both are on; zero-initialised (exactly 1), so
            reading can depend on whether anything in the context matches (beyond the released code). The
            ``kv`` cache then also keeps each layer's augmented keys (about 2 × ``(hd + 2)`` numbers per KV
            head and context token, fp32 or the autocast dtype), and ``absorbed`` projects keys as ``states`` does.
        length_scale: a per-head score multiplier that follows the context's length: head h's query is scaled
            by ``(n / length_scale)^τ_h``, n the example's real context tokens, τ_h learned from zero (exactly
            1 at init), so a head can sharpen (or soften) its attention as the context grows and its match
            is shared among more keys; None = off (beyond the released code).
        length_scale_below: with ``length_scale``, n counts at most ``length_scale`` tokens: contexts of that
            length or longer read exactly as without the exponents, shorter ones by ``(n / length_scale)^τ_h``.
        length_scale_above: with ``length_scale``, a second per-head exponent τ'_h, learned from zero, for
            the context's length above the pivot: the query is scaled by ``(n / length_scale)^τ_h`` as set
            by ``length_scale_below``, times ``(max(n, length_scale) / length_scale)^τ'_h``, so contexts
            longer than the pivot sharpen (or soften) by their own amount and shorter ones are untouched.
        short_gate: with ``length_scale``, per-token head gates that act only on contexts shorter than the
            pivot: their logit, ``w'·RMSNorm(h) + b'`` plus ``a'·m + c'·κ̂`` with the match gates' statistics
            (when ``match_gate`` is on), is multiplied by ``max(0, log(length_scale / n))`` and added to
            the other gates' logits, so contexts of ``length_scale`` tokens or more read exactly as without
            them; zero-initialised (exactly 1: an adapter gains them without changing its function).
        long_gate: with ``length_scale``, their mirror for contexts longer than the pivot: the same gates,
            their logit multiplied by ``max(0, log(n / length_scale))``, so contexts of ``length_scale``
            tokens or fewer read exactly as without them; zero-initialised.
        induction_gate: a per-head weight on whether the head's reading continues a run through the
            context: its logit ``w_h·ι̂`` is added to the other gates' (or scales the head by ``2·σ(w_h·ι̂)``
            alone), with ``ι̂ = clamp(log(n·p_t(j⁺)) / log n, −1, 1)``, ``p_t`` the head's attention at token t
            and ``j⁺`` the key after the one its previous token's query attended to most: near 1 while a
            copy goes on (an induction step), 0 for uniform attention, −1 for a chance match elsewhere (no
            gradient flows through ι̂); zero-initialised (exactly 1). Generation keeps where each layer's
            heads read at every decoder position, so a call carries on from the position its cache ends
            at (beam search, a cache cropped by assisted decoding included); ``absorbed`` projects keys as
            ``states`` does, and every query's scores are computed once more (an argmax is not a fused
            attention's output) (beyond the released code).
        run_bias: a per-head bias β_h added to each query's score on ``j⁺``, the key after the one the
            head's previous query attended to most (the same read position the induction gate uses, from
            the unbiased scores): a copy under way is continued where the current token alone matches many
            keys (a common word in a long context). Zero-initialised (exactly the adapter without it);
            ``β_h < 0`` steers away from continuing. The fused path corrects the kernel's output in closed
            form (``CrossAttention.attend_run``); generation and beam search carry the read position as
            for the induction gate (beyond the released code).
        context_scale: multiplier on every cross-attention output, the same as scaling each ``o_proj``:
            how strongly the decoder reads its context. 1.0 = as trained; a value chosen on validation
            data calibrates a trained adapter (``docs/TRAINING.md``, "Calibrating how strongly it reads").
        output_mix: mix the output distributions token by token, ``λ·p_cepe + (1 − λ)·p_decoder``, where
            ``p_decoder`` is the same decoder without the context and ``λ = σ(w·[h_cepe; h_decoder] + b)``
            comes from a head over both final hidden states (``mix_head``; zero at first: λ = ½). The
            decoder runs twice (one batch of 2B rows); without a context the model is the decoder, as
            always (beyond the released code; ``cepe.mixture``).
        mix_match: with ``output_mix``, K > 0 adds K suffix-match indicators to the head's inputs: whether
            the decoder's last k tokens (k = 1..K) occur in the context's text with a token after them
            (``cepe.mixture.suffix_match_features``; the head gets K more weights, zero at first). The
            context must then be given as token ids (not only as encoder states). 0 = off.
        mix_hidden: with ``mix_match``, False gives the head the indicators alone (K + 1 weights), not the
            hidden states.
        mix_length: with ``mix_match``, one more head input after the indicators: how long the context is,
            ``log(1 + n / 1024)`` for n real context tokens (``cepe.mixture.length_feature``), so that λ can
            follow the length (a reader trained to 8K harms more the longer its context). Its weight starts
            at zero: an adapter's head trained without it keeps its function when it is added.
        mix_length_cap: with ``mix_length``, contexts longer than this many tokens read as this long in
            the heads' length input, so that heads fitted on contexts up to that length do not extrapolate
            their length weights beyond it (a 32K context then mixes as an 8K one). None: no cap.
        mix_agree: with ``mix_match``, K more head inputs after those: for each suffix length k, ``1 / d``
            where the decoder's last k tokens occur in the context and ``d`` distinct tokens follow them
            there, 0 where they do not occur (``cepe.mixture.suffix_agreement``), so that λ can tell a
            copied passage (one continuation) from a recurring prefix such as a label's (several). Their
            weights start at zero, as ``mix_length``'s.
        mix_copy: with ``mix_match``, a third component of the output distribution: the tokens that
            follow, in the context, the longest of the decoder's last 1..K tokens that occurs there (each
            occurrence one vote), mixed in as ``μ·p_copy + (1 − μ)·p_mixture`` with ``μ = σ(c)`` from a
            second head over the mixing head's inputs (``copy_head``; zero weights, bias −4 at first) and
            μ = 0 where no suffix occurs (``cepe.mixture.copy_spans``). It copies a span token by token
            where the reader stops early (beyond the released code; without a context, or where nothing
            matches, the model is what it is without it).
        mix_copy_prob: with ``mix_copy``, one more input to the copy head alone: how probable the
            mixture without the copy finds what the copy proposes, ``max(log s, −16) / 8`` with
            ``s = Σ_y p_copy(y)·p_mixture(y)`` (``cepe.mixture.copy_agreement_feature``), so that μ can
            tell a match whose successor fits the text from one that does not (a rare token met once far
            back). Its weight starts at zero: a copy head trained without it keeps its function.
        mix_copy_near: with ``mix_copy``, one more input to the copy head alone: how far before the
            context's end the matched suffix last occurs, ``log(1 + d / 64) / 4``
            (``cepe.mixture.copy_recency_feature``), so that μ can trust a match in the text just read
            more than one from far back. Its weight starts at zero, as ``mix_copy_prob``'s.
        mix_copy_sure: with ``mix_copy``, one more input to the copy head alone: how sure the reader (the
            side with the context) is of its own next token, ``max(log max_y p_cepe(y), −16) / 8``
            (``cepe.mixture.reader_sure_feature``), so that μ can give way where the reader already knows
            what comes next and a short match spreads the copy over wrong successors (a table whose keys
            recur). It moves with the reader alone, not with the heads, so ``cepe fit-heads`` can record
            it. Its weight starts at zero, as ``mix_copy_prob``'s.
        mix_copy_top: with ``mix_copy``, one more input to the copy head alone: the largest share one token
            has of the copy's votes, ``max_y p_copy(y)`` (``cepe.mixture.CopySpans.top_share``), so that μ
            can trust a suffix whose successors nearly all agree though a few stray ones join as the
            context grows (the agreements ``1 / d`` halve with one stray successor in a thousand). Its
            weight starts at zero, as ``mix_copy_prob``'s.
        mix_copy_read: with ``mix_copy``, one more input to the copy head alone: how probable the reader
            (the side with the context, not the mixture) finds what the copy proposes,
            ``max(log Σ_y p_copy(y)·p_cepe(y), −16) / 8`` (``cepe.mixture.copy_agreement_feature``), so that
            μ can tell a match whose successor the reader finds unlikely (a name met once, followed there
            by another word) from one it expects. Unlike ``mix_copy_prob`` it moves with the reader alone,
            so ``cepe fit-heads`` can record it. Its weight starts at zero, as ``mix_copy_prob``'s.
        mix_copy_count: with ``mix_copy``, one more input to the copy head alone: how many times the
            matched suffix occurs in the context, ``log(1 + n) / 4`` (``cepe.mixture.CopySpans.count_feature``),
            so that μ can tell a successor seen after many occurrences from one seen once (both agree
            fully). Its weight starts at zero, as ``mix_copy_prob``'s.
        mix_copy_decay: with ``mix_copy``, the copy's votes weighed by how far before the context's end
            each stands: ``(1 + d / 64) ** -decay`` (``cepe.mixture.vote_weights``; 0: each occurrence one
            vote), so that a longer context adds far-back votes without drowning the successor just read.
            It changes the copy distribution, not a head's inputs: a head fitted with one decay is fitted
            for that decay.
        mix_hash: how the suffix matches hash token k-grams (``cepe.mixture.HASH_MODES``): ``"exact"``
            finds every suffix that occurs; ``"wrap"`` is the hash of adapters saved before that fix, which
            misses about half the occurring suffixes of 4+ tokens, and such an adapter's heads were fitted
            on those inputs. A saved config with a mixture's suffix matches and no ``mix_hash`` loads as
            ``"wrap"``, so that it computes the function it was saved with.
    """

    encoder: EncoderConfig
    decoder_name_or_path: str | None = None
    cross_attention_layers: list[int] | None = None
    num_cross_attn_layers: int | None = None
    chunk_length: int = 256
    init_mode: InitMode = "zero"
    attn_implementation: AttnImpl = "sdpa"
    cross_attention_cache: CacheMode = "kv"
    score_scaling: ScoreScaling = "none"
    train_context_tokens: int | None = None
    encoder_micro_batch: int = 64
    pack_keys: bool = True
    decoder_vocab_size: int | None = None
    share_embeddings: bool = False
    mirror_self_attention: bool = False
    null_key: bool = False
    token_gate: bool = False
    match_gate: bool = False
    length_scale: int | None = None
    length_scale_below: bool = False
    length_scale_above: bool = False
    short_gate: bool = False
    long_gate: bool = False
    induction_gate: bool = False
    run_bias: bool = False
    context_scale: float = 1.0
    output_mix: bool = False
    mix_match: int = 0
    mix_hidden: bool = True
    mix_length: bool = False
    mix_length_cap: int | None = None
    mix_agree: bool = False
    mix_copy: bool = False
    mix_copy_prob: bool = False
    mix_copy_near: bool = False
    mix_copy_sure: bool = False
    mix_copy_top: bool = False
    mix_copy_read: bool = False
    mix_copy_count: bool = False
    mix_copy_decay: float = 0.0
    mix_hash: str = "exact"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.encoder, dict):
            self.encoder = EncoderConfig.from_dict(self.encoder)
        check(
            isinstance(self.encoder, EncoderConfig),
            f"encoder must be an EncoderConfig or a mapping of its fields, got {type(self.encoder).__name__}",
        )
        if self.cross_attention_layers is not None:
            layers = self.cross_attention_layers
            check(
                isinstance(layers, (list, tuple)) and all(is_int(i) for i in layers),
                f"cross_attention_layers must be a list of decoder layer indices (whole numbers), or null for "
                f"all layers; got {layers!r}",
            )
            self.cross_attention_layers = [int(i) for i in layers]
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field and its allowed values."""
        check_positive_int(self.chunk_length, "chunk_length", " (L, encoder tokens per chunk)")
        check(self.init_mode in INIT_MODES, f"init_mode must be one of {INIT_MODES}, got {self.init_mode!r}")
        check(
            self.attn_implementation in ATTN_IMPLS,
            f"attn_implementation must be one of {ATTN_IMPLS}, got {self.attn_implementation!r}",
        )
        check(
            self.cross_attention_cache in CACHE_MODES,
            f"cross_attention_cache must be one of {CACHE_MODES}, got {self.cross_attention_cache!r}",
        )
        check(
            self.score_scaling in SCORE_SCALINGS,
            f"score_scaling must be one of {SCORE_SCALINGS}, got {self.score_scaling!r}",
        )
        if self.score_scaling != "none":
            check(
                self.train_context_tokens is not None,
                "score_scaling needs train_context_tokens (encoder tokens per training example)",
            )
        if self.train_context_tokens is not None:
            check_positive_int(
                self.train_context_tokens,
                "train_context_tokens",
                " (encoder tokens per training example) or null",
            )
        check_positive_int(self.encoder_micro_batch, "encoder_micro_batch", " (chunks per encoder call)")
        check(
            self.length_scale is None or (is_int(self.length_scale) and self.length_scale > 0),
            f"length_scale must be a positive number of context tokens (or null: off), got {self.length_scale!r}",
        )
        check(
            self.length_scale is not None or not (self.length_scale_below or self.length_scale_above),
            "length_scale_below / length_scale_above need length_scale (the pivot, in context tokens)",
        )
        check(
            self.length_scale is not None or not self.short_gate,
            "short_gate needs length_scale (the pivot, in context tokens, below which the gates act)",
        )
        check(
            self.length_scale is not None or not self.long_gate,
            "long_gate needs length_scale (the pivot, in context tokens, above which the gates act)",
        )
        check(
            is_number(self.context_scale) and self.context_scale >= 0,
            f"context_scale must be a finite number >= 0 (1.0 = as trained), got {self.context_scale!r}",
        )
        check(
            is_int(self.mix_match) and self.mix_match >= 0,
            f"mix_match must be a number of suffix lengths >= 0 (0 = off), got {self.mix_match!r}",
        )
        check(
            self.output_mix or self.mix_match == 0,
            "mix_match adds inputs to the output mixture's head: set output_mix too (or mix_match: 0)",
        )
        check(
            self.mix_hidden or self.mix_match > 0,
            "mix_hidden: false leaves the mixing head only its bias: give mix_match > 0 (or mix_hidden: true)",
        )
        check(
            not self.mix_length or self.mix_match > 0,
            "mix_length rides with the suffix-match inputs: set mix_match > 0 (and output_mix) too, or "
            "mix_length: false",
        )
        check(
            not self.mix_agree or self.mix_match > 0,
            "mix_agree rides with the suffix-match inputs: set mix_match > 0 (and output_mix) too, or "
            "mix_agree: false",
        )
        check(
            not self.mix_copy or self.mix_match > 0,
            "mix_copy copies after the suffixes that mix_match finds: set mix_match > 0 (and output_mix) "
            "too, or mix_copy: false",
        )
        for name in COPY_HEAD_INPUTS:
            check(
                not getattr(self, name) or self.mix_copy,
                f"{name} is an input of the copy's head: set mix_copy (and mix_match, output_mix) too, "
                f"or {name}: false",
            )
        check(
            self.mix_length_cap is None
            or (self.mix_length and is_int(self.mix_length_cap) and self.mix_length_cap > 0),
            f"mix_length_cap caps the heads' length input: give a positive whole number of tokens with "
            f"mix_length: true (or mix_length_cap: null), got {self.mix_length_cap!r}",
        )
        check(
            is_number(self.mix_copy_decay) and self.mix_copy_decay >= 0,
            f"mix_copy_decay weighs the copy's votes by (1 + d/64)^-decay: give a finite number ≥ 0 (0: every "
            f"vote the same), got {self.mix_copy_decay!r}",
        )
        check(
            self.mix_hash in ("exact", "wrap"),
            f"mix_hash must be 'exact' or 'wrap' (the hash of adapters saved before its fix), got {self.mix_hash!r}",
        )
        check(
            self.mix_copy_decay == 0 or self.mix_copy,
            "mix_copy_decay weighs the copy's votes: set mix_copy (and mix_match, output_mix) too, or "
            "mix_copy_decay: 0",
        )
        check(
            self.cross_attention_layers is None or self.num_cross_attn_layers is None,
            "give either cross_attention_layers or num_cross_attn_layers, not both",
        )
        check(
            self.cross_attention_layers is None or len(self.cross_attention_layers) > 0,
            "cross_attention_layers is empty: no layer would read the context; give at least one decoder "
            "layer index (or null for all layers)",
        )
        if self.num_cross_attn_layers is not None:
            check_positive_int(
                self.num_cross_attn_layers,
                "num_cross_attn_layers",
                " (cross-attention in the last this-many layers)",
            )
        if self.decoder_vocab_size is not None and self.share_embeddings:
            check(
                self.encoder.vocab_size == self.decoder_vocab_size,
                f"share_embeddings: the encoder reads the decoder's embedding table, so encoder.vocab_size "
                f"must be the decoder's {self.decoder_vocab_size}, got {self.encoder.vocab_size}",
            )
        if self.decoder_vocab_size is not None:
            check(
                self.encoder.vocab_size in (self.decoder_vocab_size, self.decoder_vocab_size + 1),
                f"vocabulary mismatch: the encoder has {self.encoder.vocab_size} tokens but the decoder "
                f"{self.decoder_vocab_size}; the encoder must share the decoder's vocabulary (plus at most "
                "one [MASK] token)",
            )

    def layer_indices(self, num_decoder_layers: int) -> list[int]:
        """Decoder layers that receive cross-attention, validated against the decoder depth."""
        if self.cross_attention_layers is not None:
            idx = sorted(set(self.cross_attention_layers))
        elif self.num_cross_attn_layers is not None:
            check(
                self.num_cross_attn_layers <= num_decoder_layers,
                f"num_cross_attn_layers {self.num_cross_attn_layers} exceeds the decoder's {num_decoder_layers} layers",
            )
            idx = list(range(num_decoder_layers - self.num_cross_attn_layers, num_decoder_layers))
        else:
            idx = list(range(num_decoder_layers))
        bad = [i for i in idx if not 0 <= i < num_decoder_layers]
        check(not bad, f"cross_attention_layers {bad} outside the decoder's {num_decoder_layers} layers")
        return idx

    def score_scale(self, context_tokens: float) -> float:
        """Multiplier on cross-attention scores for ``context_tokens`` encoder tokens (1.0 if off)."""
        if self.score_scaling == "none" or not self.train_context_tokens:
            return 1.0
        s = context_tokens / self.train_context_tokens
        return (1.0 + 0.1 * math.log(s)) ** 2 if s > 1 else 1.0

    # --- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CepeConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        check(not unknown, f"unknown CepeConfig keys {unknown}; known keys are {sorted(known)}")
        if "mix_hash" not in data and data.get("output_mix") and data.get("mix_match"):
            data = {**data, "mix_hash": "wrap"}  # saved before the hash fix: keep its function
        return cls(**data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the config as JSON (atomically)."""
        from .fileio import write_json

        write_json(path, self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CepeConfig:
        with open(path) as f:
            return cls.from_dict(json.load(f))


def default_encoder_config(decoder_config: Any) -> EncoderConfig:
    """An encoder about a quarter of the decoder's width and depth, sharing its vocabulary
    (plus one ``[MASK]`` token for masked-LM pre-training)."""
    d = int(decoder_config.hidden_size)
    width = max(64, int(math.ceil(d / 4 / 64)) * 64)
    heads = max(1, width // 64)
    layers = max(2, int(decoder_config.num_hidden_layers) // 4)
    vocab = int(decoder_config.vocab_size)
    return EncoderConfig(
        vocab_size=vocab + 1,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * width,
        rms_norm_eps=float(getattr(decoder_config, "rms_norm_eps", 1e-5) or 1e-5),
        mask_token_id=vocab,
    )


# Decoder families whose layers are exactly :class:`cepe.encoder.EncoderLayer` (RMSNorm, RoPE, SwiGLU, no
# biases), so an encoder can start as a copy of their first layers.
ENCODER_FROM_DECODER_FAMILIES = ("llama", "mistral")


def _rope_theta(decoder_config: Any) -> float:
    theta = getattr(decoder_config, "rope_theta", None)
    params = getattr(decoder_config, "rope_parameters", None) or getattr(decoder_config, "rope_scaling", None)
    if isinstance(params, dict):
        check(
            params.get("rope_type", params.get("type", "default")) == "default",
            f"an encoder built from the decoder needs plain RoPE; the decoder uses {params}",
        )
        theta = params.get("rope_theta", theta)
    return float(theta or 10000.0)


def encoder_config_from_decoder(
    decoder_config: Any, num_layers: int = 4, causal: bool = False, output_size: int | None = None
) -> EncoderConfig:
    """An encoder with the decoder's own layer shape (width, heads, MLP, RoPE), ``num_layers`` deep, reading
    the decoder's vocabulary through its embeddings (no ``[MASK]`` token): the architecture that
    :meth:`cepe.CepeForCausalLM.init_encoder_from_decoder` fills with the decoder's first layers.
    ``output_size``: Φ's width after a learned down-projection (None: the decoder's width).

    Raises:
        ValueError: a decoder family whose layers differ from the encoder's (biases, other norms or
            activations), or more layers than the decoder has.
    """
    model_type = getattr(decoder_config, "model_type", None)
    check(
        model_type in ENCODER_FROM_DECODER_FAMILIES,
        f"an encoder built from the decoder needs Llama-shaped layers ({ENCODER_FROM_DECODER_FAMILIES}); "
        f"got {model_type!r}: use a separate encoder (encoder config fields) instead",
    )
    for flag in ("attention_bias", "mlp_bias"):
        check(not getattr(decoder_config, flag, False), f"the decoder uses {flag}; the encoder has no biases")
    act = getattr(decoder_config, "hidden_act", "silu")
    check(act == "silu", f"the decoder's MLP uses {act!r}; the encoder's is SwiGLU (silu)")
    n_dec = int(decoder_config.num_hidden_layers)
    check(
        0 < num_layers <= n_dec,
        f"encoder layers must be in 1..{n_dec} (the decoder's depth), got {num_layers}",
    )
    heads = int(decoder_config.num_attention_heads)
    return EncoderConfig(
        vocab_size=int(decoder_config.vocab_size),
        hidden_size=int(decoder_config.hidden_size),
        num_hidden_layers=int(num_layers),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(decoder_config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(decoder_config, "head_dim", None) or decoder_config.hidden_size // heads),
        intermediate_size=int(decoder_config.intermediate_size),
        rms_norm_eps=float(getattr(decoder_config, "rms_norm_eps", 1e-5) or 1e-5),
        rope_theta=_rope_theta(decoder_config),
        causal=bool(causal),
        output_size=None if output_size is None else int(output_size),
    )


def is_adapter_key(name: str) -> bool:
    """True for parameter names CEPE adds: ``encoder.*``, ``*.cross_attn.*``, ``mix_head.*`` and
    ``copy_head.*`` (the output mixture's heads): the trainable set."""
    return name.startswith(("encoder.", "mix_head.", "copy_head.")) or ".cross_attn." in name
