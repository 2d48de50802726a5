"""Splitting token sequences into encoder chunks and batching them.

Shape legend: B batch, K chunks, L chunk length.
Chunks are right-padded (positions 0..L-1 of real tokens are the same in training and evaluation);
padding chunks (all positions masked) contribute nothing to the model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def chunk_ids(
    ids: Sequence[int] | torch.Tensor,
    chunk_length: int,
    max_chunks: int | None = None,
    pad_id: int = 0,
    keep: str = "last",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a 1-D token sequence into consecutive chunks of ``chunk_length`` tokens.

    Args:
        ids: token ids ``(N,)``.
        chunk_length: L, tokens per chunk.
        max_chunks: keep at most this many chunks, i.e. at most ``max_chunks · L`` tokens: when ``N`` is
            more, the ids are cut to that window first (``keep="last"``: the last ``max_chunks · L``
            tokens, ``"first"``: the first ones) and the window is chunked from its start, so every kept
            chunk is full and none of the budget goes to padding. Without a cut (``N ≤ max_chunks · L``)
            the result is exactly that without ``max_chunks``.
        pad_id: id written into padded positions (masked out, value irrelevant).
        keep: ``"last"`` (the tokens nearest the end) or ``"first"``, when ``max_chunks`` truncates.

    Returns:
        ``(chunks, mask)``, both ``(K, L)``; ``mask`` is bool, True on real tokens. The last chunk is
        right-padded. An empty input gives ``K = 0``.
    """
    if chunk_length <= 0:
        raise ValueError(f"chunk_length must be positive, got {chunk_length}")
    if keep not in ("last", "first"):
        raise ValueError(f"keep must be 'last' or 'first' (which chunks max_chunks keeps), got {keep!r}")
    if max_chunks is not None and max_chunks < 0:
        raise ValueError(f"max_chunks must be 0 or more (or None: no limit), got {max_chunks}")
    t = torch.as_tensor(ids, dtype=torch.long).flatten()
    if max_chunks is not None and t.numel() > max_chunks * chunk_length:
        budget = max_chunks * chunk_length
        t = t[t.numel() - budget :] if keep == "last" else t[:budget]
    n = t.numel()
    k = (n + chunk_length - 1) // chunk_length
    out = torch.full((k * chunk_length,), pad_id, dtype=torch.long)
    out[:n] = t
    mask = torch.zeros(k * chunk_length, dtype=torch.bool)
    mask[:n] = True
    return out.view(k, chunk_length), mask.view(k, chunk_length)


def chunk_texts(
    pieces: Sequence[Sequence[int]], chunk_length: int, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk per piece (e.g. a retrieved passage or a demonstration), truncated to ``chunk_length``.

    Returns:
        ``(chunks, mask)``, both ``(K, L)`` with K = len(pieces).
    """
    k = len(pieces)
    out = torch.full((k, chunk_length), pad_id, dtype=torch.long)
    mask = torch.zeros((k, chunk_length), dtype=torch.bool)
    for i, p in enumerate(pieces):
        p = list(p)[:chunk_length]
        out[i, : len(p)] = torch.as_tensor(p, dtype=torch.long)
        mask[i, : len(p)] = True
    return out, mask


def collate_chunks(
    items: Sequence[tuple[torch.Tensor, torch.Tensor]], pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch per-example chunk tensors with different K by appending all-padding chunks.

    Args:
        items: list of ``(chunks (K_i, L), mask (K_i, L))``.

    Returns:
        ``(encoder_input_ids, encoder_attention_mask)``, both ``(B, max K_i, L)``.
    """
    if not items:
        raise ValueError("collate_chunks needs at least one example")
    lengths = {c.shape[-1] for c, _ in items}
    if len(lengths) != 1:
        raise ValueError(f"all examples must use the same chunk length, got {sorted(lengths)}")
    (length,) = lengths
    kmax = max(1, max(c.shape[0] for c, _ in items))
    ids = torch.full((len(items), kmax, length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), kmax, length), dtype=torch.bool)
    for b, (c, m) in enumerate(items):
        ids[b, : c.shape[0]] = c
        mask[b, : m.shape[0]] = m.bool()
    return ids, mask
