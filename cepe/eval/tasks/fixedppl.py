"""Fixed-target perplexity against context length.

Each sequence fixes one decoder window (its last ``eval_tokens`` tokens are scored) and varies only how
much of the text before it the model gets: ``contexts`` tokens (0, 512, ..., 32K). CEPE reads that text in
its encoder; ``full`` and ``streamingllm`` read it in the decoder, ``replug`` as pieces, ``truncated``
never. Because the scored tokens and the window never change, a falling curve shows that the context is
read (the ``lm`` task moves its windows between totals, so its columns cannot show this).

With ``foreign_context`` each sequence reads another document's context (the result's ``context_from``
names whose, by index), a control for what any context of the kind gives without being read.

Each row keeps its sequences' per-token NLL (``nll_per_sequence``, in the order of the result's
``sequences``: each one's source, document id and token offset), and the
result's ``steps`` compare each context length with the next shorter one on the same sequences: the mean
change in nats per token and its 95 % paired bootstrap interval over sequences (``cepe.eval.metrics.
paired_bootstrap``), so that a rise or fall of a few tenths of a percent on a handful of sequences can be
told from noise.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from cepe.eval.common import EvalSetup, chunk_tail_aligned, iter_source, limit_items, run_examples
from cepe.eval.methods import standard_request
from cepe.eval.metrics import paired_bootstrap
from cepe.tables import pipe_table

DEFAULT_SOURCES = [{"name": "essays", "corpus": "essays"}]


@dataclass
class Config:
    """Settings.

    Attributes:
        sources: document sources (see :func:`cepe.eval.common.iter_source`); use held-out documents.
        contexts: tokens of earlier text given to the model (0 = the window alone).
        decoder_window: tokens in the decoder, scored tokens included (fixed for every context length).
        eval_tokens: scored tokens at the end of the window.
        chunk_length: the context's pieces (aligned to the window); CEPE encodes each piece in chunks of its
            adapter's ``chunk_length`` (``methods.cepe.chunk_length`` overrides it), so a longer piece is split
            further and a shorter one is one padded chunk (REPLUG's piece length too, unless
            ``replug_piece_length``).
        sequences: sequences in all (documents in seeded order, ``per_document`` from each).
        per_document: at most this many sequences from one document, at non-overlapping offsets (one
            from each of that many equal parts of it; only as many as the document holds). Beyond 8K
            tokens held-out documents are few: a 220K-token novel gives six 33K sequences.
        max_documents: documents read per source (None = all).
        seed: picks documents and offsets.
        replug_piece_length, replug_max_pieces: as in the ``lm`` task.
        foreign_context: a control: each sequence's context is taken from another sequence of the same
            source and another document (the next such one in the sequences' order; another part of
            the one document where a source has one), its window and targets its own. What a model
            gains from it is what any text of that kind gives (its domain, its register), not what this
            text says; the gain with its own context less this is reading.
    """

    sources: list[dict[str, Any]] = field(default_factory=lambda: list(DEFAULT_SOURCES))
    contexts: list[int] = field(default_factory=lambda: [0, 512, 1024, 2048, 4096, 7680])
    decoder_window: int = 256
    eval_tokens: int = 128
    chunk_length: int = 256
    sequences: int = 8
    per_document: int = 1
    max_documents: int | None = None
    seed: int = 0
    replug_piece_length: int | None = None
    replug_max_pieces: int | None = None
    foreign_context: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.eval_tokens < self.decoder_window:
            raise ValueError(
                f"eval_tokens ({self.eval_tokens}) must be in 1..decoder_window - 1 ({self.decoder_window - 1}): "
                "the window's first token has no prediction without context"
            )
        if not self.contexts or min(self.contexts) < 0:
            raise ValueError(f"contexts must be non-negative token counts, got {self.contexts}")
        if self.per_document < 1:
            raise ValueError(f"per_document must be >= 1 (sequences per document), got {self.per_document}")


def fixed_sequences(
    docs: list[list[int]], cfg: Config, origins: list[tuple[int, int]] | None = None
) -> list[list[int]]:
    """Sequences of ``max(contexts) + decoder_window`` tokens from the long-enough documents (at most
    ``per_document`` from each, at non-overlapping offsets). With ``origins`` given, each sequence's
    ``(document index, token offset)`` is appended to it, in the same order."""
    need = max(cfg.contexts) + cfg.decoder_window
    rng = random.Random(cfg.seed)
    order = [i for i, d in enumerate(docs) if len(d) >= need]
    rng.shuffle(order)
    out: list[list[int]] = []
    if cfg.per_document == 1:
        for i in order[: cfg.sequences]:
            off = rng.randint(0, len(docs[i]) - need)
            out.append(list(docs[i][off : off + need]))
            if origins is not None:
                origins.append((i, off))
        return out
    for i in order:
        parts = min(cfg.per_document, len(docs[i]) // need)
        size = len(docs[i]) // parts  # >= need: one sequence inside each part, so none overlap
        for p in range(parts):
            if len(out) == cfg.sequences:
                return out
            off = p * size + rng.randint(0, size - need)
            out.append(list(docs[i][off : off + need]))
            if origins is not None:
                origins.append((i, off))
    return out


def foreign_donors(sequences: list[dict[str, Any]]) -> tuple[list[int], list[str]]:
    """For each sequence (its ``source`` and ``document``), the index of the next sequence in order
    (cyclically) of the same source from another document, whose context it gets under
    ``foreign_context``; in a source whose sequences all come from one document, the next sequence of it
    (another part of that document: sequences never overlap). Returns ``(donors, notes)``, a note for
    each such source. Raises ValueError for a source with a single sequence."""
    n = len(sequences)
    donors, notes = [], []
    for i, s in enumerate(sequences):
        same = [(i + k) % n for k in range(1, n) if sequences[(i + k) % n]["source"] == s["source"]]
        if not same:
            raise ValueError(
                f"foreign_context: source {s['source']!r} has a single sequence, so it can take no other "
                "sequence's context; score more sequences or turn foreign_context off"
            )
        other = [j for j in same if sequences[j]["document"] != s["document"]]
        donors.append(other[0] if other else same[0])
        if not other:
            note = (
                f"foreign_context: every sequence of source {s['source']!r} comes from one document; its "
                "contexts come from other parts of it"
            )
            if note not in notes:
                notes.append(note)
    return donors, notes


def run(setup: EvalSetup, cfg: Config) -> dict[str, Any]:
    """Perplexity of the fixed targets for every method and context length."""
    docs: list[list[int]] = []
    names: list[dict[str, Any]] = []
    for src in cfg.sources:
        for d in iter_source({"max_documents": cfg.max_documents, **src}):
            docs.append(setup.encode(d["text"]))
            names.append({"source": d.get("domain", src.get("name")), "document": d.get("id")})
    origins: list[tuple[int, int]] = []
    seqs = limit_items(fixed_sequences(docs, cfg, origins), None, setup)
    sequences = [{**names[i], "offset": off} for i, off in origins[: len(seqs)]]
    notes = []
    if not seqs:
        notes.append(f"no document has {max(cfg.contexts) + cfg.decoder_window} tokens; nothing scored")
        return {"task": "fixedppl", "rows": [], "notes": notes, "plot_x": "context"}
    rows = []
    w = cfg.decoder_window
    donors = list(range(len(seqs)))
    if cfg.foreign_context:
        donors, more = foreign_donors(sequences)
        notes += ["foreign_context: each sequence's context is another sequence's (same source)", *more]
    items = [(seq, seqs[d]) for seq, d in zip(seqs, donors)]
    for context in sorted(cfg.contexts):
        for method in setup.methods:

            def score(m, item, _c=context, _method=method):
                seq, donor = item
                before = donor[len(donor) - w - _c : len(donor) - w]
                piece = (
                    cfg.replug_piece_length
                    if _method == "replug" and cfg.replug_piece_length
                    else cfg.chunk_length
                )
                pieces = chunk_tail_aligned(before, piece) if _c else []
                if _method == "replug" and cfg.replug_max_pieces:
                    pieces = pieces[-cfg.replug_max_pieces :]
                req = standard_request(_method, pieces, seq[-w:], cfg.eval_tokens)
                lp = m.score([req])[0]
                return float(-lp.sum()), req.num_tokens

            nll, cost = run_examples(setup, method, items, score, f"fixedppl context={context}")
            rows.append(
                {
                    "method": method,
                    "setting": {"context": context, "decoder_window": w},
                    "metric": "ppl",
                    "value": math.exp(sum(nll) / (len(seqs) * cfg.eval_tokens)),
                    "n": len(seqs),
                    "nll_per_sequence": [x / cfg.eval_tokens for x in nll],
                    **cost,
                }
            )
    steps = context_steps(rows)
    return {
        "task": "fixedppl",
        "rows": rows,
        "steps": steps,
        "sequences": sequences,
        **({"context_from": donors} if cfg.foreign_context else {}),
        "notes": notes,
        "plot_x": "context",
        "extra_markdown": steps_table(steps),
    }


STEP_LEVEL = 0.95
STEP_RESAMPLES = 10_000


def context_steps(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each method's change from one context length to the next longer one, on the same sequences.

    Returns:
        One entry per method and step: ``method``, ``from`` / ``to`` (context tokens), ``ppl_from`` /
        ``ppl_to``, ``delta_nll`` (mean per-token NLL change, nats; negative = the longer context helps),
        ``low`` / ``high`` (its paired bootstrap interval at ``level``), ``level`` and ``verdict``:
        ``falls`` (the whole interval below 0), ``rises`` (above 0) or ``unresolved``.
    """
    by_method: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_method.setdefault(r["method"], []).append(r)
    out = []
    for method, rs in by_method.items():
        rs = sorted(rs, key=lambda r: r["setting"]["context"])
        for a, b in zip(rs, rs[1:]):
            mean, lo, hi = paired_bootstrap(
                a["nll_per_sequence"], b["nll_per_sequence"], resamples=STEP_RESAMPLES, level=STEP_LEVEL
            )
            verdict = "falls" if hi < 0 else "rises" if lo > 0 else "unresolved"
            out.append(
                {
                    "method": method,
                    "from": a["setting"]["context"],
                    "to": b["setting"]["context"],
                    "ppl_from": a["value"],
                    "ppl_to": b["value"],
                    "delta_nll": mean,
                    "low": lo,
                    "high": hi,
                    "level": STEP_LEVEL,
                    "verdict": verdict,
                }
            )
    return out


def steps_table(steps: list[dict[str, Any]]) -> str:
    """Markdown table of :func:`context_steps` (empty string when there are none)."""
    if not steps:
        return ""
    pct = round(100 * steps[0]["level"])
    lines = [
        f"Steps: change in NLL per token (nats) from each context length to the next, on the same sequences, "
        f"with its {pct} % paired bootstrap interval over sequences",
        "",
    ]
    lines += pipe_table(
        ["method", "context", "ppl", "Δ nats/token", f"{pct} % interval", "verdict"],
        (
            [
                s["method"],
                f"{s['from']} → {s['to']}",
                f"{s['ppl_from']:.3f} → {s['ppl_to']:.3f}",
                f"{s['delta_nll']:+.4f}",
                f"[{s['low']:+.4f}, {s['high']:+.4f}]",
                s["verdict"],
            ]
            for s in steps
        ),
    )
    return "\n".join(lines) + "\n"
