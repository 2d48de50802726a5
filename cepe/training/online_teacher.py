"""The online CEPED teacher (``TrainConfig.online_teacher``), computed during training, no teacher pass and
nothing on disk (the offline pass: :mod:`cepe.training.teacher`): the frozen decoder reading the student's
context in its own window, or an earlier CEPE adapter reading it through its encoder
(``TrainConfig.teacher_adapter``).

Shape legend: B batch, n decoder tokens, K chunks, L chunk length, k teacher tokens.
"""

from __future__ import annotations

import torch

from cepe.modeling import decoder_logits

from .losses import teacher_topk


@torch.no_grad()
def online_teacher_topk(
    decoder: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    encoder_input_ids: torch.Tensor,
    encoder_attention_mask: torch.Tensor,
    k: int,
    context_at: torch.Tensor | None = None,
    select: torch.Tensor | None = None,
    max_positions: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder as its own CEPED teacher, computed on the fly: for each example it reads the context
    the student's encoder gets (the tokens of ``encoder_input_ids`` where ``encoder_attention_mask`` is
    True, chunk by chunk, in order) in its own window, inserted before decoder position ``context_at``
    (0: before the decoder tokens), and gives its top-k next-token distribution at the decoder positions.

    Call it with no cross-attention context installed (the CEPE hooks then leave the decoder as it is).

    Args:
        decoder: the frozen decoder (``get_decoder()`` and an output head).
        input_ids, labels: ``(B, n)`` decoder tokens and their labels (-100: not scored).
        encoder_input_ids, encoder_attention_mask: ``(B, K, L)``.
        k: tokens kept per position.
        context_at: ``(B,)`` insertion points (None = all 0).
        select: ``(B,)`` bool, the examples to compute (None = all); the others' rows stay zeros.
        max_positions: the teacher's positions; a longer input keeps the context's last
            ``max_positions - n`` tokens (None = no limit).

    Returns:
        ``(probs (B, n-1, k) fp16, indices (B, n-1, k) int64)``: row t is the teacher's distribution of
        decoder token t+1; rows whose label is -100 are zeros (not computed).
    """
    b, n = input_ids.shape
    probs = torch.zeros((b, n - 1, k), dtype=torch.float16, device=input_ids.device)
    idx = torch.zeros((b, n - 1, k), dtype=torch.long, device=input_ids.device)
    base = decoder.get_decoder()
    for i in range(b):
        rows = (labels[i, 1:] != -100).nonzero().squeeze(-1)  # (N_i,) scored positions
        if rows.numel() == 0 or (select is not None and not bool(select[i])):
            continue
        ctx = encoder_input_ids[i][encoder_attention_mask[i].bool()]  # (S_i,)
        if max_positions is not None and ctx.numel() + n > max_positions:
            ctx = ctx[ctx.numel() + n - max_positions :]
        at = 0 if context_at is None else int(context_at[i])
        ids = torch.cat([input_ids[i, :at], ctx, input_ids[i, at:]])[None]  # (1, S_i + n)
        hidden = base(input_ids=ids, use_cache=False).last_hidden_state[0]  # (S_i + n, D)
        # row t predicts decoder token t+1: before the context while t+1 < at; from t = at-1 on, token t+1
        # stands after the context, so the teacher predicts it from its position t + S_i (for t = at-1:
        # the context's last token, not the decoder token before the context, which predicts the context)
        where = torch.where(rows + 1 < at, rows, rows + ctx.numel())
        p, j = teacher_topk(decoder_logits(decoder, hidden[where]), k)
        probs[i, rows] = p.to(probs.device)
        idx[i, rows] = j.long().to(idx.device)
    return probs, idx


@torch.no_grad()
def adapter_teacher_topk(
    teacher: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    encoder_input_ids: torch.Tensor,
    encoder_attention_mask: torch.Tensor,
    k: int,
    select: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A CEPE adapter as the CEPED teacher (``TrainConfig.teacher_adapter``), computed on the fly: for each
    example it reads the context the student's encoder gets (the tokens of ``encoder_input_ids`` where
    ``encoder_attention_mask`` is True, in order) through its own encoder, re-chunked to its own
    ``chunk_length``, and gives its top-k next-token distribution at the decoder positions (its output
    mixture's where it has one).

    Args:
        teacher: a :class:`cepe.modeling.CepeForCausalLM` over its own decoder.
        input_ids, labels: ``(B, n)`` decoder tokens and their labels (-100: not scored).
        encoder_input_ids, encoder_attention_mask: ``(B, K, L)``.
        k: tokens kept per position.
        select: ``(B,)`` bool, the examples to compute (None = all); the others' rows stay zeros.

    Returns:
        ``(probs (B, n-1, k) fp16, indices (B, n-1, k) int64)`` as :func:`online_teacher_topk`.
    """
    from cepe.chunking import chunk_ids, collate_chunks

    b, n = input_ids.shape
    probs = torch.zeros((b, n - 1, k), dtype=torch.float16, device=input_ids.device)
    idx = torch.zeros((b, n - 1, k), dtype=torch.long, device=input_ids.device)
    scored = labels[:, 1:] != -100  # (B, n-1)
    rows = scored.any(-1)
    if select is not None:
        rows &= select.bool()
    which = rows.nonzero().squeeze(-1).tolist()
    if not which:
        return probs, idx
    length = int(teacher.cepe_config.chunk_length)
    chunks = [chunk_ids(encoder_input_ids[i][encoder_attention_mask[i].bool()].cpu(), length) for i in which]
    enc, mask = collate_chunks(chunks)  # (b', K', L'): its own chunking of the same tokens
    device = next(teacher.parameters()).device
    keep = scored[which]  # (b', n-1)
    cols = keep.any(0).nonzero().squeeze(-1)  # (C,) positions scored in any of these rows
    out = teacher(
        input_ids=input_ids[which].to(device),
        encoder_input_ids=enc.to(device),
        encoder_attention_mask=mask.to(device),
        logits_to_keep=cols.to(device),  # (b', C, V): the head only where some row is scored
    )
    p, j = teacher_topk(out.logits[keep[:, cols].to(device)], k)  # (N, k)
    sub_p = torch.zeros((len(which), n - 1, k), dtype=torch.float16, device=input_ids.device)
    sub_j = torch.zeros((len(which), n - 1, k), dtype=torch.long, device=input_ids.device)
    sub_p[keep] = p.to(sub_p.device)
    sub_j[keep] = j.long().to(sub_j.device)
    probs[which], idx[which] = sub_p, sub_j
    return probs, idx
