"""Output mixture (``CepeConfig.output_mix``): CEPE's next-token distribution mixed, token by token, with
the decoder's own distribution without the context.

    p(y) = λ·p_cepe(y) + (1 − λ)·p_decoder(y),    λ = σ(a),    a = w·[h_cepe; h_decoder] + b

``h_cepe`` and ``h_decoder`` are the final (normalised) hidden states of the same decoder tokens with and
without cross-attention. A mixture can never score a token below ``log(1 − λ) + log p_decoder``, so a
head that learns where reading helps (λ near 1 on a copied span, near 0 elsewhere) keeps what the reader
copies without paying its cost on ordinary text.

Mixed logits are returned as ``logits_decoder + f(δ)`` with ``δ = log p_cepe − log p_decoder``: their
softmax is the mixture, and where the two distributions agree (no context read, a zero ``o_proj``) they
are the decoder's logits exactly.

Shape legend: B batch, T decoder tokens, N positions, D decoder width, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def mix_head(hidden_size: int, like: torch.Tensor) -> nn.Linear:
    """The mixing head ``Linear(2·D, 1)``, all zero (λ = ½ everywhere until it trains), on ``like``'s
    device, in fp32."""
    head = nn.Linear(2 * hidden_size, 1, bias=True, device=like.device, dtype=torch.float32)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
    return head


def mix_logit(head: nn.Linear, h_ctx: torch.Tensor, h_dec: torch.Tensor) -> torch.Tensor:
    """``a`` ``(...)`` in fp32 (λ = σ(a)) from the final hidden states ``(..., D)`` with and without the
    context."""
    x = torch.cat([h_ctx, h_dec], dim=-1).to(head.weight.dtype)
    with torch.autocast(x.device.type, enabled=False):
        return head(x).squeeze(-1).float()


def mix_logits(logits_ctx: torch.Tensor, logits_dec: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Logits ``(..., V)`` (fp32) whose softmax is ``σ(a)·softmax(logits_ctx) + σ(−a)·softmax(logits_dec)``.

    ``logits_dec + f(δ)`` with ``δ = log_softmax(logits_ctx) − log_softmax(logits_dec)`` and
    ``f(δ) = log(λ·e^δ + 1 − λ)``, computed as ``log1p(λ·expm1(δ))`` for ``δ ≤ 0`` and
    ``δ + log1p((1 − λ)·expm1(−δ))`` for ``δ > 0`` (no overflow; ``f(0) = 0`` exactly, so equal inputs
    give ``logits_dec`` bit for bit), and as ``logaddexp(log λ + δ, log(1 − λ))`` where the ``log1p``
    argument is below −½ (there one side of the mixture is far below the other).

    Args:
        logits_ctx: ``(..., V)`` logits with the context; logits_dec: ``(..., V)`` without.
        a: ``(...)`` the mixing logit.
    """
    lc, ld = logits_ctx.float(), logits_dec.float()
    delta = lc.log_softmax(-1) - ld.log_softmax(-1)  # (..., V)
    a = a.float()[..., None]
    pos = delta > 0
    arg = torch.where(  # in [-1, 0]: the log1p argument of the branch that applies
        pos,
        torch.sigmoid(-a) * torch.expm1(-delta.clamp_min(0)),
        torch.sigmoid(a) * torch.expm1(delta.clamp_max(0)),
    )
    exact = torch.log1p(arg) + torch.where(pos, delta, torch.zeros_like(delta))
    # near arg = -1 the log1p form loses the small side (λ or 1 - λ rounded to 1): log-space there
    stable = torch.logaddexp(F.logsigmoid(a) + delta, F.logsigmoid(-a))
    return ld + torch.where(arg > -0.5, exact, stable)


def mix_logits_ref(logits_ctx: torch.Tensor, logits_dec: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`mix_logits`: the mixture's log-probabilities, from probabilities in fp64."""
    lam, rest = torch.sigmoid(a.double())[..., None], torch.sigmoid(-a.double())[..., None]
    return torch.log(
        lam * torch.softmax(logits_ctx.double(), -1) + rest * torch.softmax(logits_dec.double(), -1)
    )


def mix_nll(logp_ctx: torch.Tensor, logp_dec: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Per-position negative log-likelihood ``(N,)`` of the mixture from the target's log-probabilities
    under each side ``(N,)`` and the mixing logit ``(N,)`` (all the mixture needs at a known target)."""
    return -torch.logaddexp(F.logsigmoid(a) + logp_ctx.float(), F.logsigmoid(-a) + logp_dec.float())
