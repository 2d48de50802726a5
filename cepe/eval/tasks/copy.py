"""Copy probe: can the model read its context back?

A passage of ``passage_tokens`` tokens from a held-out document goes to the encoder (pieces of
``chunk_length``, each in chunks of the adapter's own); the decoder reads the passage's first
``prefix_tokens`` tokens and then has to continue it. The score is the perplexity of the passage after
the prefix. ``truncated`` (the decoder alone, no context) is the baseline; ``full`` reads the passage
in its own window (an upper bound: the decoder copying from itself). With ``shuffle`` the passage's
tokens are permuted first (seeded), so that language gives no help and only reading the context lowers
the perplexity.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from cepe.eval.common import EvalSetup, iter_source, limit_items, run_examples
from cepe.eval.methods import standard_request

DEFAULT_SOURCES = [{"name": "essays", "corpus": "essays"}]


@dataclass
class Config:
    """Settings.

    Attributes:
        sources: document sources, one domain each (see :func:`cepe.eval.common.iter_source`).
        passage_tokens: tokens of each passage (the whole passage is the context).
        prefix_tokens: tokens of the passage given to the decoder before the scored part.
        chunk_length: the context's pieces (aligned to the window); CEPE encodes each piece in chunks of its
            adapter's ``chunk_length`` (``methods.cepe.chunk_length`` overrides it), so a longer piece is split
            further and a shorter one is one padded chunk.
        passages_per_domain: passages per domain (one per document, at a seeded offset).
        shuffle: also score shuffled passages (a second row per domain, ``order: shuffled``).
        max_documents: documents read per source (None = all).
        seed: picks documents, offsets and permutations.
    """

    sources: list[dict[str, Any]] = field(default_factory=lambda: list(DEFAULT_SOURCES))
    passage_tokens: int = 256
    prefix_tokens: int = 16
    chunk_length: int = 64
    passages_per_domain: int = 8
    shuffle: bool = True
    max_documents: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.prefix_tokens < self.passage_tokens:
            raise ValueError(
                f"prefix_tokens ({self.prefix_tokens}) must be in 1..passage_tokens-1 ({self.passage_tokens - 1})"
            )


def passages(token_docs: list[list[int]], cfg: Config, shuffled: bool) -> list[list[int]]:
    """One passage per document (documents in seeded order), at most ``passages_per_domain``."""
    rng = random.Random(cfg.seed)
    order = [i for i, d in enumerate(token_docs) if len(d) >= cfg.passage_tokens]
    rng.shuffle(order)
    out = []
    for i in order[: cfg.passages_per_domain]:
        d = token_docs[i]
        off = rng.randint(0, len(d) - cfg.passage_tokens)
        p = list(d[off : off + cfg.passage_tokens])
        if shuffled:
            random.Random(cfg.seed * 7919 + i).shuffle(p)
        out.append(p)
    return out


def run(setup: EvalSetup, cfg: Config) -> dict[str, Any]:
    """Perplexity of each passage after its prefix, per domain, order (natural / shuffled) and method."""
    domains: dict[str, list[list[int]]] = {}
    for src in cfg.sources:
        for doc in iter_source({"max_documents": cfg.max_documents, **src}):
            domains.setdefault(doc["domain"], []).append(setup.encode(doc["text"]))
    rows = []
    scored = cfg.passage_tokens - cfg.prefix_tokens
    for order in ("natural", "shuffled") if cfg.shuffle else ("natural",):
        for domain, docs in domains.items():
            items = limit_items(passages(docs, cfg, order == "shuffled"), None, setup)
            for method in setup.methods:

                def score(m, p, _method=method):
                    pieces = [p[i : i + cfg.chunk_length] for i in range(0, len(p), cfg.chunk_length)]
                    req = standard_request(_method, pieces, p, scored)
                    if (
                        _method == "full"
                    ):  # the passage once in the window: the decoder reads it, then repeats it
                        req.input_ids = p + p
                    lp = m.score([req])[0]
                    return float(-lp.sum()), req.num_tokens

                nll, cost = run_examples(setup, method, items, score, f"copy {domain} {order}")
                rows.append(
                    {
                        "method": method,
                        "setting": {"domain": domain, "order": order},
                        "metric": "ppl",
                        "value": math.exp(sum(nll) / (len(items) * scored)),
                        "n": len(items),
                        **cost,
                    }
                )
    return {"task": "copy", "rows": rows, "notes": [], "plot_x": None}  # categorical: table only
