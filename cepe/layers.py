"""Small building blocks shared by the encoder and the cross-attention: RMSNorm, RoPE, attention kernels.

Every kernel has a plain reference (``*_ref`` / eager) next to the fast path (SDPA); tests check they agree.
Shape legend: N sequences (B·K chunks), H heads, KV key/value heads, T query length, S key length, hd head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 then cast back, as Llama's decoder does."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


def norm_scale(norm: nn.Module) -> torch.Tensor:
    """The multiplicative weight of a decoder RMSNorm: ``weight``, or ``1 + weight`` for the Gemma
    families, whose norms store the offset from one."""
    w = norm.weight
    return 1.0 + w if type(norm).__name__.startswith("Gemma") else w


def rope_cos_sin(
    length: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for positions ``0..length-1``: ``(cos, sin)`` each ``(length, head_dim)``."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    )
    pos = torch.arange(length, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(N, H, L, hd)`` by the tables ``(L, hd)``."""
    return x * cos + _rotate_half(x) * sin


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``(N, KV, S, hd)`` -> ``(N, KV·groups, S, hd)``; head ``h`` uses key/value head ``h // groups``."""
    if groups == 1:
        return x
    n, kv, s, hd = x.shape
    return x[:, :, None].expand(n, kv, groups, s, hd).reshape(n, kv * groups, s, hd)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain attention, the reference every fast path is tested against.

    Scores in the input dtype, masked keys set to the dtype's minimum, softmax in fp32, cast back.

    Args:
        q: ``(N, H, T, hd)``; k, v: ``(N, KV, S, hd)`` (GQA by repeating KV heads).
        key_mask: ``(N, S)`` bool, True = attend; None = all keys valid.
        scale: multiplier on ``q·k``.
        bias: ``(N, H, T, S)`` fp32 added to the scores (then in fp32), or None.

    Returns:
        ``(N, H, T, hd_v)``.
    """
    groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores.float() + bias
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Fused attention without a causal mask; GQA by folding query groups into the query length.

    Because no mask depends on the query position, the G query heads that share a key/value head
    are stacked along the query axis, so K/V are never repeated in memory. Same arguments and
    result as :func:`attention_ref`.
    """
    parts = _split_parts(q, k, key_mask)
    if parts > 1:
        return attention_split_keys(q, k, v, scale, parts)
    n, h, t, hd = q.shape
    qg = q.reshape(n, k.shape[1], -1, hd)  # (N, KV, G·T, hd)
    mask = None if key_mask is None else key_mask[:, None, None, :]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.reshape(n, h, t, v.shape[-1])


def _split_parts(q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None) -> int:
    """The key blocks :func:`attention_split_keys` takes for this call (1: the fused kernel in one go;
    always 1 with a key mask)."""
    if key_mask is not None:
        return 1
    n, h, t, _ = q.shape
    kv = k.shape[1]
    return split_keys_parts(n * kv, h // kv * t, k.shape[2], q.device)


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def attention_sdpa_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`attention_sdpa`'s output and each query's logsumexp of the scaled scores over the keys
    ``key_mask`` allows, ``(N, H, T)`` fp32, both from the fused CPU kernel, which computes the logsumexp
    anyway; ``None`` for it where that kernel is not used (another device), so that the caller computes it.

    Without autograd the output is :func:`attention_sdpa`'s to the bit (the same kernel, or the same
    split over keys at a decode step). Under autograd both carry their gradients (:class:`FlashWithLse`):
    the logsumexp's is folded into the kernel's own backward pass, so it costs no pass over the scores.

    Args:
        q: ``(N, H, T, hd)``; k, v: ``(N, KV, S, hd)``; key_mask: ``(N, S)`` bool or None.
    """
    if _FLASH_CPU is None or _FLASH_CPU_BACKWARD is None or q.device.type != "cpu":
        return attention_sdpa(q, k, v, key_mask, scale), None
    parts = _split_parts(q, k, key_mask)
    if parts > 1:
        return attention_split_keys(q, k, v, scale, parts, with_lse=True)
    n, h, t, hd = q.shape
    qg = q.reshape(n, k.shape[1], -1, hd)  # (N, KV, G·T, hd)
    mask = None
    if key_mask is not None:  # the kernel takes an additive mask in the queries' dtype, as sdpa makes it
        mask = torch.zeros(key_mask.shape, dtype=q.dtype, device=q.device)
        mask = mask.masked_fill_(~key_mask, float("-inf"))[:, None, None, :]
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        out, lse = FlashWithLse.apply(qg, k, v, mask, scale)
    else:
        out, lse = _FLASH_CPU(qg, k, v, attn_mask=mask, scale=scale)[:2]
    return out.reshape(n, h, t, v.shape[-1]), lse.float().reshape(n, h, t)


class FlashWithLse(torch.autograd.Function):
    """The fused CPU attention with its logsumexp as a second differentiable output.

    The kernel's backward computes the scores' gradient as ``P ∘ (dP − D)`` with ``D = rowsum(dO ∘ O)``
    taken from the ``out`` it is given. The logsumexp's gradient adds ``P · g`` (``g = ∂L/∂lse`` per query),
    i.e. ``D − g`` in place of ``D``: q, k and v gain one zero column (scores and outputs unchanged), the
    output's extra column gets gradient 1 and is handed to the backward as ``−g``, so one backward pass of
    the kernel gives both gradients.

    ``apply(q (N, KV, Q, hd), k, v (N, KV, S, hd), mask (N, 1, 1, S) additive in q's dtype or None, scale)``
    -> ``(out (N, KV, Q, hd), lse (N, KV, Q) fp32)``."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        q1, k1, v1 = (F.pad(x, (0, 1)) for x in (q, k, v))
        out1, lse = _FLASH_CPU(q1, k1, v1, attn_mask=mask, scale=scale)[:2]
        ctx.save_for_backward(q1, k1, v1, out1, lse, mask)
        ctx.scale = scale
        return out1[..., :-1].contiguous(), lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q1, k1, v1, out1, lse, mask = ctx.saved_tensors
        d_out1 = F.pad(d_out.to(out1.dtype), (0, 1), value=1.0)
        out_given = torch.cat([out1[..., :-1], -d_lse.to(out1.dtype)[..., None]], dim=-1)
        dq, dk, dv = _FLASH_CPU_BACKWARD(
            d_out1, q1, k1, v1, out_given, lse, 0.0, False, attn_mask=mask, scale=ctx.scale
        )
        return dq[..., :-1], dk[..., :-1], dv[..., :-1], None, None


def split_keys_parts(units: int, queries: int, keys: int, device: torch.device) -> int:
    """How many key blocks :func:`attention_split_keys` should use (1 = don't split).

    Worth it on CPU at decode time only: few query rows, many keys, and fewer (batch x head) work units
    than twice the threads, so the fused kernel, which parallelises over units, would leave cores idle.
    """
    if _FLASH_CPU is None or device.type != "cpu" or queries > 64 or keys < 4096 or torch.is_grad_enabled():
        return 1
    threads = torch.get_num_threads()
    if units >= 2 * threads:
        return 1
    return max(1, min(16, -(-2 * threads // units)))


def attention_split_keys(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, parts: int, with_lse: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention with the keys cut into ``parts`` blocks attended in parallel, merged by their
    log-sum-exps (split-K / flash-decoding). Same result as :func:`attention_sdpa` without a key mask.

    Args:
        q: ``(N, H, T, hd)``; k, v: ``(N, KV, S, hd)``, every key valid.
        parts: key blocks (S is cut into ``parts`` equal blocks plus, if S does not divide, a remainder).
        with_lse: also return each query's logsumexp over all keys, ``(N, H, T)`` fp32.

    Returns:
        ``(N, H, T, hd_v)`` (and the logsumexp with ``with_lse``).
    """
    n, h, t, hd = q.shape
    kv, s = k.shape[1], k.shape[2]
    groups = h // kv
    qg = q.reshape(n, kv, groups * t, hd)  # (N, KV, G·T, hd)
    block = s // parts
    outs, lses = [], []
    if block:
        main = block * parts
        kk = k[:, :, :main].reshape(n, kv * parts, block, hd)  # (N, KV·P, S/P, hd)
        vv = v[:, :, :main].reshape(n, kv * parts, block, v.shape[-1])
        qq = qg[:, :, None].expand(n, kv, parts, groups * t, hd).reshape(n, kv * parts, groups * t, hd)
        o, lse = _FLASH_CPU(qq, kk, vv, scale=scale)[:2]
        outs.append(o.view(n, kv, parts, groups * t, -1))
        lses.append(lse.view(n, kv, parts, groups * t))
    if s % parts:  # the remainder keys as one more block
        main = block * parts
        o, lse = _FLASH_CPU(qg, k[:, :, main:], v[:, :, main:], scale=scale)[:2]
        outs.append(o[:, :, None])
        lses.append(lse[:, :, None])
    o, lse = torch.cat(outs, 2), torch.cat(lses, 2)  # (N, KV, P', G·T, hd), (N, KV, P', G·T)
    w = torch.softmax(lse.float(), dim=2)[..., None]
    out = (o.float() * w).sum(2).to(q.dtype).reshape(n, h, t, v.shape[-1])  # from (N, KV, G·T, hd_v)
    if with_lse:
        return out, torch.logsumexp(lse.float(), dim=2).reshape(n, h, t)
    return out


ATTENTION_KERNELS = {"eager": attention_ref, "sdpa": attention_sdpa}
