"""``CepeForCausalLM``: a frozen Hugging Face decoder plus a context encoder and cross-attention.

Shape legend: B batch, K chunks, L chunk length, S = K·L encoder tokens, T decoder tokens, V vocabulary,
D_enc the width of Φ (the encoder's, or its down-projection's).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from .config import CACHE_MODES, COPY_HEAD_INPUTS, CepeConfig, default_encoder_config
from .cross_attention import CrossContext, zero_linear
from .encoder import ContextEncoder
from .fileio import umask
from .layers import norm_scale
from .mixture import (
    COPY_BIAS,
    CopySpans,
    context_token_ids,
    copy_agreement_feature,
    copy_mix_logits,
    copy_mix_nll,
    copy_recency_feature,
    head_inputs,
    mix_head,
    mix_logit,
    mix_logits,
    reader_sure_feature,
    top_logprob,
    widen_head,
)
from .quant import QUANT_MODES, dequantize_int8, quantize_int8
from .wrapping import ContextSlot, attach_cross_attention, decoder_layers, family_of

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "cepe_config.json"


class CepeForCausalLM(nn.Module):
    """A decoder-only LM extended with CEPE.

    The decoder's own parameters are frozen; only ``encoder.*`` and ``*.cross_attn.*`` train. The state
    dict uses the released checkpoints' names (``model.layers.{i}.cross_attn.*``, ``encoder.*``).
    """

    def __init__(self, decoder: nn.Module, cepe_config: CepeConfig) -> None:
        super().__init__()
        cepe_config = copy.deepcopy(cepe_config)  # the caller's config is never changed
        cepe_config.decoder_vocab_size = int(decoder.config.vocab_size)
        cepe_config.validate()
        self.cepe_config = cepe_config
        for p in decoder.parameters():
            p.requires_grad_(False)
        self._slot = ContextSlot()
        n_layers = len(decoder_layers(decoder))
        self.cross_layers = cepe_config.layer_indices(n_layers)
        attach_cross_attention(
            decoder,
            self.cross_layers,
            cepe_config.encoder.state_size,
            self._slot,
            gated=cepe_config.init_mode == "gate",
            null_key=cepe_config.null_key,
            token_gate=cepe_config.token_gate,
            match_gate=cepe_config.match_gate,
            length_scale=cepe_config.length_scale,
            length_scale_below=cepe_config.length_scale_below,
            length_scale_above=cepe_config.length_scale_above,
            short_gate=cepe_config.short_gate,
            long_gate=cepe_config.long_gate,
            induction_gate=cepe_config.induction_gate,
            run_bias=cepe_config.run_bias,
        )
        # Registered under the decoder's own top-level names so ``model.layers.{i}.cross_attn`` keeps
        # the released layout: the decoder's submodules are this module's submodules.
        self.decoder = decoder
        p = next(decoder.parameters())
        shared = None
        if cepe_config.share_embeddings:
            shared = decoder.get_input_embeddings()
            if cepe_config.encoder.hidden_size != shared.weight.shape[1]:
                raise ValueError(
                    f"share_embeddings needs encoder.hidden_size = the decoder's embedding width "
                    f"{shared.weight.shape[1]}, got {cepe_config.encoder.hidden_size}"
                )
        self.encoder = ContextEncoder(cepe_config.encoder, cepe_config.attn_implementation, shared).to(
            p.device
        )
        self.mix_head = None
        if cepe_config.output_mix:
            c = cepe_config
            names = head_inputs(
                int(decoder.config.hidden_size), c.mix_match, c.mix_hidden, c.mix_length, c.mix_agree
            )
            self.mix_head = mix_head(names, p)
        self.copy_head = None
        if cepe_config.mix_copy:
            self.copy_head = self._new_copy_head()

    def _new_copy_head(self) -> nn.Linear:
        """The copy head (``CepeConfig.mix_copy``) over the mixing head's inputs: zero weights, bias
        :data:`cepe.mixture.COPY_BIAS`."""
        c = self.cepe_config
        d = int(self.decoder.config.hidden_size)
        names = head_inputs(d, c.mix_match, c.mix_hidden, c.mix_length, c.mix_agree, *self._copy_own())
        head = mix_head(names, next(self.decoder.parameters()))
        with torch.no_grad():
            head.bias.fill_(COPY_BIAS)
        return head

    def _copy_own(self) -> tuple[bool, ...]:
        """Which inputs of its own the copy head takes, one flag per name of
        :data:`cepe.config.COPY_HEAD_INPUTS`."""
        return tuple(bool(getattr(self.cepe_config, name)) for name in COPY_HEAD_INPUTS)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_decoder(
        cls,
        decoder: nn.Module | str | os.PathLike[str],
        cepe_config: CepeConfig | None = None,
        dtype: torch.dtype | None = None,
    ) -> CepeForCausalLM:
        """Wrap a decoder (a loaded HF model, a hub id, a local dir, or ``"default"``).

        With no ``cepe_config``, the encoder is sized from the decoder (about a quarter of its width,
        see :func:`cepe.config.default_encoder_config`). Cross-attention q/k/v are copied from each
        layer's self-attention and o_proj is zero (``init_mode="zero"``) or copied (``"copy"``).

        ``dtype``: with a dtype, every part (decoder, encoder, cross-attention) is in it, a given decoder
        module included; without, the decoder keeps its dtype (fp32 when loaded by name) and the encoder
        is fp32. ``cepe_config`` is copied, never changed.
        """
        name = None
        if not isinstance(decoder, nn.Module):
            from .assets import load_decoder_model

            name = str(decoder)
            decoder = load_decoder_model(name, dtype=dtype)
        if cepe_config is None:
            cepe_config = CepeConfig(encoder=default_encoder_config(decoder.config))
        cepe_config = copy.deepcopy(cepe_config)
        if cepe_config.decoder_name_or_path is None:
            from .assets import decoder_source  # a GGUF-loaded decoder records its file

            cepe_config.decoder_name_or_path = name or decoder_source(decoder)
        model = cls(decoder, cepe_config)
        model.init_cross_attention(cepe_config.init_mode)
        if dtype is not None:
            model.to(dtype)
        return model

    @torch.no_grad()
    def init_cross_attention(self, mode: str = "zero") -> None:
        """(Re-)initialise every cross-attention from its layer's self-attention (see
        :meth:`CrossAttention.init_from_self_attention`): the query norm from the layer's pre-MLP norm
        (the released code), or with ``mirror_self_attention`` from ``input_layernorm``, folded into k/v;
        then, with a down-projection of Φ, that projection and k/v (:meth:`init_projection`)."""
        family = family_of(self.decoder)
        layers = decoder_layers(self.decoder)
        mirror = self.cepe_config.mirror_self_attention
        if mirror and self.cepe_config.encoder.hidden_size != int(self.decoder.config.hidden_size):
            raise ValueError(
                "mirror_self_attention needs an encoder as wide as the decoder "
                f"({self.decoder.config.hidden_size}), got {self.cepe_config.encoder.hidden_size}"
            )
        for i in self.cross_layers:
            layer = layers[i]
            pre_mlp = norm_scale(getattr(layer, family.pre_mlp_norm))
            fold = norm_scale(getattr(layer, family.residual_tap)) if mirror else None
            layer.cross_attn.init_from_self_attention(
                layer.self_attn, mode, norm=fold if mirror else pre_mlp, fold=fold
            )
        self.init_projection()

    @torch.no_grad()
    def init_projection(self, second_moment: torch.Tensor | None = None) -> None:
        """Initialise the encoder's down-projection (``encoder.output_size``) and every cross-attention's
        k/v from the layers' self-attention k/v maps (folded as :meth:`init_cross_attention` folds them), so
        that ``k_proj(out_proj(x))`` is the best rank-``output_size`` approximation of the full-width maps,
        jointly over layers (:func:`projection_init`); q, o_proj and the gates are left as they are.

        Args:
            second_moment: ``(D, D)`` E[x xᵀ] of the encoder's full-width states (:meth:`fit_projection`):
                the approximation is then best on such states rather than on every direction alike.

        Does nothing without a projection, or when the encoder is narrower than the decoder (the
        projection then keeps its random init and k/v their first columns, as without one).
        """
        enc = self.cepe_config.encoder
        if enc.output_size is None or enc.hidden_size != int(self.decoder.config.hidden_size):
            return
        family = family_of(self.decoder)
        layers = decoder_layers(self.decoder)
        maps = []
        for i in self.cross_layers:
            attn = layers[i].self_attn
            for w in (attn.k_proj.weight, attn.v_proj.weight):
                if self.cepe_config.mirror_self_attention:
                    w = w * norm_scale(getattr(layers[i], family.residual_tap)).to(w.dtype)
                maps.append(w)
        proj, new = projection_init(maps, enc.output_size, second_moment)
        self.encoder.out_proj.weight.copy_(proj)
        for j, i in enumerate(self.cross_layers):
            cross = layers[i].cross_attn
            cross.k_proj.weight.copy_(new[2 * j])
            cross.v_proj.weight.copy_(new[2 * j + 1])

    @torch.no_grad()
    def fit_projection(
        self, encoder_input_ids: torch.Tensor, encoder_attention_mask: torch.Tensor | None = None
    ) -> None:
        """:meth:`init_projection` fitted to the encoder's states on these chunks ``(B, K, L)``: the
        projection keeps what k/v read from such text (real tokens only; a few thousand tokens suffice)."""
        if self.encoder.out_proj is None:
            raise ValueError("fit_projection needs a down-projection: set encoder.output_size")
        b, k, length = encoder_input_ids.shape
        ids = encoder_input_ids.reshape(b * k, length)
        if encoder_attention_mask is None:
            mask = torch.ones_like(ids, dtype=torch.bool)
        else:
            mask = encoder_attention_mask.reshape(b * k, length).bool()
        ids, mask = ids[mask.any(-1)], mask[mask.any(-1)]  # chunks with a real token, as encode_chunks
        dim = self.cepe_config.encoder.hidden_size
        moment = torch.zeros(dim, dim, dtype=torch.float64, device=ids.device)
        count = 0
        step = self.cepe_config.encoder_micro_batch
        for start in range(0, ids.shape[0], step):
            sub = mask[start : start + step]
            x = self.encoder(ids[start : start + step], sub, project=False)[sub].double()  # (real, D)
            moment += x.T @ x
            count += x.shape[0]
        if count == 0:
            raise ValueError("fit_projection got no real token in its chunks")
        self.init_projection(moment / count)

    @torch.no_grad()
    def init_encoder_from_decoder(self) -> None:
        """Copy the decoder's first ``encoder.num_hidden_layers`` layers into the encoder (its final norm
        set to ones, so Φ is the decoder's unit-RMS hidden state after those layers when the encoder is
        causal). The encoder must have the decoder's layer shape: see
        :func:`cepe.config.encoder_config_from_decoder`."""
        layers = decoder_layers(self.decoder)
        for j, enc_layer in enumerate(self.encoder.layers):
            src = {k: v for k, v in layers[j].state_dict().items() if ".cross_attn." not in f".{k}"}
            src = {k: v for k, v in src.items() if not k.startswith("cross_attn.")}
            missing, unexpected = enc_layer.load_state_dict(src, strict=False)
            if missing or unexpected:
                raise ValueError(
                    f"decoder layer {j} does not fit the encoder layer: missing {missing[:4]}, "
                    f"unexpected {unexpected[:4]}; build the encoder with encoder_config_from_decoder"
                )
        self.encoder.norm.weight.fill_(1.0)

    # ------------------------------------------------------------------ properties
    @property
    def config(self):
        """The decoder's HF config (generation and tooling read it)."""
        return self.decoder.config

    @property
    def device(self) -> torch.device:
        return next(self.decoder.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.decoder.parameters()).dtype

    def cross_attention_modules(self) -> list[nn.Module]:
        layers = decoder_layers(self.decoder)
        return [layers[i].cross_attn for i in self.cross_layers]

    def enable_null_key(self) -> None:
        """Give every cross-attention head group a "no match" key (``CepeConfig.null_key``), zero, to an
        adapter trained without one (a zero null key is a key of score 0 whose value is 0: the real keys'
        weights shrink by ``Z / (Z + 1)``). Idempotent."""
        for m in self.cross_attention_modules():
            if m.null_key is None:
                w = m.q_proj.weight
                m.null_key = nn.Parameter(torch.zeros(m.num_kv, m.head_dim, device=w.device, dtype=w.dtype))
        self.cepe_config.null_key = True

    def enable_token_gate(self) -> None:
        """Give every cross-attention layer its per-token head strengths (``CepeConfig.token_gate``), zero,
        to an adapter trained without them (a zero gate is exactly 1: the function is unchanged).
        Idempotent."""
        for m in self.cross_attention_modules():
            if m.token_gate is None:
                m.token_gate = zero_linear(m.q_proj.in_features, m.num_heads, m.q_proj.weight)
        self.cepe_config.token_gate = True

    def enable_match_gate(self) -> None:
        """Give every cross-attention layer its match-strength head gates (``CepeConfig.match_gate``), zero,
        to an adapter trained without them (a zero gate is exactly 1: the function is unchanged).
        Idempotent."""
        for m in self.cross_attention_modules():
            if m.match_gate is None:
                w = m.q_proj.weight
                m.match_gate = nn.Parameter(torch.zeros(m.num_heads, 3, device=w.device, dtype=w.dtype))
                m.add_match_norm()
                for side in ("short", "long"):  # their match weights
                    if getattr(m, f"{side}_gate") is not None:
                        m.add_side_gate(side)
        self.cepe_config.match_gate = True

    def enable_short_gate(self) -> None:
        """Give every cross-attention layer its gates for contexts shorter than the pivot
        (``CepeConfig.short_gate``), zero, to an adapter with length exponents (``length_scale``) trained
        without them (exactly 1: the function is unchanged). Idempotent."""
        self._enable_side_gate("short")

    def enable_long_gate(self) -> None:
        """:meth:`enable_short_gate` for contexts longer than the pivot (``CepeConfig.long_gate``)."""
        self._enable_side_gate("long")

    def enable_induction_gate(self) -> None:
        """Give every cross-attention head its weight on the induction statistic (``CepeConfig.induction_gate``),
        zero, to an adapter trained without (exactly 1: the function is unchanged). Idempotent."""
        for m in self.cross_attention_modules():
            if m.induction_gate is None:
                w = m.q_proj.weight
                m.induction_gate = nn.Parameter(torch.zeros(m.num_heads, device=w.device, dtype=w.dtype))
        self.cepe_config.induction_gate = True

    def enable_run_bias(self) -> None:
        """Give every cross-attention head its bias on the key that continues its previous read
        (``CepeConfig.run_bias``), zero, to an adapter trained without (the function is unchanged).
        Idempotent."""
        for m in self.cross_attention_modules():
            if m.run_bias is None:
                w = m.q_proj.weight
                m.run_bias = nn.Parameter(torch.zeros(m.num_heads, device=w.device, dtype=w.dtype))
        self.cepe_config.run_bias = True

    def enable_output_mix(
        self, match: int = 0, hidden: bool = True, length: bool = False, agree: bool = False
    ) -> None:
        """Give an adapter trained without it the output mixture (``CepeConfig.output_mix``) and its zero
        head (λ = ½: unlike the gates, this changes the function until the head trains), with ``match``
        suffix-match inputs (``mix_match``), the hidden states as inputs or not (``mix_hidden``), the
        context's length as an input or not (``mix_length``) and the successor agreements or not
        (``mix_agree``). A head trained without the length or the agreements gets them with zero weights
        (its function unchanged). Idempotent; an adapter whose head has other inputs raises
        ``ValueError``."""
        c = self.cepe_config
        if self.mix_head is not None and (
            (c.mix_match, c.mix_hidden) != (match, hidden)
            or (c.mix_length and not length)
            or (c.mix_agree and not agree)
        ):
            raise ValueError(
                f"this adapter's mixing head takes mix_match {c.mix_match}, mix_hidden {c.mix_hidden}, "
                f"mix_length {c.mix_length}, mix_agree {c.mix_agree}; asked for {match}, {hidden}, "
                f"{length}, {agree}: train a new adapter from one without output_mix"
            )
        for flag, name in ((length, "mix_length"), (agree, "mix_agree")):
            if flag and match < 1:
                raise ValueError(f"{name} rides with the suffix-match inputs: give match > 0")
        d = int(self.decoder.config.hidden_size)
        if self.mix_head is None:
            like = next(self.decoder.parameters())
            self.mix_head = mix_head(head_inputs(d, match, hidden, length, agree), like)
            c.mix_hash = "exact"  # new heads, fitted on the exact suffix inputs
        elif (length and not c.mix_length) or (agree and not c.mix_agree):  # more inputs, zero weights
            old = head_inputs(d, match, hidden, c.mix_length, c.mix_agree)
            new = head_inputs(d, match, hidden, length or c.mix_length, agree or c.mix_agree)
            self.mix_head = widen_head(self.mix_head, old, new)
            if self.copy_head is not None:
                own = self._copy_own()
                old_copy = head_inputs(d, match, hidden, c.mix_length, c.mix_agree, *own)
                new_copy = head_inputs(d, match, hidden, length or c.mix_length, agree or c.mix_agree, *own)
                self.copy_head = widen_head(self.copy_head, old_copy, new_copy)
        c.output_mix, c.mix_match, c.mix_hidden = True, match, hidden
        c.mix_length = c.mix_length or length
        c.mix_agree = c.mix_agree or agree

    def set_mix_length_cap(self, cap: int | None) -> None:
        """Cap the heads' length input at ``cap`` context tokens (``CepeConfig.mix_length_cap``; None: no
        cap); raises ``ValueError`` unless the heads take the length (``mix_length``) and ``cap`` is
        positive."""
        if cap is not None and (not self.cepe_config.mix_length or int(cap) < 1):
            raise ValueError(
                f"mix_length_cap caps the heads' length input: give a positive number of tokens to an "
                f"adapter with mix_length (this one: mix_length {self.cepe_config.mix_length}), got {cap}"
            )
        self.cepe_config.mix_length_cap = None if cap is None else int(cap)

    def set_mix_copy_decay(self, decay: float) -> None:
        """Weigh the copy's votes by ``(1 + d / 64) ** -decay`` for ``d`` how far before the context's end
        each stands (``CepeConfig.mix_copy_decay``; 0: each occurrence one vote); raises ``ValueError``
        without the copy (``enable_output_copy``) or for a negative or infinite ``decay``."""
        if not self.cepe_config.mix_copy and float(decay) != 0:
            raise ValueError("mix_copy_decay weighs the copy's votes: enable_output_copy first")
        if not math.isfinite(float(decay)) or float(decay) < 0:
            raise ValueError(
                f"mix_copy_decay weighs the copy's votes by (1 + d/64)^-decay: give a finite number ≥ 0, got {decay}"
            )
        self.cepe_config.mix_copy_decay = float(decay)

    def enable_output_copy(
        self,
        prob: bool = False,
        near: bool = False,
        sure: bool = False,
        top: bool = False,
        read: bool = False,
        count: bool = False,
    ) -> None:
        """Give an adapter with the output mixture and its suffix-match inputs the copy
        (``CepeConfig.mix_copy``) and its head (zero weights over the mixing head's inputs, bias −4: μ ≈
        0.018 wherever a suffix occurs, so this changes the function there until the head trains), with
        ``prob`` its input of the mixture's probability of the copy's tokens (``mix_copy_prob``) and
        ``near`` its input of how far back the copied suffix last occurs (``mix_copy_near``) and ``sure``
        its input of how sure the reader is of its next token (``mix_copy_sure``) and ``top`` its input of
        the largest share one token has of the copy's votes (``mix_copy_top``) and ``read`` its input of
        how probable the reader finds what the copy proposes (``mix_copy_read``) and ``count`` its input of
        how many times the matched suffix occurs (``mix_copy_count``); a copy head
        trained without those inputs gets them with zero weights (its function unchanged). Idempotent (it
        never removes an input); raises ``ValueError`` without ``output_mix`` and ``mix_match``."""
        c = self.cepe_config
        if self.mix_head is None or c.mix_match < 1:
            raise ValueError(
                "mix_copy needs the output mixture with suffix-match inputs: enable_output_mix first"
            )
        wanted = (prob, near, sure, top, read, count)  # in the order of COPY_HEAD_INPUTS
        if self.copy_head is None:
            for name, want in zip(COPY_HEAD_INPUTS, wanted, strict=True):
                setattr(c, name, want)
            self.copy_head = self._new_copy_head()
        elif any(want and not has for want, has in zip(wanted, self._copy_own(), strict=True)):
            d = int(self.decoder.config.hidden_size)
            args = (d, c.mix_match, c.mix_hidden, c.mix_length, c.mix_agree)
            old = head_inputs(*args, *self._copy_own())
            for name, want in zip(COPY_HEAD_INPUTS, wanted, strict=True):
                setattr(c, name, getattr(c, name) or want)
            self.copy_head = widen_head(self.copy_head, old, head_inputs(*args, *self._copy_own()))
        c.mix_copy = True

    def disable_output_mix(self) -> None:
        """Remove the output mixture, its copy and their heads: the model becomes the CEPE adapter they
        were trained over (the paper's function; the decoder runs once per call). Idempotent."""
        self.mix_head = None
        self.copy_head = None
        defaults = CepeConfig.__dataclass_fields__
        names = (
            "output_mix",
            "mix_match",
            "mix_hidden",
            "mix_length",
            "mix_length_cap",
            "mix_agree",
            "mix_copy",
            *COPY_HEAD_INPUTS,
            "mix_copy_decay",
            "mix_hash",  # a mixture added later (heads fitted anew) hashes exactly
        )
        for name in names:
            setattr(self.cepe_config, name, defaults[name].default)

    def _enable_side_gate(self, side: str) -> None:
        if self.cepe_config.length_scale is None:
            raise ValueError(f"{side}_gate needs length_scale (its pivot): enable_length_scale first")
        for m in self.cross_attention_modules():
            m.add_side_gate(side)
        setattr(self.cepe_config, f"{side}_gate", True)

    def enable_length_scale(self, length: int, below: bool = False, above: bool = False) -> None:
        """Give every cross-attention head its context-length exponent (``CepeConfig.length_scale``: the
        query scaled by ``(n / length)^τ_h``), zero, to an adapter trained without (exactly 1: the function
        is unchanged). ``below``: ``CepeConfig.length_scale_below``, fixed once the exponents exist.
        ``above``: ``CepeConfig.length_scale_above``, the exponents for longer contexts, also zero, which an
        adapter with exponents for the same pivot may gain later. Idempotent for the same arguments."""
        c = self.cepe_config
        if c.length_scale is not None and (c.length_scale != length or c.length_scale_below != below):
            raise ValueError(
                f"this adapter's length_scale is {c.length_scale} (below: {c.length_scale_below}), not "
                f"{length} (below: {below}): its exponents were trained for that reference"
            )
        if c.length_scale_above and not above:
            raise ValueError(
                "this adapter has exponents for contexts above its pivot (length_scale_above): keep "
                "length_scale_above: true"
            )
        for m in self.cross_attention_modules():
            w = m.q_proj.weight
            if m.length_exp is None:
                m.length_exp = nn.Parameter(torch.zeros(m.num_heads, device=w.device, dtype=w.dtype))
                m.length_ref = float(length)
                m.length_below = bool(below)
            if above and m.length_exp_above is None:
                m.length_exp_above = nn.Parameter(torch.zeros(m.num_heads, device=w.device, dtype=w.dtype))
        c.length_scale = int(length)
        c.length_scale_below = bool(below)
        c.length_scale_above = bool(above)
        c.validate()

    @torch.no_grad()
    def calibrate_match_gate(self, run: Callable[[], Any], min_std: float = 1e-3) -> dict[int, torch.Tensor]:
        """Standardise the match gates' features on real inputs: ``run()`` makes forward passes with
        context (the training stage's first micro-batches, say); every head's ``match_norm`` becomes the
        mean and standard deviation of its ``(m, κ̂)`` over the decoder tokens of rows with context, so that
        its gate weights see features of unit scale around zero (the gate's bias then sets its strength and
        its weights only how it differs from token to token). Meant for fresh (zero) gates, which are 1
        whatever the norms, so one pass sees every layer's own statistics. Returns ``{layer: (H, 4) norms}``.
        Raises ``ValueError``, every norm left as it was, when a layer saw fewer than 2 decoder tokens with
        context in all (no standard deviation) or features that are not finite.
        """
        mods = self.cross_attention_modules()
        if not self.cepe_config.match_gate:
            raise ValueError("calibrate_match_gate needs match gates: enable_match_gate() first")
        for m in mods:
            m.match_record = []
        try:
            run()
            out = {}
            norms: dict[nn.Module, torch.Tensor] = {}
            for m in mods:
                if not m.match_record:
                    raise ValueError(
                        f"calibrate_match_gate: layer {m.layer_idx} saw no decoder token with context; "
                        "run() must make forward passes with encoder inputs"
                    )
                x = torch.cat(m.match_record, dim=1)  # (H, N, 2)
                if x.shape[1] < 2:  # the (unbiased) standard deviation of one value is NaN
                    raise ValueError(
                        f"calibrate_match_gate: layer {m.layer_idx} saw {x.shape[1]} decoder token with "
                        "context; the standard deviation needs at least 2: run() must make forward passes "
                        "over 2 or more decoder tokens (in all) of rows with context"
                    )
                mean, std = x.mean(1), x.std(1).clamp_min(min_std)  # (H, 2)
                norm = torch.stack([mean[:, 0], std[:, 0], mean[:, 1], std[:, 1]], dim=1)
                if not norm.isfinite().all():
                    raise ValueError(
                        f"calibrate_match_gate: layer {m.layer_idx}'s match features are not finite "
                        "(NaN or inf in the recorded (m, κ̂)); no layer's norm was changed"
                    )
                norms[m] = norm
                out[m.layer_idx] = norm
            for m, norm in norms.items():  # all or nothing: a failing layer leaves every norm as it was
                m.match_norm.copy_(norm.to(m.match_norm.dtype))
            return out
        finally:
            for m in mods:
                m.match_record = None

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """Only the added weights, under the released names (``encoder.*``, ``model.layers.{i}.cross_attn.*``),
        and ``mix_head.*`` with the output mixture (``copy_head.*`` with its copy)."""
        out = {f"encoder.{k}": v for k, v in self.encoder.state_dict().items()}
        for k, v in self.decoder.state_dict().items():
            if ".cross_attn." in k:
                out[k] = v
        if self.mix_head is not None:
            out.update({f"mix_head.{k}": v for k, v in self.mix_head.state_dict().items()})
        if self.copy_head is not None:
            out.update({f"copy_head.{k}": v for k, v in self.copy_head.state_dict().items()})
        return out

    def trainable_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters with ``requires_grad``: exactly the encoder's, the cross-attention's and the output
        mixture's heads' (``mix_head``, ``copy_head``)."""
        return (p for p in self.parameters() if p.requires_grad)

    def train(self, mode: bool = True) -> CepeForCausalLM:
        """Train mode for the added modules; the frozen decoder stays in eval mode (no dropout)."""
        super().train(mode)
        self.decoder.eval()
        for m in self.cross_attention_modules():
            m.train(mode)
        return self

    # ------------------------------------------------------------------ context
    def encode_context(
        self, encoder_input_ids: torch.Tensor, encoder_attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode chunks ``(B, K, L)`` into Φ ``(B, S, D_enc)`` and a key mask ``(B, S)`` (bool)."""
        self._check_encoder_inputs(encoder_input_ids, encoder_attention_mask)
        return self.encoder.encode_chunks(
            encoder_input_ids, encoder_attention_mask, micro_batch=self.cepe_config.encoder_micro_batch
        )

    @property
    def reads_context_ids(self) -> bool:
        """Whether the output mixture matches the decoder's last tokens in the context's token ids
        (``mix_match``): precomputed states then need those ids too (``prepare_context``)."""
        return bool(self.cepe_config.output_mix and self.cepe_config.mix_match)

    def prepare_context(
        self,
        encoder_input_ids: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        cross_attention_cache: str | None = None,
    ) -> CrossContext | None:
        """Build the :class:`CrossContext` that cross-attention reads: encodes the chunks once.

        Args:
            encoder_input_ids: ``(B, K, L)`` chunk token ids. With ``encoder_hidden_states``, only for an
                adapter whose output mixture matches the decoder's last tokens in the context
                (``mix_match``): the token ids of the states' positions (``(B, S)`` or ``(B, K, L)``,
                ``K·L = S``), read by the match and not encoded again.
            encoder_attention_mask: ``(B, K, L)`` (or ``(B, S)`` with precomputed states), True on real tokens.
            encoder_hidden_states: precomputed Φ ``(B, S, D_enc)`` instead of encoding ``encoder_input_ids``.
            cross_attention_cache: ``"kv" | "states" | "absorbed"`` (default: the config's).

        Returns:
            The context, or None when no context was given (the model is then exactly the decoder).
        """
        mode = cross_attention_cache or self.cepe_config.cross_attention_cache
        if mode not in CACHE_MODES:
            raise ValueError(f"cross_attention_cache must be one of {CACHE_MODES}, got {mode!r}")
        if encoder_hidden_states is not None:
            states = encoder_hidden_states
            if states.dim() != 3 or states.shape[-1] != self.cepe_config.encoder.state_size:
                raise ValueError(
                    f"encoder_hidden_states must be (B, S, {self.cepe_config.encoder.state_size}), "
                    f"got {tuple(states.shape)}"
                )
            if encoder_input_ids is not None:
                if not self.reads_context_ids:
                    raise ValueError(
                        "give encoder_input_ids or encoder_hidden_states, not both (token ids go with "
                        "precomputed states only for an adapter whose output mixture matches them, mix_match)"
                    )
                if encoder_input_ids.numel() != states.shape[0] * states.shape[1]:
                    raise ValueError(
                        f"encoder_input_ids {tuple(encoder_input_ids.shape)} must give one token id per "
                        f"position of encoder_hidden_states {tuple(states.shape[:2])}"
                    )
            mask = None
            if encoder_attention_mask is not None:
                mask = encoder_attention_mask.reshape(states.shape[0], -1).bool()
                if mask.shape[1] != states.shape[1]:
                    raise ValueError(
                        f"encoder_attention_mask covers {mask.shape[1]} positions, states have {states.shape[1]}"
                    )
        elif encoder_input_ids is not None:
            states, mask = self.encode_context(encoder_input_ids, encoder_attention_mask)
        else:
            return None
        if mask is None:
            mask = torch.ones(states.shape[:2], dtype=torch.bool, device=states.device)
        counts = mask.sum(-1)  # (B,) real context tokens per example
        if self.cepe_config.pack_keys:
            states, mask = pack_keys(states, mask, counts)
        has = counts > 0
        if not bool(has.any()):
            return None  # fully padded context: exactly the decoder
        has_context = None
        if not bool(has.all()):
            has_context = has.to(states.dtype)[:, None, None]
            mask = mask | ~has[:, None]  # keep softmax finite; the output is zeroed by has_context
        q_scale = None
        if self.cepe_config.score_scaling != "none":
            scales = [self.cepe_config.score_scale(float(c)) for c in counts.tolist()]
            q_scale = torch.tensor(scales, dtype=torch.float32, device=states.device)[:, None, None, None]
        if bool(mask.all()):
            mask = None
        match_ids, order = None, self.cepe_config.mix_match if self.cepe_config.output_mix else 0
        if order and encoder_input_ids is not None:
            match_ids = context_token_ids(encoder_input_ids, encoder_attention_mask)
        return CrossContext(
            states=states.to(self.dtype) if not torch.is_autocast_enabled(states.device.type) else states,
            key_mask=mask,
            mode=mode,
            impl=self.cepe_config.attn_implementation,
            q_scale=q_scale,
            has_context=has_context,
            out_scale=float(self.cepe_config.context_scale),
            log_n=counts.clamp_min(1).float().log() if self.cepe_config.length_scale else None,
            match_ids=match_ids,
            match_order=order,
            match_length=bool(order) and self.cepe_config.mix_length,
            match_length_cap=self.cepe_config.mix_length_cap,
            match_agree=bool(order) and self.cepe_config.mix_agree,
            match_copy=bool(order) and self.cepe_config.mix_copy,
            match_near=bool(order) and self.cepe_config.mix_copy_near,
            match_decay=float(self.cepe_config.mix_copy_decay)
            if order and self.cepe_config.mix_copy
            else 0.0,
            match_wrap=self.cepe_config.mix_hash == "wrap",
        )

    @contextlib.contextmanager
    def use_context(self, ctx: CrossContext | None, repeats: tuple[int, ...] = (1,)) -> Iterator[None]:
        """Run decoder calls inside this block with cross-attention reading ``ctx``.

        ``repeats``: decoder batches of ``ctx.batch_size × r`` rows for these ``r`` get the context repeated
        (``repeat_interleave``, as HF expands beams and samples); any other batch raises ``ValueError``.
        """
        prev = (self._slot.ctx, self._slot.repeats)
        self._slot.set(ctx, repeats)
        try:
            yield
        finally:
            self._slot.set(*prev)

    # ------------------------------------------------------------------ forward / generate
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_input_ids: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        cross_context: CrossContext | None = None,
        logits_to_keep: int = 0,
        return_logits: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Run the decoder with cross-attention to the encoded context.

        Args:
            input_ids: decoder tokens ``(B, T)``.
            attention_mask: decoder padding mask ``(B, T)``.
            encoder_input_ids: context chunks ``(B, K, L)``; examples may have different numbers of real
                chunks (all-padding chunks contribute nothing).
            encoder_attention_mask: ``(B, K, L)``, True on real context tokens.
            encoder_hidden_states: precomputed Φ ``(B, S, D_enc)`` instead of ``encoder_input_ids``.
            labels: ``(B, T)``; position t is predicted from positions < t (HF shift), -100 ignored. The
                loss is a mean fp32 cross-entropy computed from the logits of supervised positions only
                (0, not NaN, when no position is supervised).
            cross_context: a context from :meth:`prepare_context` (reused across incremental calls); its
                batch must be the decoder's.
            logits_to_keep: as in HF: keep only the last N positions' logits (0 = all), with or without
                labels (the loss always covers every supervised position).
            return_logits: with labels, ``False`` skips the logits (saves a ``(B, T, V)`` tensor in
                training); default True, as without labels.
            **kwargs: passed to the decoder (``past_key_values``, ``use_cache``, ``position_ids``...).

        Returns:
            ``CausalLMOutputWithPast`` with ``loss`` (if labels), ``logits`` and ``past_key_values``.
        """
        self._check_decoder_inputs(input_ids, labels)
        ctx = cross_context
        if ctx is None:
            ctx = self.prepare_context(encoder_input_ids, encoder_attention_mask, encoder_hidden_states)
        elif encoder_input_ids is not None or encoder_hidden_states is not None:
            raise ValueError("give cross_context or encoder inputs, not both")
        self._check_context_batch(input_ids, ctx)
        self._check_recomputation(ctx)
        if labels is not None:  # a loss: no self-attention cache unless asked for (HF's default builds one)
            kwargs.setdefault("use_cache", False)
        if ctx is not None and self.cepe_config.output_mix:
            with self.use_context(ctx.with_decoder_rows()):
                return self._mixed_forward(
                    input_ids, attention_mask, labels, logits_to_keep, return_logits, kwargs
                )
        with self.use_context(ctx):
            if labels is None:
                return self.decoder(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    logits_to_keep=logits_to_keep,
                    **kwargs,
                )
            base = self.decoder.get_decoder()
            out = base(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden = out.last_hidden_state  # (B, T, D_dec)
        shift_labels = labels[:, 1:]
        sel = shift_labels != -100
        logits_sel = self.lm_logits(hidden[:, :-1][sel])  # (N, V): only supervised positions
        loss = F.cross_entropy(logits_sel.float(), shift_labels[sel], reduction="sum")
        loss = loss / sel.sum().clamp_min(1)  # a mean; 0 (not NaN) when nothing is supervised
        logits = None
        if return_logits is None or return_logits:
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.lm_logits(hidden[:, keep])
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)

    def _mixed_forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        labels: torch.Tensor | None,
        logits_to_keep: int,
        return_logits: bool | None,
        kwargs: dict[str, Any],
    ) -> CausalLMOutputWithPast:
        """:meth:`forward` with the output mixture, the doubled context installed: one decoder call over
        ``2B`` rows (the first ``B`` read the context, the last ``B`` are the decoder alone; a cache it
        returns holds both), then the mixed logits of the first ``B``."""
        if input_ids is None or kwargs.get("inputs_embeds") is not None:
            raise ValueError(
                "output_mix runs the decoder twice from input_ids: give input_ids, not inputs_embeds"
            )
        n = input_ids.shape[0]
        kw = dict(kwargs)
        if kw.get("position_ids") is not None and kw["position_ids"].shape[0] == n:  # else (1, T): shared
            kw["position_ids"] = torch.cat([kw["position_ids"]] * 2)
        mask = _doubled_mask(attention_mask)
        out = self.decoder.get_decoder()(input_ids=torch.cat([input_ids] * 2), attention_mask=mask, **kw)
        hidden = out.last_hidden_state  # (2B, T, D)
        h_ctx, h_dec = hidden[:n], hidden[n:]
        match = None  # (B, T, K) the suffix-match inputs (mix_match), for this call's start (slot.past)
        copy = None  # (B, T) where each position's copy lies (mix_copy)
        if self.cepe_config.mix_match:
            ids = input_ids
            pad = self._slot.query_pad(2 * n, input_ids.shape[1])  # this call's padding columns
            if pad is not None:  # match nothing
                ids = input_ids.masked_fill(pad[:n], -1)
            match, copy = self._slot.get(2 * n).suffix_inputs(ids, self._slot.past)
        loss = None
        if labels is not None:
            shift = labels[:, 1:]
            sel = shift != -100
            m = None if match is None else match[:, :-1][sel]
            cp = None if copy is None else copy[:, :-1][sel]
            hc, hd, y = h_ctx[:, :-1][sel], h_dec[:, :-1][sel], shift[sel]
            mixed, lc = self._mixture_logits(hc, hd, m)  # (N, V) each
            nll = F.cross_entropy(mixed, y, reduction="none")  # (N,)
            if cp is not None:  # the copy's probability of each target, no (N, V) copy distributions
                c = self._copy_logit_of(hc, hd, m, cp, mixed, lc)
                nll = copy_mix_nll(nll, c, cp.target_probs(y), cp.has)
            loss = nll.sum() / sel.sum().clamp_min(1)
        logits = None
        if labels is None or return_logits is None or return_logits:
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.mixed_logits(
                h_ctx[:, keep],
                h_dec[:, keep],
                None if match is None else match[:, keep],
                None if copy is None else copy[:, keep],
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)

    def mixed_logits(
        self,
        h_ctx: torch.Tensor,
        h_dec: torch.Tensor,
        match: torch.Tensor | None = None,
        copy: CopySpans | None = None,
    ) -> torch.Tensor:
        """The output mixture's logits ``(..., V)`` (fp32) from final hidden states ``(..., D)`` with and
        without the context and, with ``mix_match``, the suffix-match inputs ``(..., K)``
        (:func:`cepe.mixture.mix_logits`); with ``mix_copy``, ``copy`` ``(...)`` mixes in the copy
        (:func:`cepe.mixture.copy_mix_logits`)."""
        logits, lc = self._mixture_logits(h_ctx, h_dec, match)
        if (copy is None) != (self.copy_head is None):
            raise ValueError(
                f"this adapter {'copies' if self.copy_head is not None else 'does not copy'} (mix_copy): "
                f"give copy spans exactly when it does, got {'none' if copy is None else 'some'}"
            )
        if copy is None:
            return logits
        c = self._copy_logit_of(h_ctx, h_dec, match, copy, logits, lc)
        return copy_mix_logits(logits, c, copy.probs(logits.shape[-1]), copy.has)

    def _copy_logit_of(
        self,
        h_ctx: torch.Tensor,
        h_dec: torch.Tensor,
        match: torch.Tensor | None,
        copy: CopySpans,
        mixed: torch.Tensor,
        lc: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`copy_logit` with the copy head's own inputs computed from the mixture's logits ``mixed``
        and the reader's ``lc`` ``(..., V)``."""
        return self.copy_logit(
            h_ctx,
            h_dec,
            match,
            copy,
            self._copy_expectation(mixed, copy),
            self._reader_top(lc),
            self._reader_expectation(lc, copy),
        )

    def _copy_expectation(self, logits: torch.Tensor, copy: CopySpans) -> torch.Tensor | None:
        """``Σ_y p_copy(y)·p_mixture(y)`` ``(...)`` from the mixture's logits ``(..., V)`` without the copy
        (no gradient flows through it) for the ``mix_copy_prob`` input, or None when the head does not
        take it."""
        if not self.cepe_config.mix_copy_prob:
            return None
        with torch.no_grad():
            return copy.expected(logits.float().log_softmax(-1))

    def _reader_expectation(self, logits_ctx: torch.Tensor, copy: CopySpans) -> torch.Tensor | None:
        """``Σ_y p_copy(y)·p_cepe(y)`` ``(...)`` from the reader's logits ``(..., V)`` (no gradient flows
        through it) for the ``mix_copy_read`` input, or None when the head does not take it."""
        if not self.cepe_config.mix_copy_read:
            return None
        with torch.no_grad():
            return copy.expected(logits_ctx.float().log_softmax(-1))

    def _reader_top(self, logits_ctx: torch.Tensor) -> torch.Tensor | None:
        """The reader's log-probability of its most probable token ``(...)`` from its logits ``(..., V)`` (no
        gradient flows through it) for the ``mix_copy_sure`` input, or None when the head does not take
        it."""
        if not self.cepe_config.mix_copy_sure:
            return None
        with torch.no_grad():
            return top_logprob(logits_ctx)

    def _mixture_logits(
        self, h_ctx: torch.Tensor, h_dec: torch.Tensor, match: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits ``(..., V)`` of the mixture of both sides, without the copy, and the reader's own
        logits ``(..., V)`` (the side with the context)."""
        lc = self.lm_logits(h_ctx)
        return mix_logits(lc, self.lm_logits(h_dec), self.mix_logit(h_ctx, h_dec, match)), lc

    def copy_logit(
        self,
        h_ctx: torch.Tensor,
        h_dec: torch.Tensor,
        match: torch.Tensor | None = None,
        copy: CopySpans | None = None,
        expect: torch.Tensor | None = None,
        top: torch.Tensor | None = None,
        read: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The copy logit ``(...)`` (μ = σ(c) where a suffix occurs) of the copy head
        (``CepeConfig.mix_copy``), over the mixing head's inputs and the copy head's own: with
        ``mix_copy_prob`` from ``expect`` ``(...)``, the mixture's probability of a draw from the copy
        (:func:`cepe.mixture.copy_agreement_feature`), with ``mix_copy_near`` from the copy spans ``copy``
        ``(...)`` (:func:`cepe.mixture.copy_recency_feature`), with ``mix_copy_sure`` from ``top`` ``(...)``,
        the reader's log-probability of its most probable token (:func:`cepe.mixture.reader_sure_feature`),
        with ``mix_copy_top`` from the copy spans (:meth:`cepe.mixture.CopySpans.top_share`), with
        ``mix_copy_read`` from ``read`` ``(...)``, the reader's probability of a draw from the copy, with
        ``mix_copy_count`` from the copy spans (:meth:`cepe.mixture.CopySpans.count_feature`); each
        required exactly when the head takes it."""
        c = self.cepe_config
        if self.copy_head is None:
            raise ValueError("this adapter has no copy head (mix_copy): enable_output_copy first")
        own = []
        if any(self._copy_own()):
            if (
                copy is None
                or (c.mix_copy_prob and expect is None)
                or (c.mix_copy_sure and top is None)
                or (c.mix_copy_read and read is None)
            ):
                raise ValueError(
                    "this copy head takes inputs of its own (mix_copy_prob, mix_copy_near, mix_copy_sure, "
                    "mix_copy_top, mix_copy_read): give the copy spans, with mix_copy_prob the mixture's "
                    "expectation of the copy, with mix_copy_sure the reader's top log-probability and with "
                    "mix_copy_read the reader's expectation of the copy"
                )
            if c.mix_copy_prob:
                own.append(copy_agreement_feature(expect, copy.has))
            if c.mix_copy_near:
                own.append(copy_recency_feature(copy))
            if c.mix_copy_sure:
                own.append(reader_sure_feature(top, copy.has))
            if c.mix_copy_top:
                own.append(copy.top_share())
            if c.mix_copy_read:
                own.append(copy_agreement_feature(read, copy.has))
            if c.mix_copy_count:
                own.append(copy.count_feature())
            match = torch.cat([match, torch.stack(own, dim=-1).to(match.dtype)], dim=-1)
        return mix_logit(self.copy_head, h_ctx, h_dec, match, c.mix_hidden)

    def mix_logit(
        self, h_ctx: torch.Tensor, h_dec: torch.Tensor, match: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The mixing logit ``(...)`` (λ = σ(a)) of this model's head (:func:`cepe.mixture.mix_logit`);
        ``match`` ``(..., K)`` is required exactly when the head takes suffix-match inputs."""
        if (match is None) != (self.cepe_config.mix_match == 0):
            raise ValueError(
                f"this mixing head takes {self.cepe_config.mix_match} suffix-match inputs (mix_match); "
                f"got {'none' if match is None else match.shape[-1]}"
            )
        return mix_logit(self.mix_head, h_ctx, h_dec, match, self.cepe_config.mix_hidden)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The decoder's output head on hidden states ``(..., D_dec)`` -> ``(..., V)`` (with soft-capping
        for families that use it); see :func:`decoder_logits`."""
        return decoder_logits(self.decoder, hidden)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_input_ids: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        cross_attention_cache: str | None = None,
        **generate_kwargs: Any,
    ) -> torch.Tensor:
        """HF ``generate`` with the context encoded once per call.

        ``cross_attention_cache`` picks ``"kv"`` (K/V projected once and cached per layer), ``"states"``
        (Φ only, re-projected every step) or ``"absorbed"`` (Φ only, projections folded); all give the
        same tokens up to floating-point rounding. The context batch must be the prompt batch; it is
        repeated only for ``num_beams`` / ``num_return_sequences``.

        Returns:
            ``(B, T + new)`` token ids (as the decoder's ``generate``).
        """
        self._check_decoder_inputs(input_ids, None)
        ctx = self.prepare_context(
            encoder_input_ids, encoder_attention_mask, encoder_hidden_states, cross_attention_cache
        )
        self._check_context_batch(input_ids, ctx)
        gen = generate_kwargs.get("generation_config") or self.decoder.generation_config
        beams = int(generate_kwargs.get("num_beams") or getattr(gen, "num_beams", 1) or 1)
        samples = int(
            generate_kwargs.get("num_return_sequences") or getattr(gen, "num_return_sequences", 1) or 1
        )
        repeats = tuple(sorted({1, beams, samples, beams * samples}))
        mixed = ctx is not None and self.cepe_config.output_mix
        install = ctx.with_decoder_rows() if mixed else ctx
        with (
            self.use_context(install, repeats),
            self._follow_beams(ctx is not None and beams > 1, mixed),
            self._mixed_generation(mixed),
            self._left_padding(attention_mask if ctx is not None else None, mixed),
        ):
            return self.decoder.generate(
                input_ids=input_ids, attention_mask=attention_mask, **generate_kwargs
            )

    @contextlib.contextmanager
    def _left_padding(self, attention_mask: torch.Tensor | None, doubled: bool) -> Iterator[None]:
        """For one ``generate`` call, each prompt row's left padding (the leading zeros of its 2-D
        ``attention_mask``) on the context slot: cross-attention then skips those positions in what a row
        reads across positions whatever mask the decoder builds (``ContextSlot.query_pad``)."""
        lead = None
        if attention_mask is not None and attention_mask.dim() == 2:
            lead = (attention_mask.cumsum(-1) == 0).sum(-1)  # (B,)
            if not bool(lead.any()):
                lead = None
        prev = (self._slot.lead_pad, self._slot.lead_doubled)
        self._slot.lead_pad, self._slot.lead_doubled = lead, doubled
        try:
            yield
        finally:
            self._slot.lead_pad, self._slot.lead_doubled = prev

    @contextlib.contextmanager
    def _mixed_generation(self, on: bool) -> Iterator[None]:
        """With the output mixture, the decoder's ``forward`` (which HF ``generate`` calls) becomes
        :meth:`_mixed_forward` for the duration of one ``generate`` call: its cache holds ``2·rows``."""
        if not on:
            yield
            return
        own = self.decoder.__dict__.get("forward")
        inner = self.decoder.forward

        @functools.wraps(inner)  # generate reads the signature (logits_to_keep, position_ids...)
        def forward(input_ids=None, attention_mask=None, logits_to_keep=0, **kwargs):
            kwargs.pop("labels", None)
            return self._mixed_forward(input_ids, attention_mask, None, logits_to_keep, None, kwargs)

        self.decoder.forward = forward
        try:
            yield
        finally:
            if own is None:
                del self.decoder.forward
            else:
                self.decoder.forward = own

    @contextlib.contextmanager
    def _follow_beams(self, on: bool, mixed: bool = False) -> Iterator[None]:
        """With induction gates or run biases, beam search must also reorder where each row's heads read last: the
        decoder's ``_reorder_cache`` (HF's hook for models whose cache is not only the KV cache) reorders
        the contexts' ``read_state`` and then the cache, for the duration of one ``generate`` call. With
        the output mixture (``mixed``) the cache holds each row twice: both copies follow the beam."""
        if not (on and (mixed or self.cepe_config.induction_gate or self.cepe_config.run_bias)):
            yield
            return
        own = self.decoder.__dict__.get("_reorder_cache")
        inner = getattr(self.decoder, "_reorder_cache", None)

        def reorder(cache, beam_idx):
            if mixed:
                beam_idx = torch.cat([beam_idx, beam_idx + beam_idx.shape[0]])
            for ctx in self._slot.contexts():
                if ctx.batch_size == beam_idx.shape[0]:
                    ctx.reorder(beam_idx)
            if inner is not None:
                return inner(cache, beam_idx)
            cache.reorder_cache(beam_idx)
            return cache

        self.decoder._reorder_cache = reorder
        try:
            yield
        finally:
            if own is None:
                del self.decoder._reorder_cache
            else:
                self.decoder._reorder_cache = own

    # ------------------------------------------------------------------ validation
    def _check_decoder_inputs(self, input_ids: torch.Tensor | None, labels: torch.Tensor | None) -> None:
        if input_ids is None:
            return
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
        vocab = int(self.decoder.config.vocab_size)
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
            raise ValueError(
                f"input_ids contain ids outside the decoder vocabulary [0, {vocab}): "
                f"min {int(input_ids.min())}, max {int(input_ids.max())}; tokenize with the decoder's tokenizer"
            )
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels {tuple(labels.shape)} must match input_ids {tuple(input_ids.shape)}")

    def _check_recomputation(self, ctx: CrossContext | None) -> None:
        """Under HF gradient checkpointing (autograd on), decoder layers run again in backward, after
        ``forward`` returned: the context must still be installed then, and reentrant checkpointing
        cannot carry gradients to it (cross-attention reads it from outside the checkpointed layer)."""
        if ctx is None or not torch.is_grad_enabled():
            return
        for layer in decoder_layers(self.decoder):
            if getattr(layer, "gradient_checkpointing", False) and layer.training:
                fn = getattr(layer, "_gradient_checkpointing_func", None)
                if getattr(fn, "keywords", {}).get("use_reentrant"):
                    raise ValueError(
                        "reentrant gradient checkpointing cannot pass gradients to the CEPE context; enable "
                        "it with model.decoder.activation_checkpointing_enable({'use_reentrant': False})"
                    )
                if self._slot.ctx is not ctx and (ctx.doubled is None or self._slot.ctx is not ctx.doubled):
                    raise ValueError(
                        "gradient checkpointing recomputes the decoder layers during backward, after forward "
                        "has returned, so the context must stay installed until then: ctx = "
                        "model.prepare_context(...); with model.use_context(ctx): loss = model(input_ids, "
                        "cross_context=ctx, labels=...).loss; loss.backward()"
                    )
                return

    @staticmethod
    def _check_context_batch(input_ids: torch.Tensor | None, ctx: CrossContext | None) -> None:
        if ctx is not None and input_ids is not None and input_ids.shape[0] != ctx.batch_size:
            raise ValueError(
                f"the decoder batch has {input_ids.shape[0]} rows but the context {ctx.batch_size}: give "
                "one context per example (encoder inputs (B, K, L) with the decoder's B; an example without "
                "context gets an all-padding mask)"
            )

    def _check_encoder_inputs(self, ids: torch.Tensor, mask: torch.Tensor | None) -> None:
        if ids.dim() != 3:
            raise ValueError(
                f"encoder_input_ids must be (B, K, L) chunks, got shape {tuple(ids.shape)}; "
                "split a sequence with cepe.chunking.chunk_ids and batch with collate_chunks"
            )
        if ids.shape[1] == 0 or ids.shape[2] == 0:
            raise ValueError(
                f"encoder_input_ids has empty chunks (shape {tuple(ids.shape)}); pass no encoder inputs "
                "for no context, or all-padding chunks with encoder_attention_mask"
            )
        if mask is not None and mask.shape != ids.shape:
            raise ValueError(
                f"encoder_attention_mask {tuple(mask.shape)} must match encoder_input_ids {tuple(ids.shape)}"
            )
        vocab = self.cepe_config.encoder.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(
                f"encoder_input_ids contain ids outside the encoder vocabulary [0, {vocab}): "
                f"min {int(ids.min())}, max {int(ids.max())}"
            )

    # ------------------------------------------------------------------ checkpoints
    def save_pretrained(self, save_directory: str | os.PathLike[str], quantize: str | None = None) -> None:
        """Write only the added weights (``adapter_model.safetensors``) and ``cepe_config.json``.

        Files are written into a temporary directory and moved into place, so a crash never leaves a
        half-written adapter.

        Args:
            save_directory: output directory.
            quantize: ``None`` (weights as they are), ``"int8"`` (weight-only int8 storage with a scale per
                row, about a quarter of fp32) or ``"int8-g64"`` (a scale per 64 columns of a row: closer to
                the weights, about 5 % larger; see :mod:`cepe.quant`).
        """
        if quantize is not None and quantize not in QUANT_MODES:
            raise ValueError(f"quantize must be None or one of {sorted(QUANT_MODES)}, got {quantize!r}")
        tensors = {k: v.detach().contiguous() for k, v in self.adapter_state_dict().items()}
        metadata = {"format": "pt", "cepe": "adapter"}
        if quantize is not None:
            tensors, metadata["cepe_quant"] = quantize_int8(tensors, quantize)
        write_adapter_dir(save_directory, tensors, self.cepe_config, metadata)

    def load_adapter_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load added weights strictly: missing, unexpected or mis-shaped keys raise ``ValueError``."""
        expected = self.adapter_state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        shapes = [
            f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
            for k in sorted(set(state) & set(expected))
            if tuple(state[k].shape) != tuple(expected[k].shape)
        ]
        problems = []
        if missing:
            problems.append(f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            problems.append(f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        if shapes:
            problems.append("mismatched shapes " + "; ".join(shapes[:8]))
        if problems:
            raise ValueError("cannot load CEPE weights: " + " | ".join(problems))
        with torch.no_grad():
            for k, t in expected.items():
                t.copy_(state[k].to(dtype=t.dtype, device=t.device))

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        decoder: nn.Module | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> CepeForCausalLM:
        """Load an adapter directory (``cepe_config.json`` + ``adapter_model.safetensors``) onto its
        decoder, or a directory in the released layout (``config.json`` with ``LlamaForCausalContextLM``).

        Args:
            path: the directory.
            decoder: the base decoder (model, hub id or dir); default: the one named in the config.
            dtype: dtype of the whole model, decoder, encoder and cross-attention alike (a given decoder
                module is cast too); default: the decoder as given (fp32 when loaded by name), the
                encoder in fp32. The released layout follows the same rule.
        """
        path = Path(path)
        if (path / ADAPTER_CONFIG).exists():
            cfg = CepeConfig.load(path / ADAPTER_CONFIG)
            if decoder is None:
                if not cfg.decoder_name_or_path:
                    raise ValueError(f"{path / ADAPTER_CONFIG} names no decoder; pass decoder=...")
                decoder = cfg.decoder_name_or_path
            model = cls.from_decoder(decoder, cfg, dtype=dtype)
            model.load_adapter_state_dict(load_adapter_file(path / ADAPTER_WEIGHTS))
            return model
        config_file = path / "config.json"
        if config_file.exists():
            with open(config_file) as f:
                raw = json.load(f)
            if "encoder_config" in raw or "LlamaForCausalContextLM" in raw.get("architectures", []):
                from .official import read_official

                decoder, cfg, adapter = read_official(path, decoder=decoder, dtype=dtype)
                model = cls(decoder, cfg)
                if dtype is not None:  # one rule with the adapter layout: every part in dtype
                    model.to(dtype)
                model.load_adapter_state_dict(adapter)
                return model.eval()
        raise FileNotFoundError(
            f"{path} holds neither a cepe adapter ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}) nor a released "
            "CEPE checkpoint (config.json with encoder_config)"
        )


def projection_init(
    maps: list[torch.Tensor], rank: int, second_moment: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A rank-``rank`` factorisation of linear maps that share their input: ``W_i ≈ A_i P``.

    With ``W`` the maps ``(d_out_i, D)`` stacked by rows and ``Σ`` the inputs' second moment (identity when
    None), ``W Σ^½ = U S Vᵀ`` gives ``P = S_r⁻¹ U_rᵀ W`` ``(rank, D)`` and ``A = U_r S_r`` (split by rows):
    ``E‖(W − A P) x‖²`` is the smallest a rank-``rank`` map gives (the tail of ``S²``), and ``P x`` has the
    second moment ``I`` on such inputs. With ``Σ = I``, ``P`` is the top right singular vectors of ``W``
    (orthonormal rows) and ``A_i = W_i Pᵀ``. Computed in fp64, signs fixed (each column of ``U_r``'s
    largest entry positive): a function of the weights and ``Σ``.

    Returns:
        ``(P, [A_i])`` in the first map's dtype and device.
    """
    like = maps[0]
    w = torch.cat([m.detach().double().cpu() for m in maps], dim=0)  # (Σ d_out, D)
    if second_moment is None:
        m = w
    else:
        evals, evecs = torch.linalg.eigh(second_moment.detach().double().cpu())
        m = w @ (evecs * evals.clamp_min(0).sqrt()) @ evecs.T  # W Σ^½
    u, s, _ = torch.linalg.svd(m, full_matrices=False)
    u, s = u[:, :rank], s[:rank].clamp_min(float(s[0]) * 1e-6)
    u = u * torch.sign(u.gather(0, u.abs().argmax(0, keepdim=True)))
    proj = (u.T @ w) / s[:, None]
    parts = (u * s).split([mm.shape[0] for mm in maps], dim=0)
    return proj.to(like), [a.to(like) for a in parts]


def decoder_logits(decoder: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``decoder``'s output head on hidden states ``(..., D_dec)`` -> ``(..., V)``, with final logit
    soft-capping for families that use it (Gemma 2/3): what the decoder's own forward computes. The
    student (:meth:`CepeForCausalLM.lm_logits`) and the CEPED teacher pass both use it."""
    logits = decoder.get_output_embeddings()(hidden)
    cap = getattr(decoder.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def write_adapter_dir(
    save_directory: str | os.PathLike[str],
    tensors: dict[str, torch.Tensor],
    config: CepeConfig,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write an adapter directory (``adapter_model.safetensors`` + ``cepe_config.json``): both files are
    written into a temporary directory and each is moved into place with one rename, weights first, so a
    crash never leaves a half-written file. The pair is two renames: a kill between them leaves the new
    weights beside the old config (write the adapter again). Returns the directory."""
    out = Path(save_directory)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out))
    try:
        save_file(tensors, tmp / ADAPTER_WEIGHTS, metadata=metadata or {"format": "pt", "cepe": "adapter"})
        os.chmod(tmp / ADAPTER_WEIGHTS, 0o666 & ~umask())  # as `open` would create it, not 0600
        config.save(tmp / ADAPTER_CONFIG)
        for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_adapter_file(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Tensors of an adapter file, dequantized if it was saved with ``quantize`` (``int8``, ``int8-g64``)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        quant = (f.metadata() or {}).get("cepe_quant")
    tensors = load_file(path)
    if quant is None:
        return tensors
    if quant not in QUANT_MODES.values():
        raise ValueError(f"{path}: unknown adapter quantization {quant!r}")
    return dequantize_int8(tensors)


def packed_positions(mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Where :func:`pack_keys` moves encoder positions: ``positions`` ``(B, T)`` (flat indices into S, -1 for
    none; each a real position of its example) -> their indices after packing ``mask`` ``(B, S)``.

    Packing keeps real positions in order, so position p goes to the number of real positions before it;
    when no packing happens (some example has no padding) positions are unchanged.
    """
    if int(mask.sum(-1).max()) == mask.shape[1]:
        return positions
    before = mask.long().cumsum(-1) - 1  # (B, S)
    moved = before.gather(1, positions.clamp_min(0))
    return torch.where(positions >= 0, moved, positions)


def pack_keys(
    states: torch.Tensor, mask: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each example's real encoder positions to the front and drop trailing all-padding columns.

    Cross-attention carries no position, so key order is irrelevant; packing removes padded keys.

    Args:
        states: Φ ``(B, S, D_enc)``; mask: ``(B, S)`` bool; counts: ``(B,)`` real positions per example.

    Returns:
        ``(states, mask)`` with S' = max(counts).
    """
    b, s, _ = states.shape
    smax = int(counts.max()) if b else 0
    if smax == s:
        return states, mask
    if b == 1:
        idx = mask[0].nonzero().flatten()
        return states[:, idx], mask[:, idx]
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :smax]  # real positions first
    states = torch.gather(states, 1, order[..., None].expand(-1, -1, states.shape[-1]))
    mask = torch.gather(mask, 1, order)
    return states, mask


def _doubled_mask(mask: Any) -> Any:
    """The decoder's attention mask for the output mixture's doubled batch (each row twice, the reading
    rows first): a tensor concatenated with itself on the batch dimension, a dict of masks (families with
    sliding-window layers under a static cache) each so, anything else as it is."""
    if mask is None:
        return None
    if isinstance(mask, dict):
        return {k: _doubled_mask(v) for k, v in mask.items()}
    if isinstance(mask, torch.Tensor):  # a 4-D mask of batch 1 broadcasts over both copies as it is
        return mask if mask.dim() > 2 and mask.shape[0] == 1 else torch.cat([mask] * 2)
    return mask
