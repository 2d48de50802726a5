"""Synthetic in-context classification: demonstrations in the encoder, more of them and queries in the decoder.

The ``icl`` examples of a mixed CEPE stage (:func:`cepe.training.data.mixed_example`) teach the adapter to
*infer* a label from what it reads rather than to repeat the last label it saw. Each example is a small
classification task made from the training corpus:

- a family of classes: the corpus each snippet comes from (``origin``: novel / paper / code), or, within
  one corpus, the document a snippet comes from when the corpus names sub-collections (an Austen novel, a
  standard-library package);
- 2-5 of its classes, each named either by its own name (``emma``, ``email``, ``novel``) or by an arbitrary
  word (``falcon``), drawn anew for every example, so the mapping can be learnt only from the
  demonstrations;
- one template (``Text: {text}\\nLabel: {label}``-style, heads and keys drawn from small lists) and demonstrations
  whose texts are random snippets of the class's documents, labels cycling through the classes in a shuffled
  order so every prefix is balanced.

The first ``k ~ U(1, K)`` demonstrations go to the encoder, one per chunk (the rest of a chunk and the
other chunks are masked); the decoder holds the next ones, cut at n tokens. Only the label tokens of the
decoder's complete demonstrations are scored: the first of them has only the encoder's demonstrations to
go by (``icl_scored`` keeps only the first few, whose queries have few demonstrations in the decoder
before them, as the evaluation's has). None of the templates or label words is the ICL evaluation's (``Article: ... Topic: ...``, BBC
News topics); a test checks it.

Shape legend: K chunks, L chunk length, n decoder tokens.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

HEADS = ("Text", "Input", "Passage", "Excerpt", "Document", "Sample", "Snippet", "Content")
KEYS = ("Label", "Class", "Category", "Type", "Answer", "Source", "Group", "Kind")
SEPARATORS = ("\n\n", "\n")
LABEL_WORDS = (
    "apple river stone cloud tiger violet copper maple ocean falcon lemon harbor candle meadow pepper "
    "silver thunder willow anchor basket cactus dolphin ember feather glacier hazel island jasmine kettle "
    "lantern marble nectar orchid pebble quartz raven saddle tulip velvet walnut"
).split()
ORIGIN_NAMES = {
    "austen": "novel",
    "acl": "paper",
    "stdlib": "code",
    "linux-docs": "manual",
    "linux-code": "kernel",
    "essays": "essay",
    "bbc": "news",
}
"""Own names of the ``origin`` family's classes, by corpus domain (other domains use their domain)."""

ARBITRARY = 0.5
"""The default probability that an example names its classes by arbitrary words instead of their own names
(``TrainConfig.icl_arbitrary``)."""

MIN_CLASS_TOKENS = 1000
"""A class needs at least this many tokens of documents (enough distinct snippets)."""


@dataclass(frozen=True)
class Family:
    """Classes of one kind of classification: class name -> its documents (token arrays)."""

    name: str
    classes: dict[str, list[np.ndarray]]


def _sub_class(doc_id: str) -> str | None:
    """The sub-collection a document belongs to: the second component of a three-part id
    (``stdlib/email/parser.py`` -> ``email``), or a two-part id's name for novels (``austen/emma``)."""
    parts = doc_id.split("/")
    if parts[0] == "austen" and len(parts) == 2:
        return parts[1]
    if len(parts) >= 3:
        return parts[1]
    return None


def families_from_documents(docs: list[tuple[str, str, np.ndarray]]) -> list[Family]:
    """Classification families of ``(id, domain, tokens)`` documents: ``origin`` (by domain), and per
    domain with at least two sub-collections a family of those. Classes with fewer than
    :data:`MIN_CLASS_TOKENS` tokens are dropped; families keep at least two classes."""
    origin: dict[str, list[np.ndarray]] = {}
    subs: dict[str, dict[str, list[np.ndarray]]] = {}
    for doc_id, domain, tokens in docs:
        origin.setdefault(domain, []).append(tokens)
        sub = _sub_class(doc_id)
        if sub is not None:
            subs.setdefault(domain, {}).setdefault(sub, []).append(tokens)

    def keep(classes: dict[str, list[np.ndarray]]) -> dict[str, list[np.ndarray]]:
        return {c: v for c, v in sorted(classes.items()) if sum(len(t) for t in v) >= MIN_CLASS_TOKENS}

    out = []
    fams = [("origin", origin)] + [(f"{d}-sub", s) for d, s in sorted(subs.items())]
    for name, classes in fams:
        kept = keep(classes)
        if len(kept) >= 2:
            out.append(Family(name, kept))
    return out


@functools.lru_cache(maxsize=2)
def corpus_families(path: str, split: str) -> tuple[Family, ...]:
    """:func:`families_from_documents` of a tokenized corpus's split (cached per process)."""
    from cepe.data.tokenized import TokenizedCorpus

    corpus = TokenizedCorpus(path)
    fams = families_from_documents(list(corpus.iter_documents(split)))
    if not fams:
        raise ValueError(
            f"icl examples need documents of at least two classes in {path} ({split}): two corpora, or a "
            f"corpus with sub-collections, each with >= {MIN_CLASS_TOKENS} tokens"
        )
    return tuple(fams)


@functools.lru_cache(maxsize=2)
def synthetic_families(vocab_size: int, seed: int) -> tuple[Family, ...]:
    """Families for synthetic data: each class draws its tokens from its own 24-token subset of the
    vocabulary (a bag-of-tokens "topic"), in two families of 3 and 5 classes."""
    g = np.random.default_rng([int(seed), 41])
    lo = 32 if vocab_size >= 256 else 0  # byte vocabularies: keep clear of control bytes
    fams = []
    for f, count in enumerate((3, 5)):
        classes = {}
        for c in range(count):
            subset = g.choice(np.arange(lo, vocab_size), size=24, replace=False)
            classes[f"c{f}{c}"] = [g.choice(subset, size=512) for _ in range(2)]
        fams.append(Family(f"synthetic{f}", classes))
    return tuple(fams)


def _balanced_order(count: int, classes: int, r: random.Random) -> list[int]:
    """``count`` class indices cycling through all classes, each round in a new shuffled order."""
    out: list[int] = []
    while len(out) < count:
        order = list(range(classes))
        r.shuffle(order)
        out.extend(order)
    return out[:count]


def icl_example(
    families: tuple[Family, ...],
    n_chunks: int,
    chunk_length: int,
    n_decoder: int,
    r: random.Random,
    tok: Any,
    pad_id: int = 0,
    scored: int = 0,
    arbitrary: float = ARBITRARY,
    info: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One in-context classification example (see the module docstring).

    Args:
        families: from :func:`corpus_families` or :func:`synthetic_families`.
        n_chunks, chunk_length, n_decoder: K, L and n of the example's layout.
        r: the example's seeded random source.
        tok: a tokenizer with ``encode(text, add_special_tokens=False)``.
        pad_id: filler of the masked encoder positions.
        scored: score only the first this many complete demonstrations of the decoder (0 = all).
        arbitrary: the probability of naming the classes by arbitrary words (one draw either way).
        info: if given, filled with ``family`` (its name), ``label_ids`` (each class's label tokens), ``encoder_classes`` (the
            class of each encoder demonstration) and ``scored_classes`` (of each scored decoder label).

    Returns:
        ``(encoder_input_ids (K, L), encoder_attention_mask (K, L) bool, input_ids (n,), labels (n,),
        align_targets (n,))``; labels are -100 except at the label tokens of the decoder's complete
        demonstrations. ``align_targets[t]`` is, for a decoder position t whose next token is a scored label
        token, the flat encoder position (chunk · L + offset) of the same token in the latest encoder
        demonstration of the same class; -1 elsewhere and where the encoder holds none of that class.
    """
    fam = families[r.randrange(len(families))]
    names = sorted(fam.classes)
    chosen = r.sample(names, r.randint(2, min(5, len(names))))
    if r.random() < arbitrary:
        shown = r.sample(LABEL_WORDS, len(chosen))
    else:
        shown = [ORIGIN_NAMES.get(c, c) if fam.name == "origin" else c for c in chosen]
    head, key, sep = r.choice(HEADS), r.choice(KEYS), r.choice(SEPARATORS)

    def enc(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    head_ids, tail_ids, sep_ids = enc(f"{head}: "), enc(f"\n{key}:"), enc(sep)
    label_ids = [enc(" " + s) for s in shown]
    overhead = len(head_ids) + len(tail_ids) + max(len(x) for x in label_ids) + len(sep_ids)
    room = chunk_length - overhead
    if room < 8:
        raise ValueError(f"icl examples need chunk_length >= {overhead + 8} (a demonstration per chunk)")

    def demo(c: int) -> tuple[list[int], int, int]:
        """A demonstration of class ``c``: its tokens and the span of its label tokens."""
        docs = fam.classes[chosen[c]]
        doc = docs[r.randrange(len(docs))]
        size = min(len(doc), r.randint(min(16, room), room))
        start = r.randrange(len(doc) - size + 1)
        text = [int(t) for t in doc[start : start + size]]
        body = head_ids + text + tail_ids
        return body + label_ids[c] + sep_ids, len(body), len(body) + len(label_ids[c])

    k = r.randint(1, n_chunks)
    min_demo = len(head_ids) + len(tail_ids) + len(sep_ids) + 2  # every demonstration is at least this long
    order = _balanced_order(k + n_decoder // min_demo + 2, len(chosen), r)
    enc_ids = torch.full((n_chunks, chunk_length), pad_id, dtype=torch.long)
    mask = torch.zeros((n_chunks, chunk_length), dtype=torch.bool)
    latest: dict[int, int] = {}  # class -> flat encoder position of its latest demonstration's label
    for j in range(k):
        ids, a, _ = demo(order[j])
        enc_ids[j, : len(ids)] = torch.tensor(ids)
        mask[j, : len(ids)] = True
        latest[order[j]] = j * chunk_length + a
    dec: list[int] = []
    spans: list[tuple[int, int, int]] = []
    for c in order[k:]:
        ids, a, b = demo(c)
        if len(dec) + b <= n_decoder:
            spans.append((len(dec) + a, len(dec) + b, c))
        dec.extend(ids)
        if len(dec) >= n_decoder:
            break
    input_ids = torch.tensor(dec[:n_decoder], dtype=torch.long)
    labels = torch.full((n_decoder,), -100, dtype=torch.long)
    align = torch.full((n_decoder,), -1, dtype=torch.long)
    if info is not None:
        info.update(
            family=fam.name,
            label_ids=label_ids,
            encoder_classes=order[:k],
            scored_classes=[c for _, _, c in spans[: scored or None]],
        )
    for a, b, c in spans[: scored or None]:
        labels[a:b] = input_ids[a:b]
        if c in latest:  # position t predicts token t+1: read it where that class's label stands
            align[a - 1 : b - 1] = torch.arange(latest[c], latest[c] + b - a)
    return enc_ids, mask, input_ids, labels, align
