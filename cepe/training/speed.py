"""Training speed: the frozen decoder's matmul weights held in the compute dtype once, a chunked LM-head
cross-entropy that never holds all fp32 logits, and the FLOP cost model of one training step.

Both fast paths compute what the plain path computes (the same bf16 products under autocast, the same
fp32 loss), so a run can switch between them and resume: :class:`cepe.training.config.TrainConfig`'s
``reference_path`` selects the plain one, and ``tests/test_train_speed.py`` checks that they agree.

Shape legend: B batch, T decoder tokens, N supervised positions, V vocabulary, D decoder width, K chunks,
L chunk length, S = K·L encoder tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cepe.mixture import CopySpans

# Rows of logits per chunk: CHUNK_ELEMENTS / V (about 8M fp32 logits, 32 MB, whatever the vocabulary).
CHUNK_ELEMENTS = 1 << 23


def hold_frozen_linears(decoder: nn.Module, dtype: torch.dtype) -> int:
    """Store the frozen decoder's ``nn.Linear`` weights (and biases) in ``dtype`` once.

    Under autocast a frozen fp32 weight is cast to bf16 at every call (autocast caches only casts of
    leaves that require grad); holding it in bf16 gives the very same bf16 matmul without the cast.
    Embeddings, norms and a head tied to the input embedding keep their dtype (the residual stream stays
    fp32), as do trainable modules (cross-attention). Only valid while the decoder runs under autocast
    in ``dtype``.

    Returns:
        The number of weight tensors converted.
    """
    if dtype == torch.float32:
        return 0
    keep = set()
    emb = decoder.get_input_embeddings() if hasattr(decoder, "get_input_embeddings") else None
    if emb is not None:
        keep.add(id(emb.weight))
    n = 0
    for name, m in decoder.named_modules():
        if not isinstance(m, nn.Linear) or ".cross_attn" in f".{name}" or id(m.weight) in keep:
            continue
        if m.weight.requires_grad or (m.bias is not None and m.bias.requires_grad):
            continue
        m.weight.data = m.weight.data.to(dtype)
        if m.bias is not None:
            m.bias.data = m.bias.data.to(dtype)
        n += 1
    return n


class _ChunkedHeadCE(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weightᵀ`` against ``labels``, chunk by chunk of rows.

    The gradient with respect to ``hidden`` is computed in the forward pass (the head is frozen), so
    neither the ``(N, V)`` logits nor their fp32 copy is ever held whole or saved for backward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk):  # type: ignore[override]
        n = hidden.shape[0]
        dtype = weight.dtype
        h_all = hidden.to(dtype)
        need_grad = ctx.needs_input_grad[0]
        grad = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if need_grad else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            logits = (h_all[s : s + chunk] @ weight.t()).float()  # (c, V)
            y = labels[s : s + chunk]
            lse = torch.logsumexp(logits, dim=-1)  # (c,)
            total += (lse - logits.gather(1, y[:, None]).squeeze(1)).sum()
            if grad is not None:
                logits.sub_(lse[:, None]).exp_()  # softmax, in place
                logits[torch.arange(y.shape[0], device=y.device), y] -= 1.0
                logits.div_(n)
                grad[s : s + chunk] = logits.to(dtype) @ weight
        ctx.save_for_backward(grad if grad is not None else torch.empty(0))
        ctx.in_dtype = hidden.dtype
        return total / n

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        g = (grad * grad_out.to(grad.dtype)).to(ctx.in_dtype)
        return g, None, None, None


def chunked_head_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weightᵀ, labels)`` (mean, fp32 softmax) without all fp32 logits at once.

    Args:
        hidden: ``(N, D)`` final hidden states of the supervised positions.
        weight: ``(V, D)`` frozen output embedding, in the matmul dtype (bf16 under autocast).
        labels: ``(N,)`` target ids (no ignored positions: select them first).
        chunk: rows per chunk (default ``CHUNK_ELEMENTS // V``).

    Returns:
        A 0-dim fp32 tensor; its gradient flows to ``hidden`` only.
    """
    if weight.requires_grad:
        raise ValueError("the chunked head loss needs a frozen output embedding (weight.requires_grad)")
    if hidden.shape[0] == 0:
        raise ValueError("no supervised position: every label is -100")
    rows = chunk or max(1, CHUNK_ELEMENTS // weight.shape[0])
    return _ChunkedHeadCE.apply(hidden, weight, labels, rows)


class _ChunkedTargetLogProb(torch.autograd.Function):
    """``log_softmax(hidden @ weightᵀ)[n, labels[n]]`` per row, chunk by chunk; the gradient with respect
    to ``hidden`` is formed in the forward pass (the head is frozen), as in
    :func:`chunked_head_cross_entropy`."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk):  # type: ignore[override]
        dtype = weight.dtype
        h_all = hidden.to(dtype)
        need_grad = ctx.needs_input_grad[0]
        grad = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if need_grad else None
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            logits = (h_all[s : s + chunk] @ weight.t()).float()  # (c, V)
            y = labels[s : s + chunk]
            lse = torch.logsumexp(logits, dim=-1)  # (c,)
            out[s : s + chunk] = logits.gather(1, y[:, None]).squeeze(1) - lse
            if grad is not None:  # d log p_y / d logits = onehot(y) - softmax
                logits.sub_(lse[:, None]).exp_().neg_()
                logits[torch.arange(y.shape[0], device=y.device), y] += 1.0
                grad[s : s + chunk] = logits.to(dtype) @ weight
        ctx.save_for_backward(grad if grad is not None else torch.empty(0))
        ctx.in_dtype = hidden.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return (grad * grad_out.to(grad.dtype)[:, None]).to(ctx.in_dtype), None, None, None


def chunked_target_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """``log_softmax(hidden @ weightᵀ)`` at ``labels``, ``(N,)`` fp32, without all logits at once.

    Args:
        hidden: ``(N, D)`` final hidden states; weight: ``(V, D)`` frozen output embedding (matmul dtype);
        labels: ``(N,)`` target ids; chunk: rows per chunk (default: about 8M logits).
    """
    if weight.requires_grad:
        raise ValueError("the chunked target log-probabilities need a frozen output embedding")
    rows = chunk or max(1, CHUNK_ELEMENTS // weight.shape[0])
    return _ChunkedTargetLogProb.apply(hidden, weight, labels, rows)


class HeadWeight:
    """The decoder's output embedding in the compute dtype, converted once (a tied head stays shared)."""

    def __init__(self) -> None:
        self._key: tuple[int, int, torch.dtype] | None = None
        self._weight: torch.Tensor | None = None

    def get(self, decoder: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        w = decoder.get_output_embeddings().weight
        key = (id(w), w._version, dtype)
        if self._key != key:
            self._weight = w.detach().to(dtype)
            self._key = key
        return self._weight  # type: ignore[return-value]


def mixture_token_nll(
    model: nn.Module,
    hidden: torch.Tensor,
    alone: torch.Tensor,
    labels: torch.Tensor,
    head: HeadWeight,
    fast: bool,
    match: torch.Tensor | None = None,
    copy: CopySpans | None = None,
) -> torch.Tensor:
    """The output mixture's negative log-likelihood ``(N,)`` at each supervised position (``labels[:, 1:]
    != -100``, in row-major order), from the hidden states with and without the context ``(B, T, D)``
    (and the suffix-match inputs ``(B, T, K)`` with ``mix_match``, where each position's copy lies
    ``(B, T)`` with ``mix_copy``): each side's log-probability of the target alone (fast), or the mixed
    logits (reference; also for soft-capped heads)."""
    from cepe.mixture import copy_mix_nll, mix_nll

    shift = labels[:, 1:]
    sel = shift != -100
    h, h_dec, y = hidden[:, :-1][sel], alone[:, :-1][sel], shift[sel]
    m = None if match is None else match[:, :-1][sel]
    cp = None if copy is None else copy[:, :-1][sel]
    if not fast or getattr(model.decoder.config, "final_logit_softcapping", None):
        return F.cross_entropy(model.mixed_logits(h, h_dec, m, cp), y, reduction="none")
    dev = hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
    with torch.autocast(dev, enabled=False):
        w = head.get(model.decoder, dtype)
        logp_ctx = chunked_target_logprobs(h, w, y)
        logp_dec = chunked_target_logprobs(h_dec, w, y)
    a = model.mix_logit(h, h_dec, m)
    nll = mix_nll(logp_ctx, logp_dec, a)
    if cp is None:
        return nll
    expect = None
    if model.cepe_config.mix_copy_prob:
        with torch.autocast(dev, enabled=False):
            expect = chunked_copy_expectation(h, h_dec, a, w, cp)
    with torch.autocast(dev, enabled=False):
        c_cfg = model.cepe_config
        top, read = chunked_reader_inputs(h, w, cp, c_cfg.mix_copy_sure, c_cfg.mix_copy_read)
    c = model.copy_logit(h, h_dec, m, cp, expect, top, read)
    return copy_mix_nll(nll, c, cp.target_probs(y), cp.has)


@torch.no_grad()
def chunked_reader_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    copy: CopySpans,
    sure: bool,
    read: bool,
    chunk: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The copy head's inputs that read the reader's own distribution, from one pass of its logits over
    the rows where a suffix occurs (the others 0; the heads ignore them): with ``sure`` ``max_y log
    p_cepe(y)`` (:func:`cepe.mixture.top_logprob`, ``mix_copy_sure``), with ``read`` ``Σ_y p_copy(y)·p_cepe(y)``
    (:meth:`cepe.mixture.CopySpans.expected`, ``mix_copy_read``); ``(N,)`` fp32 each, None where not asked;
    no gradient.

    Args:
        hidden: ``(N, D)`` the reader's final hidden states; weight: ``(V, D)`` the output embedding (matmul
            dtype); copy: ``(N,)`` copy spans; chunk: rows per chunk (default: about 8M logits).
    """
    from cepe.mixture import top_logprob

    n = hidden.shape[0]
    top = torch.zeros(n, dtype=torch.float32, device=hidden.device) if sure else None
    expect = torch.zeros(n, dtype=torch.float32, device=hidden.device) if read else None
    if not (sure or read):
        return top, expect
    rows = chunk or max(1, CHUNK_ELEMENTS // weight.shape[0])
    idx = copy.has.nonzero()[:, 0]
    for i in range(0, idx.numel(), rows):
        at = idx[i : i + rows]
        logits = (hidden[at].to(weight.dtype) @ weight.T).float()  # (n, V)
        if top is not None:
            top[at] = top_logprob(logits)
        if expect is not None:
            expect[at] = copy[at].expected(logits.log_softmax(-1))
    return top, expect


@torch.no_grad()
def chunked_copy_expectation(
    h_ctx: torch.Tensor,
    h_dec: torch.Tensor,
    a: torch.Tensor,
    weight: torch.Tensor,
    copy: CopySpans,
    chunk: int | None = None,
) -> torch.Tensor:
    """``Σ_y p_copy(y)·p_mixture(y)`` ``(N,)`` fp32 (:meth:`cepe.mixture.CopySpans.expected` of the
    mixture ``σ(a)·softmax(h_ctx Wᵀ) + σ(−a)·softmax(h_dec Wᵀ)``) without all logits at once; no gradient.

    Args:
        h_ctx, h_dec: ``(N, D)`` final hidden states with and without the context; a: ``(N,)`` the mixing
            logit; weight: ``(V, D)`` the output embedding (matmul dtype); copy: ``(N,)`` copy spans.
    """
    rows = chunk or max(1, CHUNK_ELEMENTS // weight.shape[0])
    out = torch.zeros(h_ctx.shape[0], dtype=torch.float32, device=h_ctx.device)
    for i in range(0, h_ctx.shape[0], rows):
        part = copy[i : i + rows]
        if not bool(part.has.any()):
            continue
        logp = (
            (h_ctx[i : i + rows].to(weight.dtype) @ weight.T).float().log_softmax(-1)
        )  # (n, V) the reader's
        if a is not None:
            lam = a[i : i + rows].detach().float()[:, None]
            logp = torch.logaddexp(
                F.logsigmoid(lam) + logp,
                F.logsigmoid(-lam)
                + (h_dec[i : i + rows].to(weight.dtype) @ weight.T).float().log_softmax(-1),
            )  # (n, V) the mixture's log-probabilities
        out[i : i + rows] = part.expected(logp)
    return out


def lm_loss(
    model: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: HeadWeight,
    fast: bool,
    alone: torch.Tensor | None = None,
    match: torch.Tensor | None = None,
    copy: CopySpans | None = None,
) -> torch.Tensor:
    """The decoder's next-token loss from final hidden states: the model's own (reference) head and fp32
    cross-entropy, or the chunked one where it computes the same thing (no logit soft-capping).

    Args:
        hidden: ``(B, T, D)``; labels: ``(B, T)`` with ``-100`` ignored; position t predicts token t+1.
        alone: ``(B, T, D)`` the decoder's hidden states without the context: the loss is then the output
            mixture's (``CepeConfig.output_mix``), from each side's log-probability of the target alone.
        match: ``(B, T, K)`` the mixture's suffix-match inputs (``CepeConfig.mix_match``), or None.
        copy: ``(B, T)`` where each position's copy lies (``CepeConfig.mix_copy``), or None.
    """
    shift = labels[:, 1:]
    sel = shift != -100
    h = hidden[:, :-1][sel]  # (N, D)
    y = shift[sel]
    cap = getattr(model.decoder.config, "final_logit_softcapping", None)
    if alone is not None:
        return mixture_token_nll(model, hidden, alone, labels, head, fast, match, copy).mean()
    if not fast or cap:
        return F.cross_entropy(model.lm_logits(h).float(), y)
    dev = hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
    with torch.autocast(dev, enabled=False):
        return chunked_head_cross_entropy(h, head.get(model.decoder, dtype), y)


# ---------------------------------------------------------------------------------------- cost model
def step_flops(cfg: Any, model: nn.Module) -> dict[str, int]:
    """Matmul FLOPs of one optimizer step (all processes) by the cost model of :mod:`cepe.bench.flops`.

    Forward: the decoder's layers and head on every decoder token, cross-attention (keys re-projected,
    the ``states`` mode training uses), the encoder on the chunks. Backward: trainable modules cost twice
    their forward (input and weight gradients); the frozen decoder costs its forward again (input
    gradients only; attention scores twice) above its lowest cross-attention layer, that layer's MLP and
    the head; layers below it get no backward. A frozen encoder (``freeze_encoder``, ``train_only``) gets
    no backward; cross-attention with frozen weights costs its input gradients only (the decoder side
    once, the keys and values not at all when Φ needs no gradient either). The MLM stage: the encoder and its head, three times forward.

    Returns:
        ``{"forward", "backward", "total", "attention", "decoder_tokens", "encoder_tokens"}`` per step;
        ``attention`` is the part of ``total`` in attention scores and weighted sums (the rest is
        projections, MLPs and the head).
    """
    from cepe.bench.flops import DecoderShape, causal_pairs

    b = cfg.batch_size
    if cfg.stage == "mlm":
        enc = DecoderShape.from_encoder_config(model.encoder.config)
        t = cfg.mlm_seq_length
        lin = 2 * t * enc.layers * enc.linear_params_per_layer + 2 * t * enc.hidden * enc.vocab
        att = 4 * t * t * enc.heads * enc.head_dim * enc.layers
        return {
            "forward": b * (lin + att),
            "backward": 2 * b * (lin + att),
            "total": 3 * b * (lin + att),
            "attention": 3 * b * att,
            "decoder_tokens": 0,
            "encoder_tokens": b * t,
        }
    dec = DecoderShape.from_hf_config(model.decoder.config)
    enc = DecoderShape.from_encoder_config(model.cepe_config.encoder)
    if cfg.stage == "warmup":
        # the decoder reads the whole window, or only a span of it (warmup_decoder_tokens)
        n, k, chunk = (
            cfg.warmup_decoder_tokens or cfg.warmup_tokens,
            cfg.warmup_chunks,
            cfg.stage_chunk_length,
        )
    else:
        n, k, chunk = cfg.n_decoder, cfg.n_chunks, cfg.chunk_length
        if getattr(cfg, "decoder_lengths", None):  # the expected length of a micro-batch's decoder
            n = round(sum(cfg.decoder_lengths) / len(cfg.decoder_lengths))
        if getattr(cfg, "context_chunks", None):  # the expected chunk count of a micro-batch's encoder
            k = round(sum(cfg.context_chunks) / len(cfg.context_chunks))
    s = k * chunk
    layers = list(model.cross_layers)
    hq, hkv = dec.heads * dec.head_dim, dec.kv_heads * dec.head_dim
    linear = 2 * n * dec.linear_params_per_layer  # per decoder layer
    mlp = 2 * n * 3 * dec.hidden * dec.intermediate
    attn = 4 * causal_pairs(0, n) * dec.heads * dec.head_dim
    head = 2 * (n - 1) * dec.hidden * dec.vocab
    above = dec.layers - 1 - min(layers) if layers else 0
    d_state = int(model.cepe_config.encoder.state_size)  # Φ's width (after a down-projection, if any)
    x_lin, x_att, e_lin, e_att = _reading_flops(dec, enc, model.cepe_config, len(layers), n, s, chunk)
    fwd_lin = dec.layers * linear + head + x_lin + e_lin
    fwd_att = dec.layers * attn + x_att + e_att
    # what needs gradients: the encoder (train_only / freeze_encoder may hold it) and the cross-attention
    # weights; the decoder stream always needs input gradients above the lowest cross-attention layer
    enc_grad = any(p.requires_grad for p in model.encoder.parameters())
    x_weight_grad = any(
        getattr(m, name).weight.requires_grad
        for m in model.cross_attention_modules()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj")
    )
    kv_grad = enc_grad or x_weight_grad
    # the decoder stream needs gradients when anything before the head trains (not for a mixing head alone)
    stream_grad = enc_grad or any(
        p.requires_grad for m in model.cross_attention_modules() for p in m.parameters()
    )
    x_q = len(layers) * 2 * n * 2 * dec.hidden * hq  # q_proj and o_proj on the decoder stream
    x_kv = len(layers) * 2 * s * 2 * d_state * hkv  # k_proj and v_proj on Φ
    x_bwd = x_q * (2 if x_weight_grad else 1) + x_kv * (int(enc_grad) + int(x_weight_grad))
    bwd_lin = above * linear + (mlp if layers else 0) + head + x_bwd + 2 * e_lin * int(enc_grad)
    bwd_att = above * 2 * attn + x_att * (2 if kv_grad else 1) + 2 * e_att * int(enc_grad)
    if not stream_grad:
        bwd_lin = bwd_att = 0
    mix_head = getattr(model, "mix_head", None)
    if mix_head is not None:
        # the output mixture: the decoder alone, its head at the targets, the mixing head
        mixing = 2 * (n - 1) * mix_head.weight.shape[1]
        fwd_lin += dec.layers * linear + head + mixing
        fwd_att += dec.layers * attn
        bwd_lin += mixing * (int(mix_head.weight.requires_grad) + int(stream_grad))
    copy_head = getattr(model, "copy_head", None)
    if copy_head is not None:  # the copy's head (mix_copy), over the same inputs
        copying = 2 * (n - 1) * copy_head.weight.shape[1]
        fwd_lin += copying
        bwd_lin += copying * (int(copy_head.weight.requires_grad) + int(stream_grad))
        if getattr(model.cepe_config, "mix_copy_prob", False):  # both sides' logits again (at most)
            fwd_lin += 2 * head
        if getattr(model.cepe_config, "mix_copy_sure", False) or getattr(
            model.cepe_config, "mix_copy_read", False
        ):
            fwd_lin += head  # the reader's logits again, once for both (at most)
    if getattr(cfg, "online_teacher", False):  # the decoder alone over the context and the decoder tokens
        limit = getattr(model.decoder.config, "max_position_embeddings", None) or s + n
        kinds = getattr(cfg, "teacher_tasks", None)
        if kinds is None:  # every example, at its full context
            runs = [(1.0, s)]
        else:  # the expected share of examples of each taught kind; lm's context cut to teacher_context
            total = sum(map(float, cfg.tasks.values()))
            cut = getattr(cfg, "teacher_context", None)
            runs = [
                (float(cfg.tasks[k]) / total, min(s, cut) if k == "lm" and cut is not None else s)
                for k in kinds
            ]
        cap = getattr(cfg, "teacher_max_context", None)  # counted as if every taught example reached it
        own = None  # (its config, its encoder's shape, its cross-attention layers) for teacher_adapter
        if getattr(cfg, "teacher_adapter", None) is not None:
            own = _adapter_teacher_shape(cfg, dec.layers)
        for share, ctx in runs:
            ctx = ctx if cap is None else min(ctx, cap)
            if own is not None:  # one forward of the teacher adapter, in its own shapes and chunk length
                t_cfg, t_enc, t_layers = own
                tx_lin, tx_att, te_lin, te_att = _reading_flops(
                    dec, t_enc, t_cfg, t_layers, n, ctx, int(t_cfg.chunk_length)
                )
                t_lin = dec.layers * linear + head + tx_lin + te_lin
                t_att = dec.layers * attn + tx_att + te_att
                if t_cfg.output_mix and not getattr(cfg, "teacher_drop_mixture", False):
                    t_lin += dec.layers * linear + head  # its mixture's decoder alone (its heads not counted)
                    t_att += dec.layers * attn
                fwd_lin += round(share * t_lin)
                fwd_att += round(share * t_att)
                continue
            t = min(ctx + n, limit)
            fwd_lin += round(share * (dec.layers * 2 * t * dec.linear_params_per_layer + head))
            fwd_att += round(share * dec.layers * 4 * causal_pairs(0, t) * dec.heads * dec.head_dim)
    return {
        "forward": b * (fwd_lin + fwd_att),
        "backward": b * (bwd_lin + bwd_att),
        "total": b * (fwd_lin + fwd_att + bwd_lin + bwd_att),
        "attention": b * (fwd_att + bwd_att),
        "decoder_tokens": b * n,
        "encoder_tokens": b * s,
    }


def _reading_flops(
    dec: Any, enc: Any, cepe_cfg: Any, n_cross: int, n: int, s: int, chunk: int
) -> tuple[int, int, int, int]:
    """Forward matmul FLOPs of an adapter's reading, ``(cross linear, cross attention, encoder linear,
    encoder attention)``: ``n_cross`` cross-attention layers over ``n`` decoder tokens and ``s`` encoder
    positions, the encoder (``enc``, with ``cepe_cfg``'s down-projection if any) over chunks of ``chunk``."""
    d_state = int(cepe_cfg.encoder.state_size)  # Φ's width (after a down-projection, if any)
    hq, hkv = dec.heads * dec.head_dim, dec.kv_heads * dec.head_dim
    x_lin = n_cross * (2 * n * 2 * dec.hidden * hq + 2 * s * 2 * d_state * hkv)
    x_att = n_cross * 4 * n * s * dec.heads * dec.head_dim
    e_lin = 2 * s * enc.layers * enc.linear_params_per_layer
    if cepe_cfg.encoder.output_size is not None:  # the down-projection D -> D_enc
        e_lin += 2 * s * enc.hidden * d_state
    e_att = 4 * s * chunk * enc.heads * enc.head_dim * enc.layers
    return x_lin, x_att, e_lin, e_att


def _adapter_teacher_shape(cfg: Any, decoder_layers: int) -> tuple[Any, Any, int]:
    """``(CepeConfig, encoder DecoderShape, number of cross-attention layers)`` of ``cfg.teacher_adapter``,
    read from its saved configuration (no weights loaded)."""
    from pathlib import Path

    from cepe.bench.flops import DecoderShape
    from cepe.config import CepeConfig
    from cepe.modeling import ADAPTER_CONFIG

    t_cfg = CepeConfig.load(Path(str(cfg.teacher_adapter)) / ADAPTER_CONFIG)
    return t_cfg, DecoderShape.from_encoder_config(t_cfg.encoder), len(t_cfg.layer_indices(decoder_layers))


COST_MODEL = (
    "matmul FLOPs only (2 per multiply-add): forward = frozen decoder layers + head on every decoder "
    "token, cross-attention with keys projected, encoder chunks; backward = 2x forward for the trainable "
    "encoder and cross-attention (frozen ones: input gradients only), 1x forward (attention 2x) for "
    "frozen decoder layers above the lowest cross-attention layer, its MLP and the head; no backward "
    "below it; an online CEPED teacher adds the decoder's forward over context + decoder tokens (up to "
    "its positions; a teacher adapter: one forward of it, in its own shapes; times the share of examples "
    "it runs for; with teacher_max_context an upper bound, each taught example at most that long); the "
    "output mixture adds the decoder's forward without the "
    "context and its mixing head"
)
