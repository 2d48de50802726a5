"""Distillation loss of CEPED (Appendix A): KL(teacher ‖ student) over the teacher's stored top-k tokens.

Shape legend: N positions, V vocabulary, k stored teacher tokens per position. All math in fp32.
"""

from __future__ import annotations

import torch

KL_FORMS = ("drop", "renorm", "other")


def topk_kl(
    student_logits: torch.Tensor,
    teacher_probs: torch.Tensor,
    teacher_indices: torch.Tensor,
    form: str = "drop",
    smoothing: float = 1e-4,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over positions of KL(teacher ‖ student) restricted to the teacher's top-k tokens.

    With ``p`` the stored teacher probabilities and ``log q`` the student's full-softmax log-probabilities
    at the same ids, the forms are:

    - ``"drop"`` (the released code's ``kl_loss_mode drop``, the default): ``Σ_k p·(log p − log q)`` with
      neither side renormalised; probability the student puts outside the top-k lowers every ``q`` and so
      costs loss.
    - ``"renorm"``: both distributions renormalised over the k tokens (the student's mass outside them is
      free).
    - ``"other"``: a (k+1)-th class holds the leftover mass ``1 - Σ`` on both sides, the teacher smoothed
      as ``(1 - smoothing)·p + smoothing/(k+1)`` so it is never zero.

    Args:
        student_logits: ``(N, V)`` student logits (any float dtype; computed in fp32).
        teacher_probs: ``(N, k)`` teacher probabilities of its top-k tokens (as stored, e.g. fp16).
        teacher_indices: ``(N, k)`` the vocabulary ids of those tokens.
        form: ``"drop" | "renorm" | "other"``.
        smoothing: see ``form="other"``.
        mask: ``(N,)`` bool, True where the position counts (e.g. ``labels != -100``); None = all. The mean
            runs over counted positions; with none counted the loss is 0 (still connected to the graph).

    Returns:
        A 0-dim fp32 tensor.
    """
    if student_logits.dim() != 2 or teacher_probs.shape != teacher_indices.shape:
        raise ValueError(
            f"need student_logits (N, V) and teacher probs/indices (N, k) of one shape; got "
            f"{tuple(student_logits.shape)}, {tuple(teacher_probs.shape)}, {tuple(teacher_indices.shape)}"
        )
    if student_logits.shape[0] != teacher_probs.shape[0]:
        raise ValueError(f"student has {student_logits.shape[0]} positions, teacher {teacher_probs.shape[0]}")
    if mask is not None and tuple(mask.shape) != (student_logits.shape[0],):
        raise ValueError(f"mask must be (N,) = ({student_logits.shape[0]},), got {tuple(mask.shape)}")
    if form not in KL_FORMS:
        raise ValueError(f"form must be one of {KL_FORMS}, got {form!r}")
    logits = student_logits.float()
    log_z = torch.logsumexp(logits, dim=-1, keepdim=True)  # (N, 1)
    picked = logits.gather(-1, teacher_indices.long())  # (N, k)
    p = teacher_probs.float().clamp_min(0.0)
    if form in ("drop", "renorm"):
        if form == "renorm":
            p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
            log_q = picked - torch.logsumexp(picked, dim=-1, keepdim=True)  # student renormalised over k
        else:
            log_q = picked - log_z  # full-softmax log-probabilities at the teacher's ids
        log_p = torch.log(p.clamp_min(1e-30))
        kl = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)  # (N,)
    else:
        k = p.shape[-1]
        rest = (1.0 - p.sum(-1, keepdim=True)).clamp_min(0.0)
        p_full = torch.cat([p, rest], dim=-1)
        p_full = p_full / p_full.sum(-1, keepdim=True)
        p_full = (1.0 - smoothing) * p_full + smoothing / (k + 1)
        log_q_top = picked - log_z  # (N, k) full-softmax log-probabilities
        q_rest = (1.0 - log_q_top.exp().sum(-1, keepdim=True)).clamp_min(1e-12)
        log_q = torch.cat([log_q_top, torch.log(q_rest)], dim=-1)
        kl = (p_full * (torch.log(p_full) - log_q)).sum(-1)  # (N,)
    if mask is None:
        return kl.mean()
    keep = mask.to(kl.device).bool()
    return torch.where(keep, kl, torch.zeros_like(kl)).sum() / keep.sum().clamp_min(1)


def teacher_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k probabilities (fp16) and vocabulary ids (int32) of ``logits`` ``(..., V)`` (softmax in fp32)."""
    probs = torch.softmax(logits.float(), dim=-1)
    values, indices = probs.topk(k, dim=-1)
    return values.to(torch.float16), indices.to(torch.int32)
