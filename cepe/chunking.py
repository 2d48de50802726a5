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
        max_chunks: keep at most this many chunks (``keep="last"`` keeps those nearest the end).
        pad_id: id written into padded positions (masked out, value irrelevant).
        keep: ``"last"`` or ``"first"`` chunks when ``max_chunks`` truncates.

    Returns:
        ``(chunks, mask)``, both ``(K, L)``; ``mask`` is bool, True on real tokens. The last chunk is
        right-padded. An empty input gives ``K = 0``.
    """
    if chunk_length <= 0:
        raise ValueError(f"chunk_length must be positive, got {chunk_length}")
    t = torch.as_tensor(ids, dtype=torch.long).flatten()
    n = t.numel()
    k = (n + chunk_length - 1) // chunk_length
    out = torch.full((k * chunk_length,), pad_id, dtype=torch.long)
    out[:n] = t
    mask = torch.zeros(k * chunk_length, dtype=torch.bool)
    mask[:n] = True
    out, mask = out.view(k, chunk_length), mask.view(k, chunk_length)
    if max_chunks is not None and k > max_chunks:
        sl = slice(k - max_chunks, k) if keep == "last" else slice(0, max_chunks)
        out, mask = out[sl], mask[sl]
    return out, mask


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
