"""Output mixture (``CepeConfig.output_mix``): CEPE's next-token distribution mixed, token by token, with
the decoder's own distribution without the context.

    p(y) = λ·p_cepe(y) + (1 − λ)·p_decoder(y),    λ = σ(a),    a = w·[h_cepe; h_decoder] + b

``h_cepe`` and ``h_decoder`` are the final (normalised) hidden states of the same decoder tokens with and
without cross-attention. A mixture can never score a token below ``log(1 − λ) + log p_decoder``, so a
head that learns where reading helps (λ near 1 on a copied span, near 0 elsewhere) keeps what the reader
copies without paying its cost on ordinary text.

Mixed logits are returned as ``logits_decoder + f(δ)`` with ``δ = log p_cepe − log p_decoder``: their
softmax is the mixture, and where the two distributions agree (no context read, a zero ``o_proj``) they
are the decoder's logits exactly.

Shape legend: B batch, T decoder tokens, N positions, D decoder width, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

LENGTH_UNIT = 1024  # context tokens: the length input is log(1 + n / LENGTH_UNIT)


def length_feature(n: torch.Tensor) -> torch.Tensor:
    """The mixing head's length input ``(...)`` in fp32 (``CepeConfig.mix_length``): ``log(1 + n / 1024)``
    for ``n`` ``(...)`` real context tokens (0 with no context, 0.41 at 512, 2.20 at 8K, 3.50 at 32K)."""
    return torch.log1p(n.float() / LENGTH_UNIT)


def head_inputs(
    hidden_size: int,
    match: int = 0,
    hidden: bool = True,
    length: bool = False,
    agree: bool = False,
    prob: bool = False,
    near: bool = False,
    sure: bool = False,
    top: bool = False,
    read: bool = False,
    count: bool = False,
) -> list[str]:
    """Names of the mixing head's inputs in order: ``h0..`` the 2·D hidden states (with ``hidden``),
    ``m1..mK`` the suffix-match indicators, ``n`` the context's length (``length``), ``a1..aK`` the
    successor agreements (``agree``), and for the copy head ``p`` the mixture's probability of the copy's
    tokens (``prob``: :func:`copy_agreement_feature`) and ``r`` how far back the copied suffix last
    occurs (``near``: :func:`copy_recency_feature`) and ``u`` how sure the reader is of its next token
    (``sure``: :func:`reader_sure_feature`) and ``t`` the largest share one token has of the copy's votes
    (``top``: :meth:`CopySpans.top_share`) and ``q`` how probable the reader finds what the copy proposes
    (``read``: :func:`copy_agreement_feature` of the reader's expectation) and ``c`` how many times the
    matched suffix occurs (``count``: :meth:`CopySpans.count_feature`)."""
    names = [f"h{i}" for i in range(2 * hidden_size)] if hidden else []
    names += [f"m{k}" for k in range(1, match + 1)]
    names += ["n"] if length else []
    names += [f"a{k}" for k in range(1, match + 1)] if agree else []
    own = zip("prutqc", (prob, near, sure, top, read, count))
    return names + [name for name, wanted in own if wanted]


class MixHead(nn.Linear):
    """``Linear(F, 1)`` whose product is taken in fp64 and rounded once to the input's dtype: how a
    vectorised fp32 product groups its sum depends on the number of inputs (and the CPU), so an input added
    with zero weight (:func:`widen_head`) could move an fp32 result in its last bits; in fp64 such a
    difference stays far below one fp32 rounding step, and the head's function is the same with and
    without the input. The parameters are an ``nn.Linear``'s (fp32; the same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias.double()
        return F.linear(x.double(), self.weight.double(), b).to(x.dtype)


def mix_head(inputs: list[str], like: torch.Tensor) -> nn.Linear:
    """A mixing (or copy) head ``Linear(F, 1)`` over the ``F`` inputs named by :func:`head_inputs`
    (``2·D`` hidden states when ``hidden``, ``match`` = K suffix-match indicators, one more for the
    context's length with ``length``, K successor agreements with ``agree``, one more each for the copy
    head with ``prob`` and ``near``), all zero (λ = ½ everywhere until it trains), on ``like``'s device, in
    fp32."""
    head = MixHead(len(inputs), 1, bias=True, device=like.device, dtype=torch.float32)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
    return head


def widen_head(old: nn.Linear, old_inputs: list[str], new_inputs: list[str]) -> nn.Linear:
    """A head over ``new_inputs`` that computes what ``old`` (over ``old_inputs``, each of them among the
    new) computes: the old weights under their inputs' names, zero on the inputs added."""
    missing = sorted(set(old_inputs) - set(new_inputs))
    if missing or len(old_inputs) != old.in_features:
        raise ValueError(f"the new head must keep every input of the old one; it lacks {missing}")
    new = MixHead(len(new_inputs), 1, bias=True, device=old.weight.device, dtype=old.weight.dtype)
    where = {name: i for i, name in enumerate(new_inputs)}
    cols = torch.tensor([where[name] for name in old_inputs], device=old.weight.device, dtype=torch.long)
    with torch.no_grad():
        new.weight.zero_()
        new.weight[:, cols] = old.weight
        new.bias.copy_(old.bias)
    return new.requires_grad_(old.weight.requires_grad)


def mix_logit(
    head: nn.Linear,
    h_ctx: torch.Tensor,
    h_dec: torch.Tensor,
    match: torch.Tensor | None = None,
    hidden: bool = True,
) -> torch.Tensor:
    """``a`` ``(...)`` in fp32 (λ = σ(a)) from the final hidden states ``(..., D)`` with and without the
    context, and the suffix-match inputs ``(..., K)`` (then the length input and the K agreements where
    the head takes them: :func:`head_inputs`) (``hidden`` False: those inputs alone).

    The heads are :class:`MixHead` (their product in fp64)."""
    parts = [h_ctx, h_dec] if hidden else []
    if match is not None:
        parts.append(match.to(h_ctx.dtype))
    x = torch.cat(parts, dim=-1).to(head.weight.dtype)
    with torch.autocast(x.device.type, enabled=False):
        return head(x).squeeze(-1).float()


def mix_logits(logits_ctx: torch.Tensor, logits_dec: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Logits ``(..., V)`` (fp32) whose softmax is ``σ(a)·softmax(logits_ctx) + σ(−a)·softmax(logits_dec)``.

    ``logits_dec + f(δ)`` with ``δ = log_softmax(logits_ctx) − log_softmax(logits_dec)`` and
    ``f(δ) = log(λ·e^δ + 1 − λ)``, computed as ``log1p(λ·expm1(δ))`` for ``δ ≤ 0`` and
    ``δ + log1p((1 − λ)·expm1(−δ))`` for ``δ > 0`` (no overflow; ``f(0) = 0`` exactly, so equal inputs
    give ``logits_dec`` bit for bit), and as ``logaddexp(log λ + δ, log(1 − λ))`` where the ``log1p``
    argument is below −½ (there one side of the mixture is far below the other).

    Args:
        logits_ctx: ``(..., V)`` logits with the context; logits_dec: ``(..., V)`` without.
        a: ``(...)`` the mixing logit.
    """
    lc, ld = logits_ctx.float(), logits_dec.float()
    delta = lc.log_softmax(-1) - ld.log_softmax(-1)  # (..., V)
    a = a.float()[..., None]
    pos = delta > 0
    arg = torch.where(  # in [-1, 0]: the log1p argument of the branch that applies
        pos,
        torch.sigmoid(-a) * torch.expm1(-delta.clamp_min(0)),
        torch.sigmoid(a) * torch.expm1(delta.clamp_max(0)),
    )
    exact = torch.log1p(arg) + torch.where(pos, delta, torch.zeros_like(delta))
    # near arg = -1 the log1p form loses the small side (λ or 1 - λ rounded to 1): log-space there
    stable = torch.logaddexp(F.logsigmoid(a) + delta, F.logsigmoid(-a))
    return ld + torch.where(arg > -0.5, exact, stable)


def mix_logits_ref(logits_ctx: torch.Tensor, logits_dec: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`mix_logits`: the mixture's log-probabilities, from probabilities in fp64."""
    lam, rest = torch.sigmoid(a.double())[..., None], torch.sigmoid(-a.double())[..., None]
    return torch.log(
        lam * torch.softmax(logits_ctx.double(), -1) + rest * torch.softmax(logits_dec.double(), -1)
    )


def mix_nll(logp_ctx: torch.Tensor, logp_dec: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Per-position negative log-likelihood ``(N,)`` of the mixture from the target's log-probabilities
    under each side ``(N,)`` and the mixing logit ``(N,)`` (all the mixture needs at a known target)."""
    return -torch.logaddexp(F.logsigmoid(a) + logp_ctx.float(), F.logsigmoid(-a) + logp_dec.float())


# ---------------------------------------------------------------------------------------- suffix matches
# Whether the decoder's last k tokens occur in the context's text with a token after them (what a copy of
# the context would continue): an exact fact about the token ids that the final hidden states carry only
# faintly (docs/TRAINING.md, "The reader trained with its head"). Shape legend here: B batch, T decoder
# tokens, S context tokens, K match orders, M the context's (gram, successor) pairs.

Grams = list[list[tuple[torch.Tensor, torch.Tensor]]]  # per example, per order: (hashes, successor counts)
_HASH_BASE = 1_000_003  # k-gram hash: sum of (id + 1)·base^(k-1-m) modulo 2^63
_HASH_MASK = (1 << 63) - 1
HASH_MODES = ("exact", "wrap")
"""``CepeConfig.mix_hash``: ``"exact"`` keeps every gram's hash non-negative (modulo 2^63), so that -1
marks only a gram with a missing token; ``"wrap"`` is the hash of adapters saved before that fix: computed
modulo 2^64 in int64, about half the grams of 4+ tokens of a large vocabulary hash negative, and the
decoder's such suffixes then match nothing (their heads were fitted that way)."""


def _gram_hashes(ids: torch.Tensor, k: int, wrap: bool = False) -> torch.Tensor:
    """Hashes ``(..., N - k + 1)`` of the k-grams of ``ids`` ``(..., N)`` (ids ≥ 0; a gram with a negative
    id, a missing token, hashes to -1; every other gram to a number ≥ 0, unless ``wrap``: see
    :data:`HASH_MODES`)."""
    n = max(ids.shape[-1] - k + 1, 0)  # no gram when there are fewer than k ids (a slice must not wrap)
    h = torch.zeros((*ids.shape[:-1], n), dtype=torch.long, device=ids.device)
    bad = torch.zeros_like(h, dtype=torch.bool)
    for m in range(k):
        part = ids[..., m : m + n]
        h = h * _HASH_BASE + (part + 1)  # int64 arithmetic wraps modulo 2^64
        bad |= part < 0
    if not wrap:
        h = h & _HASH_MASK  # modulo 2^63: non-negative
    return h.masked_fill(bad, -1)


@dataclass
class Successors:
    """Per example and suffix length, the context's k-grams that a token follows and those tokens, sorted
    by (hash, token) (:func:`context_successors`).

    Attributes:
        keys: per example, per k = 1..K, the sorted hashes ``(G,)`` (a gram once per occurrence).
        start: per example, per k, where that list's successors begin in :attr:`succ`.
        succ: ``(M,)`` the successor tokens of every list, one after another.
        back: ``(M,)`` for each entry, how many tokens before the context's end its gram's most recent
            successor stands (1: the context's last token), the same for every occurrence of a gram;
            None when not asked for (``recency``).
        weight: ``(M,)`` fp32, each entry's vote in the copy (:func:`vote_weights` of how far before the
            context's end its own successor stands); None: every vote the same (``decay`` 0).
    """

    keys: list[list[torch.Tensor]]
    start: list[list[int]]
    succ: torch.Tensor
    back: torch.Tensor | None = None
    weight: torch.Tensor | None = None

    def rows(self, n: int) -> Successors:
        """The table of the first ``n`` examples."""
        return Successors(self.keys[:n], self.start[:n], self.succ, self.back, self.weight)


DECAY_UNIT = 64  # context tokens: a vote d tokens back weighs (1 + d / DECAY_UNIT) ** -decay


def vote_weights(d: torch.Tensor, decay: float) -> torch.Tensor:
    """The copy's vote ``(...)`` fp32 of a successor ``d`` ``(...)`` tokens before the context's end
    (``CepeConfig.mix_copy_decay``): ``(1 + d / 64) ** -decay`` (1 at the end, 1/2 at 64 tokens with decay
    1, and 1/(1 + d/64) further back), so that, as a context grows, what was just read keeps its say."""
    return (1.0 + d.double() / DECAY_UNIT).pow(-float(decay)).float()


def context_token_ids(ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The context's token ids as the suffix match reads them, ``(B, S)`` from chunks ``(B, K, L)`` (or
    ``(B, S)``): one text per example, padding (``mask`` False) as -1, which matches nothing."""
    flat = ids.reshape(ids.shape[0], -1)
    return flat if mask is None else flat.masked_fill(~mask.reshape(flat.shape).bool(), -1)


def context_successors(
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    order: int,
    recency: bool = False,
    decay: float = 0.0,
    wrap: bool = False,
) -> Successors:
    """:class:`Successors` of the context ``ids`` ``(B, K, L)`` (or ``(B, S)``, read in order as one text;
    ``mask`` True on real tokens, None: all real) for suffix lengths 1..``order``; with ``recency`` also
    :attr:`Successors.back` (for ``CepeConfig.mix_copy_near``; about a third more time), with ``decay`` > 0
    each vote's :attr:`Successors.weight` (``CepeConfig.mix_copy_decay``); ``wrap``: the hashes of
    :data:`HASH_MODES`' ``"wrap"``."""
    if not math.isfinite(decay) or decay < 0:
        raise ValueError(
            f"the copy's vote decay is a finite number ≥ 0 (0: every vote the same), got {decay}"
        )
    flat = ids.reshape(ids.shape[0], -1)
    keep = None if mask is None else mask.reshape(mask.shape[0], -1).bool()
    keys, start, parts, backs, weights, at = [], [], [], [], [], 0
    for b in range(flat.shape[0]):
        row = flat[b] if keep is None else flat[b][keep[b]]
        per_k, begin = [], []
        for k in range(1, order + 1):
            h = _gram_hashes(row[:-1], k, wrap)  # (S - k,): the gram at i, followed by row[i + k]
            nxt = row[k:]
            by = torch.argsort(nxt, stable=True)  # by token, then (stably) by hash: (hash, token) order
            by = by[torch.argsort(h[by], stable=True)]
            keys_k = h[by]
            per_k.append(keys_k)
            begin.append(at)
            parts.append(nxt[by])
            if recency:
                backs.append(_most_recent(keys_k, row.numel() - k - by))
            if decay > 0:
                weights.append(vote_weights(row.numel() - k - by, decay))
            at += h.numel()
        keys.append(per_k)
        start.append(begin)
    succ = torch.cat(parts) if parts else flat.new_zeros(0)
    back = (torch.cat(backs) if backs else flat.new_zeros(0)) if recency else None
    weight = None
    if decay > 0:
        weight = torch.cat(weights) if weights else torch.zeros(0, device=flat.device)
    return Successors(keys, start, succ, back, weight)


def _most_recent(keys: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
    """For sorted gram hashes ``keys`` ``(G,)`` and each occurrence's distance from the context's end
    ``back`` ``(G,)``, the smallest distance among the occurrences of the same gram, per occurrence."""
    if keys.numel() == 0:
        return back
    new_gram = torch.ones_like(keys, dtype=torch.bool)
    new_gram[1:] = keys[1:] != keys[:-1]
    gram = new_gram.cumsum(0) - 1
    least = torch.full((int(gram[-1]) + 1,), int(back.max()), dtype=back.dtype, device=back.device)
    least.scatter_reduce_(0, gram, back, reduce="amin")
    return least[gram]


def grams_of(table: Successors) -> Grams:
    """The :data:`Grams` of a successor table: per example and k, its distinct k-gram hashes ``(G,)``
    (sorted) and the number of distinct tokens that follow each ``(G,)``, read off the table's (hash,
    token) order in one pass (a gram starts where the hash changes, a distinct pair where either does)."""
    out = []
    for b, per_k in enumerate(table.keys):
        row = []
        for k, keys in enumerate(per_k):
            if keys.numel() == 0:
                row.append((keys, keys.clone()))
                continue
            at = table.start[b][k]
            succ = table.succ[at : at + keys.numel()]
            new_gram = torch.ones_like(keys, dtype=torch.bool)
            new_gram[1:] = keys[1:] != keys[:-1]
            new_pair = new_gram.clone()
            new_pair[1:] |= succ[1:] != succ[:-1]
            gram = new_gram.cumsum(0) - 1  # (G_occurrences,) each occurrence's gram index
            n_next = torch.zeros(int(gram[-1]) + 1, dtype=torch.long, device=keys.device)
            row.append((keys[new_gram], n_next.index_add_(0, gram, new_pair.long())))
        out.append(row)
    return out


def context_grams(ids: torch.Tensor, mask: torch.Tensor | None, order: int) -> Grams:
    """Per example, per k = 1..``order``: the sorted hashes ``(G,)`` of the context's k-grams that a token
    follows, and for each the number of distinct tokens that follow it ``(G,)`` (:func:`grams_of` the
    context's :func:`context_successors`).

    Args:
        ids: context chunks ``(B, K, L)`` (or ``(B, S)``), read in order as one text.
        mask: the same shape, True on real tokens (None: all real).
    """
    return grams_of(context_successors(ids, mask, order))


def suffix_hashes(
    dec_ids: torch.Tensor, order: int, tail: torch.Tensor | None = None, wrap: bool = False
) -> list[torch.Tensor]:
    """Per k = 1..``order``, the hashes ``(B, T)`` of the decoder's k tokens ending at each position of
    ``dec_ids`` ``(B, T)`` (the earliest from ``tail`` ``(B, order - 1)`` where ``t < k - 1``; -1 there
    when ``tail`` is None or unknown: such a suffix matches nothing); ``wrap``: see :data:`HASH_MODES`."""
    b = dec_ids.shape[0]
    if tail is None:
        tail = dec_ids.new_full((b, max(order - 1, 0)), -1)
    ext = torch.cat([tail, dec_ids], dim=1)  # (B, K - 1 + T)
    return [_gram_hashes(ext[:, order - k :], k, wrap) for k in range(1, order + 1)]


def suffix_agreement(
    dec_ids: torch.Tensor,
    grams: Grams,
    tail: torch.Tensor | None = None,
    hashes: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``(B, T, K)`` in fp32: entry ``(b, t, k-1)`` is ``1 / d`` when the decoder's tokens ending at ``t``
    (``k`` of them, the earliest from ``tail`` where ``t < k - 1``) occur in example b's context with a
    token after them, ``d`` the number of distinct tokens that follow them there (1: every occurrence
    continues the same way, as a copied passage does), and 0 where they do not occur.

    Args:
        dec_ids: ``(B, T)`` decoder tokens (a negative id: unknown, e.g. padding, matches nothing).
        grams: :func:`context_grams` of the context, ``K`` orders per example.
        tail: ``(B, K - 1)`` the tokens before ``dec_ids`` (an incremental call; -1 where unknown), or None
            (the sequence starts at ``dec_ids``).
        hashes: :func:`suffix_hashes` of ``dec_ids`` and ``tail`` when the caller has them already.
    """
    b, t = dec_ids.shape
    order = len(grams[0]) if grams else 0
    if hashes is None:
        hashes = suffix_hashes(dec_ids, order, tail)
    out = torch.zeros((b, t, order), dtype=torch.float32, device=dec_ids.device)
    for k in range(1, order + 1):
        h = hashes[k - 1]  # (B, T): the k-gram ending at each decoder token
        for row in range(b):
            keys, n_next = grams[row][k - 1]
            if keys.numel() == 0:
                continue
            at = torch.searchsorted(keys, h[row]).clamp_max(keys.numel() - 1)  # (T,)
            hit = (keys[at] == h[row]) & (h[row] >= 0)
            out[row, :, k - 1] = torch.where(hit, 1.0 / n_next[at].float(), 0.0)
    return out


def suffix_match_features(
    dec_ids: torch.Tensor, grams: Grams, tail: torch.Tensor | None = None
) -> torch.Tensor:
    """``(B, T, K)`` 0/1 in fp32: entry ``(b, t, k-1)`` is 1 when the decoder's tokens ending at ``t`` (``k``
    of them, the earliest from ``tail`` where ``t < k - 1``) occur in example b's context with a token after
    them (:func:`context_grams`); arguments as :func:`suffix_agreement`."""
    return (suffix_agreement(dec_ids, grams, tail) > 0).float()


def suffix_matches_ref(ids: list[int], ctx: list[int], order: int) -> torch.Tensor:
    """Reference for :func:`suffix_match_features` on one example: ``(len(ids), order)``, by comparing
    tuples."""
    found = [{tuple(ctx[i : i + k]) for i in range(len(ctx) - k)} for k in range(1, order + 1)]
    out = torch.zeros(len(ids), order)
    for j in range(len(ids)):
        for k in range(1, min(order, j + 1) + 1):
            if tuple(ids[j - k + 1 : j + 1]) not in found[k - 1]:
                break
            out[j, k - 1] = 1.0
    return out


def suffix_agreement_ref(ids: list[int], ctx: list[int], order: int) -> torch.Tensor:
    """Reference for :func:`suffix_agreement` on one example: ``(len(ids), order)``, from each k-gram's set
    of successors in ``ctx``."""
    after: list[dict[tuple[int, ...], set[int]]] = [{} for _ in range(order)]
    for k in range(1, order + 1):
        for i in range(len(ctx) - k):
            after[k - 1].setdefault(tuple(ctx[i : i + k]), set()).add(ctx[i + k])
    out = torch.zeros(len(ids), order)
    for j in range(len(ids)):
        for k in range(1, min(order, j + 1) + 1):
            nxt = after[k - 1].get(tuple(ids[j - k + 1 : j + 1]))
            if nxt is not None:
                out[j, k - 1] = 1.0 / len(nxt)
    return out


# ------------------------------------------------------------------------------------------- the copy
# A third component of the output mixture (``CepeConfig.mix_copy``): where the decoder's last tokens occur
# in the context, the tokens that follow them there, as a distribution (the longest suffix that occurs,
# up to K tokens; each occurrence one vote). The final distribution is
#     p(y) = μ·p_copy(y) + (1 − μ)·p_mix(y),    μ = σ(c),
# with ``c`` from a second head over the mixing head's inputs, and μ = 0 where no suffix occurs (there the
# logits are the mixture's, bit for bit). Shape legend as above.

COPY_BIAS = -4.0  # the copy head's starting bias: μ = σ(-4) ≈ 0.018 wherever a suffix occurs


@dataclass
class CopySpans:
    """Where each decoder position's copy distribution lies: the successors ``succ[lo:hi]`` of its longest
    suffix that occurs in the context (each occurrence one vote, of weight ``weight[i]`` when given),
    ``lo == hi`` where none occurs.

    Attributes:
        succ: ``(M,)`` :attr:`Successors.succ`.
        lo, hi: ``(...)`` long, one entry per decoder position.
        back: ``(M,)`` :attr:`Successors.back` or None.
        weight: ``(M,)`` :attr:`Successors.weight` or None (every vote the same).
    """

    succ: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    back: torch.Tensor | None = None
    weight: torch.Tensor | None = None

    @property
    def has(self) -> torch.Tensor:
        """``(...)`` bool: a suffix occurs (the copy takes part)."""
        return self.hi > self.lo

    def __getitem__(self, index: Any) -> CopySpans:
        return CopySpans(self.succ, self.lo[index], self.hi[index], self.back, self.weight)

    def nearest(self) -> torch.Tensor:
        """``(...)`` long: how many tokens before the context's end the most recent successor of each
        position's matched suffix stands (:attr:`Successors.back`; 0 where no suffix occurs)."""
        if self.back is None:
            raise ValueError(
                "these copy spans carry no distances: build their table with context_successors(..., recency=True)"
            )
        if self.back.numel() == 0:
            return torch.zeros_like(self.lo)
        near = self.back[self.lo.clamp_max(self.back.numel() - 1)]
        return torch.where(self.has, near, torch.zeros_like(near))

    def _votes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each vote's position (flat index into ``lo.reshape(-1)``), token and weight ``(E,)`` each (the
        weight fp32, 1 without :attr:`weight`), and each position's total weight ``(P,)`` fp32 (its number
        of votes without :attr:`weight`; at least 1): a vote's share is its weight over its position's
        total, summed before the one division, so an unweighted copy counts exactly."""
        lo, n = self.lo.reshape(-1), (self.hi - self.lo).reshape(-1)
        row = torch.repeat_interleave(torch.arange(lo.numel(), device=lo.device), n)  # (E,)
        first = torch.cumsum(n, 0) - n  # (P,) each position's first vote in the flat list
        entry = lo[row] + torch.arange(row.numel(), device=lo.device) - first[row]  # (E,) index into succ
        if self.weight is None:
            return row, self.succ[entry], torch.ones(row.shape, device=lo.device), n.clamp_min(1).float()
        w = self.weight.to(lo.device)[entry]
        total = torch.zeros(lo.numel(), dtype=torch.float32, device=lo.device).index_add_(0, row, w)
        return row, self.succ[entry], w, torch.where(n > 0, total, torch.ones_like(total))

    def target_probs(self, y: torch.Tensor) -> torch.Tensor:
        """``p_copy(y)`` ``(...)`` in fp32 for one token per position (0 where no suffix occurs)."""
        row, tok, w, total = self._votes()
        out = torch.zeros(self.lo.numel(), dtype=torch.float32, device=y.device)
        out.index_add_(0, row, w * (tok == y.reshape(-1)[row]).float())
        return (out / total).reshape(self.lo.shape)

    def expected(self, logp: torch.Tensor) -> torch.Tensor:
        """``Σ_y p_copy(y)·p(y)`` ``(...)`` in fp32 for log-probabilities ``logp`` ``(..., V)`` of another
        distribution over the same positions (each vote's probability under it, weighed by its share of the
        votes; 0 where no suffix occurs)."""
        row, tok, w, total = self._votes()
        flat = logp.reshape(-1, logp.shape[-1])
        out = torch.zeros(self.lo.numel(), dtype=torch.float32, device=logp.device)
        out.index_add_(0, row, w * flat[row, tok].float().exp())
        return (out / total).reshape(self.lo.shape)

    def count_feature(self) -> torch.Tensor:
        """``log(1 + n) / 4`` ``(...)`` in fp32 for ``n`` the votes (occurrences of the matched suffix) of
        each position (``CepeConfig.mix_copy_count``; 0 where no suffix occurs): a successor seen after ten
        occurrences is surer than one seen after one, though both agree fully."""
        return torch.log1p((self.hi - self.lo).float()) / 4

    def top_share(self) -> torch.Tensor:
        """``max_y p_copy(y)`` ``(...)`` in fp32: the largest share one token has of each position's votes
        (``CepeConfig.mix_copy_top``; 0 where no suffix occurs). Unlike the agreement ``1 / d`` it stays
        near 1 when a few stray successors join one that dominates. A position's votes are its suffix's
        successors in token order (:class:`Successors`), so each token's votes are one run."""
        row, tok, w, total = self._votes()
        out = torch.zeros(self.lo.numel(), dtype=torch.float32, device=self.lo.device)
        if row.numel() == 0:
            return out.reshape(self.lo.shape)
        new = torch.ones_like(row, dtype=torch.bool)
        new[1:] = (row[1:] != row[:-1]) | (tok[1:] != tok[:-1])
        run = new.cumsum(0) - 1  # (E,) each vote's run of one token at one position
        per_run = torch.zeros(int(run[-1]) + 1, dtype=torch.float32, device=row.device).index_add_(0, run, w)
        out.scatter_reduce_(0, row[new], per_run, reduce="amax")
        return (out / total).reshape(self.lo.shape)

    def probs(self, vocab: int) -> torch.Tensor:
        """The copy distributions ``(..., V)`` in fp32 (all zero where no suffix occurs)."""
        row, tok, w, total = self._votes()
        out = torch.zeros(self.lo.numel(), vocab, dtype=torch.float32, device=self.succ.device)
        out.index_put_((row, tok), w, accumulate=True)
        return (out / total[:, None]).reshape(*self.lo.shape, vocab)


def copy_spans(
    dec_ids: torch.Tensor,
    table: Successors,
    tail: torch.Tensor | None = None,
    hashes: list[torch.Tensor] | None = None,
) -> CopySpans:
    """:class:`CopySpans` ``(B, T)`` of the decoder tokens ``dec_ids`` ``(B, T)`` over each example's
    :func:`context_successors`: the longest k ≤ K whose last k tokens (the earliest from ``tail``
    ``(B, K - 1)`` where ``t < k - 1``; -1 unknown, matching nothing) occur in the context (``hashes``:
    their :func:`suffix_hashes` when the caller has them already)."""
    b, t = dec_ids.shape
    order = len(table.keys[0]) if table.keys else 0
    if hashes is None:
        hashes = suffix_hashes(dec_ids, order, tail)
    lo = torch.zeros((b, t), dtype=torch.long, device=dec_ids.device)
    hi = torch.zeros_like(lo)
    for k in range(1, order + 1):  # longer suffixes overwrite shorter ones where they occur
        h = hashes[k - 1]  # (B, T)
        for row in range(b):
            keys = table.keys[row][k - 1]
            if keys.numel() == 0:
                continue
            left = torch.searchsorted(keys, h[row])
            right = torch.searchsorted(keys, h[row], right=True)
            hit = (right > left) & (h[row] >= 0)
            base = table.start[row][k - 1]
            lo[row] = torch.where(hit, left + base, lo[row])
            hi[row] = torch.where(hit, right + base, hi[row])
    back = None if table.back is None else table.back.to(dec_ids.device)
    weight = None if table.weight is None else table.weight.to(dec_ids.device)
    return CopySpans(table.succ.to(dec_ids.device), lo, hi, back, weight)


def copy_probs_ref(
    ids: list[int], ctx: list[int], order: int, vocab: int, decay: float = 0.0
) -> torch.Tensor:
    """Reference for :meth:`CopySpans.probs` of :func:`copy_spans` on one example: ``(len(ids), V)``, by
    scanning the context for the longest suffix and counting what follows each occurrence (summed in fp64, each
    occurrence weighed ``(1 + d / 64) ** -decay`` for ``d`` how far before the context's end its successor
    stands)."""
    out = torch.zeros(len(ids), vocab, dtype=torch.float64)
    for j in range(len(ids)):
        for k in range(min(order, j + 1), 0, -1):
            suffix = ids[j - k + 1 : j + 1]
            at = [i + k for i in range(len(ctx) - k) if ctx[i : i + k] == suffix]  # the successors' places
            if at:
                w = [(1.0 + (len(ctx) - p) / DECAY_UNIT) ** -decay for p in at]
                for p, wp in zip(at, w):
                    out[j, ctx[p]] += wp / sum(w)
                break
    return out.float()


PROB_FLOOR = -16.0  # the copy-agreement input's floor, in nats: log s below it reads as this


def copy_agreement_feature(s: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    """The copy head's input ``(...)`` in fp32 (``CepeConfig.mix_copy_prob``) from ``s`` ``(...)``, the
    probability the mixture without the copy gives a draw from the copy (``CopySpans.expected``):
    ``max(log s, −16) / 8``, in [−2, 0] (0: the mixture is sure of what the copy proposes), and 0 where
    no suffix occurs (``has`` False: there the copy takes no part)."""
    f = s.float().clamp_min(1e-30).log().clamp_min(PROB_FLOOR) / 8.0
    return torch.where(has, f, torch.zeros_like(f))


NEAR_UNIT = 64  # context tokens: the recency input is log(1 + d / NEAR_UNIT) / 4


def copy_recency_feature(spans: CopySpans) -> torch.Tensor:
    """The copy head's recency input ``(...)`` in fp32 (``CepeConfig.mix_copy_near``): ``log(1 + d / 64)
    / 4`` for ``d`` the distance from the context's end to the most recent successor of the matched
    suffix (:meth:`CopySpans.nearest`: 0.004 for the last token, 0.40 at 256, 1.04 at 4K, 1.19 at 8K),
    0 where no suffix occurs."""
    d = spans.nearest().float()
    return torch.where(spans.has, torch.log1p(d / NEAR_UNIT) / 4, torch.zeros_like(d))


def reader_sure_feature(top: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    """The copy head's input ``(...)`` in fp32 (``CepeConfig.mix_copy_sure``) from ``top`` ``(...)``, the
    log-probability the reader (the side with the context) gives its most probable next token:
    ``max(top, −16) / 8``, in [−2, 0] (0: the reader is sure), and 0 where no suffix occurs (``has``
    False)."""
    f = top.float().clamp_min(PROB_FLOOR) / 8.0
    return torch.where(has, f, torch.zeros_like(f))


def top_logprob(logits: torch.Tensor) -> torch.Tensor:
    """``max_y log softmax(logits)_y`` ``(...)`` in fp32 for logits ``(..., V)``: how sure a distribution
    is of its most probable token (the input of :func:`reader_sure_feature`)."""
    lg = logits.float()
    return lg.amax(-1) - lg.logsumexp(-1)


def copy_mix_logits(
    logits: torch.Tensor, c: torch.Tensor, copy: torch.Tensor, has: torch.Tensor
) -> torch.Tensor:
    """Logits ``(..., V)`` (fp32) whose softmax is ``σ(c)·copy + σ(−c)·softmax(logits)`` where ``has``,
    and ``logits`` themselves elsewhere (bit for bit).

    Args:
        logits: ``(..., V)`` the mixture's logits; c: ``(...)`` the copy logit; copy: ``(..., V)`` the copy
            distributions; has: ``(...)`` bool, where a suffix occurs.
    """
    lg = logits.float()
    c = c.float()[..., None]
    with_copy = torch.logaddexp(F.logsigmoid(-c) + lg.log_softmax(-1), F.logsigmoid(c) + copy.log())
    return torch.where(has[..., None], with_copy, lg)


def copy_mix_logits_ref(
    logits: torch.Tensor, c: torch.Tensor, copy: torch.Tensor, has: torch.Tensor
) -> torch.Tensor:
    """Reference for :func:`copy_mix_logits`: the log of the mixed probabilities in fp64 (log-softmaxed
    logits where no suffix occurs)."""
    mu = torch.sigmoid(c.double())[..., None] * has[..., None]
    return torch.log(mu * copy.double() + (1 - mu) * torch.softmax(logits.double(), -1))


def copy_mix_nll(nll: torch.Tensor, c: torch.Tensor, p_copy: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    """Per-position negative log-likelihood ``(N,)`` with the copy from the mixture's own ``nll`` ``(N,)``,
    the copy logit ``(N,)``, the copy's probability of the target ``(N,)`` and where a suffix occurs (in fp32,
    or fp64 where an input is)."""
    dtype = torch.promote_types(torch.promote_types(c.dtype, nll.dtype), torch.float32)  # fp32, or fp64 given
    c, nll = c.to(dtype), nll.to(dtype)
    with_copy = -torch.logaddexp(F.logsigmoid(-c) - nll, F.logsigmoid(c) + p_copy.to(dtype).log())
    return torch.where(has, with_copy, nll)
