"""Long-context language modelling: perplexity of the last ``eval_tokens`` tokens of sequences of
``total`` tokens, per domain.

Per sequence the decoder reads the last ``decoder_window`` tokens (paper: 2K when the total is 4K, else
4K); for CEPE the tokens before go to the encoder in pieces of ``chunk_length`` (aligned to the window;
each piece in chunks of the adapter's own ``chunk_length``),
``full``/``streamingllm`` read the whole sequence, ``truncated`` only the window, ``replug`` prepends each
chunk separately (uniform weights).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from cepe.eval.common import EvalSetup, chunk_tail_aligned, iter_source, limit_items, run_examples
from cepe.eval.methods import Request, standard_request

HELD_OUT = {"split": "test", "split_seed": 1, "test_fraction": 0.1, "retrieval_fraction": 0.05}
"""The test split of the shipped adapter's training data (its document split: seed 1, 10 % test, 5 %
retrieval): documents it was never trained on."""

DEFAULT_SOURCES = [
    {"name": "acl", "corpus": "acl", **HELD_OUT},
    {"name": "code", "corpus": "stdlib", **HELD_OUT},
    {"name": "essays", "corpus": "essays"},  # never trained on
]


@dataclass
class Config:
    """Settings (defaults: the paper's; ``configs/eval/lm.yaml`` scales them down for a CPU).

    Attributes:
        sources: document sources, one domain each (see :func:`cepe.eval.common.iter_source`).
        totals: total tokens per sequence (paper 4K..128K).
        decoder_window: tokens in the decoder (paper 4096) ...
        decoder_window_overrides: ... except these totals (paper ``{4096: 2048}``).
        eval_tokens: scored tokens at the end of each sequence (paper 256).
        chunk_length: the context's pieces (aligned to the window); CEPE encodes each piece in chunks of its
            adapter's ``chunk_length`` (``methods.cepe.chunk_length`` overrides it), so a longer piece is split
            further and a shorter one is one padded chunk (paper 256).
        sequences_per_domain: sequences per domain and total (paper 5000; 10 at 128K).
        max_documents: documents read per source (None = all).
        seed: picks documents and offsets.
        windows_per_document: non-overlapping windows taken from one document (paper: 1).
        replug_piece_length: REPLUG's context piece length (None = ``chunk_length``); each piece costs
            one decoder pass, so longer pieces keep REPLUG affordable at long totals.
        replug_max_pieces: REPLUG uses only the nearest this-many pieces (None = all).
    """

    sources: list[dict[str, Any]] = field(default_factory=lambda: list(DEFAULT_SOURCES))
    totals: list[int] = field(default_factory=lambda: [4096, 8192, 32768])
    decoder_window: int = 4096
    decoder_window_overrides: dict[int, int] = field(default_factory=lambda: {4096: 2048})
    eval_tokens: int = 256
    chunk_length: int = 256
    sequences_per_domain: int = 5000
    max_documents: int | None = None
    seed: int = 0
    windows_per_document: int = 1
    replug_piece_length: int | None = None
    replug_max_pieces: int | None = None

    def window(self, total: int) -> int:
        w = int(
            {int(k): v for k, v in self.decoder_window_overrides.items()}.get(int(total), self.decoder_window)
        )
        w = min(w, total)
        if self.eval_tokens >= w:
            raise ValueError(
                f"eval_tokens ({self.eval_tokens}) must be smaller than the decoder window ({w})"
            )
        return w


def sample_sequences(
    token_docs: list[list[int]], total: int, count: int, seed: int, per_document: int = 1
) -> list[list[int]]:
    """Up to ``count`` windows of ``total`` tokens from documents with at least ``total`` tokens, documents
    in a seeded random order; at most ``per_document`` non-overlapping windows per document (at seeded
    random offsets within equal slices of the document), so a domain with few long documents still yields
    several sequences."""
    rng = random.Random(seed * 1_000_003 + total)
    order = [i for i, d in enumerate(token_docs) if len(d) >= total]
    rng.shuffle(order)
    out: list[list[int]] = []
    for i in order:
        d = token_docs[i]
        n = max(1, min(per_document, len(d) // total))
        span = len(d) // n  # slice j covers [j * span, (j + 1) * span), each >= total tokens
        for j in range(n):
            off = j * span + rng.randint(0, span - total)
            out.append(d[off : off + total])
            if len(out) == count:
                return out
    return out


def window_request(
    method: str,
    seq: list[int],
    window: int,
    eval_tokens: int,
    chunk_length: int,
    replug_piece_length: int | None = None,
    replug_max_pieces: int | None = None,
) -> Request:
    """The request scoring the last ``eval_tokens`` of ``seq`` ``(T,)``: the decoder reads the last
    ``window`` tokens, the tokens before go to the encoder (CEPE) or are read by the decoder (full) in
    pieces of ``chunk_length`` aligned to the window (REPLUG: ``replug_piece_length``, nearest
    ``replug_max_pieces``). Shared by this task and the lm-evaluation-harness model."""
    if method == "replug":
        pieces = chunk_tail_aligned(seq[:-window], replug_piece_length or chunk_length)
        if replug_max_pieces:
            pieces = pieces[-replug_max_pieces:]
    else:
        pieces = chunk_tail_aligned(seq[:-window], chunk_length)
    return standard_request(method, pieces, seq[-window:], eval_tokens)


def run(setup: EvalSetup, cfg: Config) -> dict[str, Any]:
    """Evaluate every method on every (domain, total); rows hold PPL plus a macro average."""
    domains: dict[str, list[list[int]]] = {}
    for src in cfg.sources:
        for doc in iter_source({"max_documents": cfg.max_documents, **src}):
            domains.setdefault(doc["domain"], []).append(setup.encode(doc["text"]))
    rows, notes = [], []
    for total in cfg.totals:
        window = cfg.window(total)
        per_method: dict[str, list[float]] = {m: [] for m in setup.methods}
        for domain, docs in domains.items():
            seqs = limit_items(
                sample_sequences(docs, total, cfg.sequences_per_domain, cfg.seed, cfg.windows_per_document),
                None,
                setup,
            )
            if not seqs:
                notes.append(f"{domain}: no document has {total} tokens; skipped")
                continue
            for method in setup.methods:

                def score(m, seq, _w=window, _method=method):
                    req = window_request(
                        _method,
                        seq,
                        _w,
                        cfg.eval_tokens,
                        cfg.chunk_length,
                        cfg.replug_piece_length,
                        cfg.replug_max_pieces,
                    )
                    lp = m.score([req])[0]
                    return float(-lp.sum()), req.num_tokens

                nll, cost = run_examples(setup, method, seqs, score, f"lm {domain} T={total}")
                ppl = math.exp(sum(nll) / (len(seqs) * cfg.eval_tokens))
                per_method[method].append(ppl)
                rows.append(
                    {
                        "method": method,
                        "setting": {"total": total, "domain": domain, "decoder_window": window},
                        "metric": "ppl",
                        "value": ppl,
                        "n": len(seqs),
                        **cost,
                    }
                )
        for method, ppls in per_method.items():
            if ppls:
                rows.append(
                    {
                        "method": method,
                        "setting": {"total": total, "domain": "avg", "decoder_window": window},
                        "metric": "ppl",
                        "value": sum(ppls) / len(ppls),
                        "n": len(ppls),
                    }
                )
    # one decoder window per total: it labels no line of its own
    return {"task": "lm", "rows": rows, "notes": notes, "plot_x": "total", "plot_ignore": ["decoder_window"]}
