"""Retrieval-augmented language modelling (§5.1).

Documents are split by id into a test and a retrieval split; retrieval documents are cut into passages of
``passage_tokens`` tokens. Each test sequence has ``seq_length`` tokens; its first ``query_tokens`` tokens
(decoded) are the query; ``k`` passages are retrieved; perplexity is taken over the last ``eval_tokens``
tokens (paper: 2048 / 256 / 1792). CEPE reads the sequence in the decoder and the passages in the encoder
(one per chunk); ``full`` prepends them (best passage nearest the input), ``truncated`` uses none,
``replug`` mixes one pass per passage with ``softmax(score / τ)``.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, field
from typing import Any

from cepe.eval.common import EvalSetup, iter_source, limit_items, run_examples, text_key
from cepe.eval.methods import Request
from cepe.eval.retrieval import build_retriever


@dataclass
class Config:
    """Settings (defaults: the paper's; ``configs/eval/ralm.yaml`` scales them down).

    Attributes:
        sources: document sources (one domain each).
        retrieval_sources: separate retrieval corpus sources; None = the retrieval split of ``sources``.
        split_seed / test_fraction / retrieval_fraction: the document split (see :mod:`cepe.data.split`);
            documents in neither test nor retrieval are not used.
        seq_length, query_tokens, eval_tokens: sequence layout (eval_tokens None = seq_length - query_tokens).
        passage_tokens: retrieval passage length (paper 256).
        ks: numbers of passages (paper 8, 20, 50).
        retriever: ``bm25`` or ``dense``; dense_model_dir: embedding model (default: the packaged one).
        sequences_per_domain: test sequences per domain (one per test document).
    """

    sources: list[dict[str, Any]] = field(
        default_factory=lambda: [{"name": "acl", "corpus": "acl"}, {"name": "code", "corpus": "stdlib"}]
    )
    retrieval_sources: list[dict[str, Any]] | None = None
    split_seed: int = 1  # the shipped adapter's training split (with test 0.1 / retrieval 0.05: held out)
    test_fraction: float = 0.05
    retrieval_fraction: float = 0.05
    seq_length: int = 2048
    query_tokens: int = 256
    eval_tokens: int | None = None
    passage_tokens: int = 256
    ks: list[int] = field(default_factory=lambda: [8, 20, 50])
    retriever: str = "bm25"
    dense_model_dir: str | None = None
    sequences_per_domain: int = 1000
    max_documents: int | None = None
    seed: int = 0


def _documents(setup: EvalSetup, cfg: Config) -> tuple[dict[str, list[list[int]]], list[list[int]]]:
    """``(test documents of at least seq_length tokens by domain, retrieval passages)``, as token ids: the
    passages are the retrieval split of ``sources`` (or, when given, every document of ``retrieval_sources``)
    cut into ``passage_tokens``, less any document whose text (up to whitespace) is a test document's; a
    test document whose text is a training document's is left out too."""
    from cepe.data.split import SplitFractions, assign_split

    fr = SplitFractions(test=cfg.test_fraction, retrieval=cfg.retrieval_fraction)
    tests: dict[str, list[list[int]]] = {}
    passages: list[list[int]] = []
    tested: set[bytes] = set()  # test texts: a passage that repeats one would hand it its own continuation
    trained: set[bytes] = set()  # training texts: a test document that repeats one was trained on
    found: list[tuple[bytes, str, list[int]]] = []
    kept: list[tuple[bytes, str]] = []
    for src in cfg.sources:
        for doc in iter_source({"max_documents": cfg.max_documents, **src}):
            split, key = assign_split(doc["id"], cfg.split_seed, fr), text_key(doc["text"])
            if split == "test":
                ids = setup.encode(doc["text"])
                if len(ids) >= cfg.seq_length:
                    found.append((key, doc["domain"], ids))
                    tested.add(key)
            elif split == "retrieval" and cfg.retrieval_sources is None:
                kept.append((key, doc["text"]))
            elif split == "train":
                trained.add(key)
    for key, domain, ids in found:
        if key not in trained:
            tests.setdefault(domain, []).append(ids)
    retrieval = [(k, t) for k, t in kept] + [
        (text_key(doc["text"]), doc["text"])
        for src in cfg.retrieval_sources or []
        for doc in iter_source(src)
    ]
    for key, text in retrieval:
        if key not in tested:
            ids = setup.encode(text)
            passages += [ids[i : i + cfg.passage_tokens] for i in range(0, len(ids), cfg.passage_tokens)]
    if not tests:
        raise ValueError(
            f"no test document has {cfg.seq_length} tokens: lower seq_length or raise test_fraction"
        )
    return tests, passages


def _request(method: str, seq: list[int], ctx: list[list[int]], scores: list[float], n_eval: int) -> Request:
    """Score the last ``n_eval`` tokens of ``seq`` with the retrieved passages ``ctx`` as ``method`` reads
    them: in the decoder, best passage nearest the input (full, StreamingLLM); none (truncated); else as
    context with their retrieval ``scores`` (CEPE, REPLUG)."""
    if method in ("full", "streamingllm"):
        return Request([t for p in reversed(ctx) for t in p] + seq, n_eval)
    if method == "truncated":
        return Request(seq, n_eval)
    return Request(seq, n_eval, ctx, scores)


def run(setup: EvalSetup, cfg: Config) -> dict[str, Any]:
    n_eval = cfg.eval_tokens or cfg.seq_length - cfg.query_tokens
    if n_eval >= cfg.seq_length:
        raise ValueError("eval_tokens must be smaller than seq_length")
    tests, passages = _documents(setup, cfg)
    retriever = build_retriever(cfg.retriever, [setup.decode(p) for p in passages], cfg.dense_model_dir)
    kmax = max(cfg.ks)
    rng = random.Random(cfg.seed)

    def score(m, item, method):
        req = _request(method, *item, n_eval)
        return float(-m.score([req])[0].sum()), req.num_tokens

    rows = []
    for domain, docs in tests.items():
        seqs = []
        for d in docs:
            off = rng.randint(0, len(d) - cfg.seq_length)
            seqs.append(d[off : off + cfg.seq_length])
        seqs = limit_items(seqs, cfg.sequences_per_domain, setup)
        idx, scores = retriever.search([setup.decode(s[: cfg.query_tokens]) for s in seqs], kmax)
        for k in [0, *cfg.ks]:
            for method in setup.methods:
                if (k == 0) != (method == "truncated"):
                    continue
                items = [
                    (seqs[i], [passages[j] for j in idx[i][:k]], [float(x) for x in scores[i][:k]])
                    for i in range(len(seqs))
                ]
                fn = functools.partial(score, method=method)
                nll, cost = run_examples(setup, method, items, fn, f"ralm {domain} k={k}")
                rows.append(
                    {
                        "method": method,
                        "setting": {"k": k, "domain": domain},
                        "metric": "ppl",
                        "value": math.exp(sum(nll) / (len(seqs) * n_eval)),
                        "n": len(seqs),
                        **cost,
                    }
                )
    return {
        "task": "ralm",
        "rows": rows,
        "notes": [f"{len(passages)} retrieval passages, retriever={cfg.retriever}; k=0 is the decoder alone"],
        "plot_x": "k",
    }
