"""Needle in a haystack (App. D): a needle sentence at depth ``d`` of a haystack of ``T`` tokens (the
essays), then the question; the answer must contain the needle's key words.

The decoder keeps the last ``decoder_window`` tokens of the haystack plus the question; the rest is split
at sentence boundaries into encoder chunks of at most ``chunk_length`` tokens. With ``score_scaling``
(``yarn``) the CEPE cross-attention scores are scaled by the ratio of context tokens to training context
tokens (:class:`cepe.config.CepeConfig`). Writes an accuracy grid and one heatmap PNG per method; each
row keeps the generated ``answer``.

With ``forced_answer`` each row also gets ``answer_nll``: the mean negative log-likelihood (nats per token)
of that text after the question and ``forced_prefix`` (for example the answer's opening, restating the
question), teacher-forced. Accuracy is all or nothing; the likelihood shows whether a checkpoint is moving
towards reading the needle before its greedy answers change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cepe.eval.common import (
    EvalSetup,
    iter_source,
    pack_sentences,
    run_examples,
    split_sentences,
    wrap_prompt,
)
from cepe.eval.methods import Request


@dataclass
class Config:
    """Settings.

    Attributes:
        haystack: document source (default: the bundled essays).
        needle, question, answer_keywords: the probe; the score is the fraction of keywords found.
        totals: haystack lengths in tokens; depths: needle depths in [0, 1].
        decoder_window: decoder tokens of haystack (paper 2K); chunk_length: max encoder chunk tokens.
        score_scaling: ``none`` or ``yarn`` (CEPE only); train_context_tokens: the training context length
            (default: the model's ``cepe_config.train_context_tokens``).
        forced_answer: text whose teacher-forced likelihood is also measured (``answer_nll``); None = no.
        forced_prefix: text between the question's end and ``forced_answer`` (the answer's opening).
    """

    haystack: dict[str, Any] = field(default_factory=lambda: {"corpus": "essays"})
    needle: str = (
        "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
    )
    question: str = "What is the best thing to do in San Francisco?"
    answer_keywords: list[str] = field(default_factory=lambda: ["sandwich", "Dolores Park"])
    totals: list[int] = field(default_factory=lambda: [4096, 8192, 16384, 32768])
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    decoder_window: int = 2048
    chunk_length: int = 256
    max_new_tokens: int = 32
    chat_template: bool | str = "auto"
    answer_prefix: str = "Answer:"
    score_scaling: str = "none"
    train_context_tokens: int | None = None
    forced_answer: str | None = None
    forced_prefix: str = ""


def build_haystack(
    sentences: list[list[int]], needle: list[int], total: int, depth: float
) -> list[list[int]]:
    """Tokenised sentences summing to about ``total`` tokens with ``needle`` inserted at the sentence
    boundary nearest ``depth`` of the way through."""
    out, n = [], 0
    budget = total - len(needle)
    for s in sentences:
        if n + len(s) > budget:
            break
        out.append(s)
        n += len(s)
    if n < budget * 0.9:
        raise ValueError(f"the haystack holds only {n} tokens, fewer than the {total} requested")
    target, acc, pos = depth * n, 0, len(out)
    for i, s in enumerate(out):
        if acc >= target:
            pos = i
            break
        acc += len(s)
    return out[:pos] + [needle] + out[pos:]


def needle_request(method: str, hay: list[list[int]], pre: list[int], suf: list[int], cfg: Config) -> Request:
    """The prompt ``pre + haystack + suf`` as ``method`` reads it: whole sentences from the end, up to
    ``decoder_window`` tokens, in the decoder, the earlier ones packed into encoder chunks (CEPE, REPLUG),
    dropped (truncated) or also in the decoder (full, StreamingLLM). REPLUG's passes each read
    ``pre + piece + tail + suf``, the piece where the other methods' earlier haystack is."""
    dec_n, cut = 0, len(hay)
    while cut > 0 and dec_n + len(hay[cut - 1]) <= cfg.decoder_window:
        cut -= 1
        dec_n += len(hay[cut])
    tail = [t for s in hay[cut:] for t in s]
    if method in ("full", "streamingllm"):
        req = Request(pre + [t for s in hay for t in s] + suf)
    elif method == "truncated":
        req = Request(pre + tail + suf)
    elif (
        method == "replug" and cut > 0
    ):  # each pass reads pre + piece + tail + suf: the piece inside the conversation
        req = Request(tail + suf, 0, [pre + p for p in pack_sentences(hay[:cut], cfg.chunk_length)])
    else:
        req = Request(pre + tail + suf, 0, pack_sentences(hay[:cut], cfg.chunk_length))
    req.max_new_tokens = cfg.max_new_tokens
    return req


def prompt_parts(setup: EvalSetup, cfg: Config) -> tuple[list[list[int]], list[int], list[int], list[int]]:
    """``(haystack sentences, needle, prompt opening, question and answer opening)``, tokenised; a
    prompt is ``opening + haystack with the needle + question`` (:func:`needle_request` splits it)."""
    sentences: list[list[int]] = []
    for doc in iter_source(cfg.haystack):
        sentences += [setup.encode(s) for s in split_sentences(doc["text"])]
        if sum(map(len, sentences)) > max(cfg.totals) * 1.1:
            break
    needle = setup.encode(cfg.needle.strip() + " ")
    before, after = wrap_prompt(setup, cfg.chat_template)
    pre = setup.encode(before)
    suf = setup.encode(f"\n\n{cfg.question}" + (after if before else f"\n{cfg.answer_prefix}"))
    return sentences, needle, pre, suf


def run(setup: EvalSetup, cfg: Config) -> dict[str, Any]:
    sentences, needle, pre, suf = prompt_parts(setup, cfg)
    keys = [k.lower() for k in cfg.answer_keywords]
    forced = setup.encode(cfg.forced_answer) if cfg.forced_answer else []
    forced_pre = setup.encode(cfg.forced_prefix) if cfg.forced_answer and cfg.forced_prefix else []

    def go(mm, r):
        text = setup.decode(mm.generate(r))
        answers.append(text)
        if forced:
            f = Request(r.input_ids + forced_pre + forced, len(forced), r.context)
            nlls.append(-float(mm.score([f])[0].mean()))
        low = text.lower()
        return sum(k in low for k in keys) / max(1, len(keys)), r.num_tokens

    rows: list[dict[str, Any]] = []
    for method in setup.methods:
        for depth in cfg.depths:
            for total in cfg.totals:
                req = needle_request(method, build_haystack(sentences, needle, total, depth), pre, suf, cfg)
                answers: list[str] = []
                nlls: list[float] = []
                restore = _scale(setup, cfg) if method == "cepe" else None
                try:
                    vals, cost = run_examples(setup, method, [req], go, f"needle T={total} d={depth}")
                finally:
                    if restore:
                        restore()
                rows.append(
                    {
                        "method": method,
                        "setting": {"total": total, "depth": depth},
                        "metric": "accuracy",
                        "value": 100.0 * vals[0],
                        "n": 1,
                        "answer": answers[0],
                        **({"answer_nll": round(nlls[0], 4)} if nlls else {}),
                        **cost,
                    }
                )
    return {
        "task": "needle",
        "rows": rows,
        "grids": _grids(rows, setup.methods, cfg),
        "totals": cfg.totals,
        "depths": cfg.depths,
        "plot_x": "total",
    }


def _grids(rows: list[dict[str, Any]], methods: list[str], cfg: Config) -> dict[str, list[list[float]]]:
    """Per method, the depth × total grid of accuracies in [0, 1]."""
    return {
        method: [
            [
                next(
                    r["value"] / 100.0
                    for r in rows
                    if r["method"] == method and r["setting"] == {"total": t, "depth": d}
                )
                for t in cfg.totals
            ]
            for d in cfg.depths
        ]
        for method in methods
    }


def _scale(setup: EvalSetup, cfg: Config):
    """Switch on cross-attention score scaling for the run; returns a function restoring the config."""
    if cfg.score_scaling == "none" or setup.cepe_model is None:
        return None
    cc = setup.cepe_model.cepe_config
    if not (cfg.train_context_tokens or cc.train_context_tokens):  # checked before the model changes
        raise ValueError("score_scaling needs train_context_tokens (set it in the needle config)")
    old = (cc.score_scaling, cc.train_context_tokens)
    cc.score_scaling = cfg.score_scaling
    cc.train_context_tokens = cfg.train_context_tokens or cc.train_context_tokens

    def restore() -> None:
        cc.score_scaling, cc.train_context_tokens = old

    return restore
