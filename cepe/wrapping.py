"""Inserting cross-attention into an existing Hugging Face decoder without copying its modeling code.

Every supported decoder layer has the shape ``h = h + branch(...)`` for its self-attention block,
followed by the MLP block. CEPE needs ``h' = (h + branch) + cross_attn(h + branch)`` before the MLP.
Two hooks give exactly that while leaving the layer's code and weight names untouched:

1. a forward pre-hook on the layer's first norm (``input_layernorm``) records the residual stream ``h``;
2. a forward hook on the branch module (the self-attention, or for Gemma 2/3 the norm applied to its
   output) returns ``branch + cross_attn(h + branch)``, which the layer adds to ``h``.

The cross-attention module is registered as ``layers.{i}.cross_attn``, the name the released
checkpoints use. A new decoder family costs one :class:`DecoderFamily` entry.

The hooks are small objects holding their cross-attention module and the model's :class:`ContextSlot`
as attributes (not closures), so ``copy.deepcopy`` of a model gives hooks that read the copy's modules
and slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .cross_attention import CrossAttention, CrossContext


@dataclass(frozen=True)
class DecoderFamily:
    """Where CEPE hooks into one decoder family.

    Attributes:
        layers: attribute path from the ``*ForCausalLM`` model to its list of decoder layers.
        residual_tap: module of each layer whose input is the residual stream before self-attention.
        branch: module whose output is added to the residual stream right after self-attention.
        pre_mlp_norm: the norm applied to the residual stream before the MLP (the released code copies
            its weight into the cross-attention's query norm).
    """

    layers: str = "model.layers"
    residual_tap: str = "input_layernorm"
    branch: str = "self_attn"
    pre_mlp_norm: str = "post_attention_layernorm"


_LLAMA_LIKE = DecoderFamily()
_GEMMA_LIKE = DecoderFamily(branch="post_attention_layernorm", pre_mlp_norm="pre_feedforward_layernorm")

FAMILIES: dict[str, DecoderFamily] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "mixtral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gemma": _LLAMA_LIKE,
    "gemma2": _GEMMA_LIKE,
    "gemma3_text": _GEMMA_LIKE,
}


def register_family(model_type: str, family: DecoderFamily) -> None:
    """Teach cepe a new decoder family (``config.model_type``)."""
    FAMILIES[model_type] = family


def _get(obj: nn.Module, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def family_of(decoder: nn.Module) -> DecoderFamily:
    """The hook points of ``decoder``; raises ``ValueError`` for an unknown layer layout."""
    model_type = getattr(decoder.config, "model_type", None)
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    raise ValueError(
        f"decoder family {model_type!r} is not registered; supported: {sorted(FAMILIES)}. If its layers "
        "look like Llama's (input_layernorm -> self_attn -> residual add -> MLP), call "
        "cepe.wrapping.register_family(model_type, DecoderFamily()) first."
    )


def decoder_layers(decoder: nn.Module) -> nn.ModuleList:
    """The decoder's list of transformer layers."""
    return _get(decoder, family_of(decoder).layers)


class ContextSlot:
    """Holds the :class:`CrossContext` of the running call; shared by all cross-attention layers.

    ``repeats``: the factors ``r`` for which a decoder batch of ``ctx.batch_size × r`` rows gets the
    context repeated (generation with beams or several samples); any other batch size is an error.
    """

    def __init__(self) -> None:
        self.ctx: CrossContext | None = None
        self.repeats: tuple[int, ...] = (1,)
        self._expanded: dict[int, CrossContext] = {}
        self.past = 0  # decoder tokens already cached when the running decoder call began
        self.decoder_mask: torch.Tensor | None = None  # the running call's 2-D decoder padding mask
        self.lead_pad: torch.Tensor | None = None  # (B,) a generate call's left padding per prompt row
        self.lead_doubled = False  # its decoder batch holds each row twice (the output mixture)
        self._pad: tuple[tuple[int, int, int], torch.Tensor | None] | None = None  # this call's answer

    def query_pad(self, rows: int, t: int) -> torch.Tensor | None:
        """See :meth:`_query_pad`; computed once per decoder call and shape (every layer asks the same)."""
        key = (rows, t, self.past)
        if self._pad is None or self._pad[0] != key:
            self._pad = (key, self._query_pad(rows, t))
        return self._pad[1]

    def _query_pad(self, rows: int, t: int) -> torch.Tensor | None:
        """``(rows, t)`` bool, True on the running call's padding columns, or None when it has none: in a
        ``generate`` call, the positions before each row's first prompt token (:attr:`lead_pad`, rows
        repeated for beams and samples, twice with the output mixture), whatever form the decoder's own
        mask takes (a static cache's is 4-D); else the last ``t`` columns of a 2-D mask of ``rows`` rows."""
        if self.lead_pad is not None:
            lead = self.lead_pad
            copies = 2 if self.lead_doubled else 1
            if rows % (copies * lead.shape[0]) == 0:
                lead = lead.repeat_interleave(rows // (copies * lead.shape[0])).repeat(copies)
                pos = self.past + torch.arange(t, device=lead.device)
                pad = pos[None, :] < lead[:, None]
                return pad if bool(pad.any()) else None
        mask = self.decoder_mask
        if mask is None or mask.dim() != 2 or mask.shape[0] != rows or mask.shape[1] < t:
            return None
        pad = mask[:, -t:] == 0
        return pad if bool(pad.any()) else None

    def contexts(self) -> list[CrossContext]:
        """The context and its repeated copies made so far."""
        return ([self.ctx] if self.ctx is not None else []) + list(self._expanded.values())

    def set(self, ctx: CrossContext | None, repeats: tuple[int, ...] = (1,)) -> None:
        self.ctx = ctx
        self.repeats = tuple(int(r) for r in repeats)
        self._expanded = {}

    def get(self, batch: int) -> CrossContext | None:
        """The context for a decoder batch of ``batch`` rows (repeated once for beams/samples).

        Raises:
            ValueError: ``batch`` is not the context batch times one of ``repeats``.
        """
        if self.ctx is None or batch == self.ctx.batch_size:
            return self.ctx
        b = self.ctx.batch_size
        if batch % b or batch // b not in self.repeats:
            raise ValueError(
                f"the decoder batch has {batch} rows but the context {b}: give one context per example; a "
                f"context is repeated only for generate's num_beams / num_return_sequences (here x{self.repeats})"
            )
        if batch not in self._expanded:
            self._expanded[batch] = self.ctx.expand(batch)
        return self._expanded[batch]


def attach_cross_attention(
    decoder: nn.Module,
    layer_indices: list[int],
    encoder_hidden: int,
    slot: ContextSlot,
    gated: bool = False,
    null_key: bool = False,
    token_gate: bool = False,
    match_gate: bool = False,
    length_scale: int | None = None,
    length_scale_below: bool = False,
    length_scale_above: bool = False,
    short_gate: bool = False,
    long_gate: bool = False,
    induction_gate: bool = False,
    run_bias: bool = False,
) -> list[CrossAttention]:
    """Add a :class:`CrossAttention` to each listed layer of ``decoder`` and hook it in.

    Returns:
        The new modules, in layer order.
    """
    family = family_of(decoder)
    cfg = decoder.config
    layers = _get(decoder, family.layers)
    num_heads = int(cfg.num_attention_heads)
    num_kv = int(getattr(cfg, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads)
    eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
    added = []
    for i in layer_indices:
        layer = layers[i]
        if hasattr(layer, "cross_attn"):
            raise ValueError(f"decoder layer {i} already has cross-attention; wrap a fresh decoder")
        cross = CrossAttention(
            cfg.hidden_size,
            encoder_hidden,
            num_heads,
            num_kv,
            head_dim,
            eps,
            layer_idx=i,
            gated=gated,
            null_key=null_key,
            token_gate=token_gate,
            match_gate=match_gate,
            length_scale=length_scale,
            length_scale_below=length_scale_below,
            length_scale_above=length_scale_above,
            short_gate=short_gate,
            long_gate=long_gate,
            induction_gate=induction_gate,
            run_bias=run_bias,
            qk_norm=getattr(layer.self_attn, "q_norm", None) is not None,
        )
        scalar = getattr(cfg, "query_pre_attn_scalar", None)
        if scalar is not None:  # Gemma 2/3 scale scores by this, not head_dim: so does a copy of their q/k
            cross.scale = float(scalar) ** -0.5
        p = next(decoder.parameters())
        cross.to(device=p.device, dtype=p.dtype)
        layer.cross_attn = cross
        _get(layer, family.residual_tap).register_forward_pre_hook(ResidualTap(cross), with_kwargs=True)
        _get(layer, family.branch).register_forward_hook(CrossAdd(cross, slot), with_kwargs=True)
        added.append(cross)
    base = _get(decoder, family.layers.rpartition(".")[0]) if "." in family.layers else decoder
    base.register_forward_pre_hook(PastTap(slot), with_kwargs=True)
    return added


class PastTap:
    """Forward pre-hook on the decoder's base model: records on ``slot`` how many decoder tokens its
    self-attention cache already holds (``get_seq_length()`` of its ``cache``, ``past_key_values`` before
    transformers 5.2x; 0 without one), so that cross-attention can tell a call that continues a sequence
    (generation) from a fresh one, and the call's 2-D ``attention_mask`` (else None), so that what a row
    reads across positions skips its padding columns."""

    def __init__(self, slot: ContextSlot) -> None:
        self.slot = slot

    def __call__(self, module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        length = getattr(cache, "get_seq_length", None)
        self.slot.past = int(length()) if callable(length) else 0
        self.slot._pad = None  # a new decoder call: its padding is asked afresh
        mask = kwargs.get("attention_mask")
        self.slot.decoder_mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None


class ResidualTap:
    """Forward pre-hook on the layer's first norm: records the residual stream ``h`` on ``cross``."""

    def __init__(self, cross: CrossAttention) -> None:
        self.cross = cross

    def __call__(self, module, args, kwargs):
        self.cross._residual = args[0] if args else kwargs["hidden_states"]


class CrossAdd:
    """Forward hook on the self-attention branch: returns ``branch + cross(h + branch)`` when ``slot``
    holds a context (else leaves the output untouched)."""

    def __init__(self, cross: CrossAttention, slot: ContextSlot) -> None:
        self.cross, self.slot = cross, slot

    def __call__(self, module, args, kwargs, output):
        cross = self.cross
        residual = cross.__dict__.pop("_residual", None)
        is_tuple = isinstance(output, tuple)
        branch = output[0] if is_tuple else output
        ctx = self.slot.get(branch.shape[0])
        if ctx is None:
            return None  # no context: the layer is exactly the decoder's
        if residual is None:
            raise RuntimeError("cepe: the residual stream was not recorded before cross-attention")
        pad = None  # only what reads across positions needs the padding columns (once per decoder call)
        if cross.induction_gate is not None or cross.run_bias is not None:
            pad = self.slot.query_pad(branch.shape[0], branch.shape[1])
        update = cross(residual + branch, ctx, past=self.slot.past, pad=pad)
        branch = branch + update
        return (branch, *output[1:]) if is_tuple else branch
