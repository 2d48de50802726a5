"""Evaluation metrics: answer normalisation, exact match, token F1, ROUGE-L, perplexity, the
label-scoring variants used for in-context classification and a paired bootstrap interval.

All text metrics take plain strings; scoring helpers take per-token log-probabilities ``(T,)``.
"""

from __future__ import annotations

import math
import random
import re
import string
from collections import Counter
from collections.abc import Sequence

import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


# Exact match and token F1 are the official SQuAD v2.0 evaluation script's (normalize_answer, compute_exact,
# compute_f1: both empty counts as F1 1), written out here because no maintained package ships them for
# offline use: ``evaluate``'s "squad" metric downloads its script from the Hub at first use.


def normalize_answer(text: str) -> str:
    """Standard answer normalisation: lowercase, drop punctuation and the articles a/an/the, collapse
    whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: str | Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    golds = [answers] if isinstance(answers, str) else list(answers)
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def _f1_tokens(pred: list[str], gold: list[str]) -> float:
    if not pred and not gold:
        return 1.0
    common = Counter(pred) & Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, answers: str | Sequence[str]) -> float:
    """Bag-of-words F1 between the normalised prediction and the best-matching gold answer."""
    golds = [answers] if isinstance(answers, str) else list(answers)
    pred = normalize_answer(prediction).split()
    return max((_f1_tokens(pred, normalize_answer(g).split()) for g in golds), default=0.0)


def rouge_l(prediction: str, answers: str | Sequence[str]) -> float:
    """ROUGE-L F-measure of Google's ``rouge-score`` (the reference implementation: longest common
    subsequence over lowercase alphanumeric tokens, no stemming, beta = 1), the best over the gold
    references (extra ``eval``)."""
    golds = [answers] if isinstance(answers, str) else list(answers)
    scorer = _rouge_scorer()
    return max((scorer.score(g, prediction)["rougeL"].fmeasure for g in golds), default=0.0)


_SCORER: list = []


def _rouge_scorer():
    if not _SCORER:
        from rouge_score import rouge_scorer

        _SCORER.append(rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False))
    return _SCORER[0]


def accuracy(prediction: str, answers: str | Sequence[str]) -> float:
    """Multiple-choice accuracy: exact match after normalisation (e.g. an option letter or text)."""
    return exact_match(prediction, answers)


def contains_answer(prediction: str, answers: str | Sequence[str]) -> float:
    """1.0 if any normalised gold answer occurs inside the normalised prediction."""
    golds = [answers] if isinstance(answers, str) else list(answers)
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(g) in pred for g in golds if normalize_answer(g)))


TEXT_METRICS = {
    "em": exact_match,
    "f1": token_f1,
    "rouge_l": rouge_l,
    "accuracy": accuracy,
    "contains": contains_answer,
}


def text_metric(name: str):
    """Look a text metric up by name (``em``, ``f1``, ``rouge_l``, ``accuracy``, ``contains``)."""
    if name not in TEXT_METRICS:
        raise ValueError(f"unknown metric {name!r}; choose one of {sorted(TEXT_METRICS)}")
    return TEXT_METRICS[name]


def perplexity(total_nll: float, num_tokens: int) -> float:
    """``exp(total_nll / num_tokens)``; total negative log-likelihood in nats."""
    if num_tokens <= 0:
        raise ValueError("perplexity needs at least one scored token")
    return math.exp(total_nll / num_tokens)


def paired_bootstrap(
    before: Sequence[float],
    after: Sequence[float],
    *,
    resamples: int = 10_000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Mean of ``after - before`` over paired items and its percentile bootstrap interval.

    Items (sequences, documents) are resampled with replacement, ``resamples`` times, with a seeded
    generator, so the interval is reproducible. Use it for a change between two settings scored on the
    same items: the pairs remove what the items share.

    Returns:
        ``(mean, low, high)``: the mean difference and the ``level`` interval's bounds.
    """
    if len(before) != len(after):
        raise ValueError(f"paired values must match in number, got {len(before)} and {len(after)}")
    if not before:
        raise ValueError("paired_bootstrap needs at least one pair")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    diffs = [float(b) - float(a) for a, b in zip(before, after)]
    n = len(diffs)
    rng = random.Random(seed)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    tail = (1.0 - level) / 2.0
    lo = means[min(resamples - 1, int(math.floor(tail * resamples)))]
    hi = means[min(resamples - 1, int(math.ceil((1.0 - tail) * resamples)) - 1)]
    return sum(diffs) / n, lo, hi


SCORING_VARIANTS = ("ll", "ll_norm", "pmi", "pmi_norm")


def label_scores(
    conditional: Sequence[torch.Tensor], domain: Sequence[torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Scores of each candidate label under the four variants used for in-context classification.

    Args:
        conditional: per label, the token log-probabilities ``(T_label,)`` of the label given the prompt.
        domain: per label, the token log-probabilities of the label given the domain string (the empty
            string: only the start token). Needed for the calibrated variants.

    Returns:
        ``{"ll", "ll_norm", "pmi", "pmi_norm"}`` -> ``(num_labels,)`` scores (higher is better):
        ``ll`` the summed log-likelihood, ``ll_norm`` divided by the label's token count, ``pmi`` the
        domain-conditional PMI ``log P(y|x) - log P(y|domain)``, ``pmi_norm`` that divided by the token count.
    """
    ll = torch.stack([c.double().sum() for c in conditional])
    n = torch.tensor([max(1, c.numel()) for c in conditional], dtype=torch.double)
    out = {"ll": ll, "ll_norm": ll / n}
    if domain is not None:
        if len(domain) != len(conditional):
            raise ValueError("domain and conditional must hold one entry per label")
        pmi = ll - torch.stack([d.double().sum() for d in domain])
        out["pmi"] = pmi
        out["pmi_norm"] = pmi / n
    return out
