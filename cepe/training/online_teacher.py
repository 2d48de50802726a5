"""The online CEPED teacher (``TrainConfig.online_teacher``): the frozen decoder reads the student's context
in its own window during training, no teacher pass and nothing on disk (the offline pass:
:mod:`cepe.training.teacher`).

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
        where = torch.where(rows < at, rows, rows + ctx.numel())
        p, j = teacher_topk(decoder_logits(decoder, hidden[where]), k)
        probs[i, rows] = p.to(probs.device)
        idx[i, rows] = j.long().to(idx.device)
    return probs, idx
