"""``cepe.chunking.chunk_ids``: ``max_chunks`` keeps its whole budget of ``max_chunks · L`` tokens (the window
is cut before chunking), and ``keep`` takes only the values it names."""

from __future__ import annotations

import pytest
import torch

from cepe.chunking import chunk_ids


def test_max_chunks_keeps_the_last_budget_of_tokens():
    """n = 1025, L = 256, 4 chunks: the last 1024 tokens in 4 full chunks (before: 769 tokens, the last
    chunk a single token and 255 of padding)."""
    ids = torch.arange(1025)
    chunks, mask = chunk_ids(ids, 256, max_chunks=4)
    assert chunks.shape == (4, 256) and mask.all()
    assert torch.equal(chunks.flatten(), ids[1:])
    chunks, mask = chunk_ids(ids, 256, max_chunks=4, keep="first")
    assert mask.all() and torch.equal(chunks.flatten(), ids[:1024])


def test_max_chunks_without_a_cut_changes_nothing():
    ids = list(range(10, 33))  # 23 tokens: 3 chunks of 8, the last right-padded
    plain = chunk_ids(ids, 8, pad_id=-1)
    for keep in ("last", "first"):
        for k in (3, 4):
            got = chunk_ids(ids, 8, max_chunks=k, pad_id=-1, keep=keep)
            assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])
    assert plain[1].sum().item() == 23 and plain[0][-1, -1].item() == -1
    chunks, mask = chunk_ids(ids, 8, max_chunks=2)  # cut: the last 16 tokens, two full chunks
    assert mask.all() and chunks.flatten().tolist() == ids[-16:]
    chunks, mask = chunk_ids(ids, 8, max_chunks=0)
    assert chunks.shape == (0, 8) and mask.shape == (0, 8)


def test_keep_and_max_chunks_are_checked():
    with pytest.raises(ValueError, match="keep must be 'last' or 'first'"):
        chunk_ids(range(20), 8, max_chunks=1, keep="end")
    with pytest.raises(ValueError, match="keep must be"):
        chunk_ids(range(4), 8, keep="Last")
    with pytest.raises(ValueError, match="max_chunks must be 0 or more"):
        chunk_ids(range(20), 8, max_chunks=-1)
