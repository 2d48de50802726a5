"""Open-domain QA (§5.2, App. C.1): two demonstrations (each with its top-1 passage), then ``k``
retrieved passages and the question; greedy decoding; exact match after answer normalisation.

Input format (the usual retrieval-QA files, JSON list or JSONL): ``{"question": str, "answers": [str],
"ctxs": [{"title": str, "text": str, "score": float?}, ...]}`` with ctxs best first.
CEPE puts the top ``decoder_passages`` passages in the decoder and the next ones in the encoder (one per
chunk); ``full`` puts all ``k`` in the decoder, ``truncated`` the top ``decoder_passages``; ``replug`` runs
one pass per passage (weights from the ctx scores, uniform without).

Here a deterministic synthetic set plants facts into passages of a bundled corpus (:func:`synthetic_qa`).

Exact match over a few dozen questions moves in steps of several points; each row also gets ``answer_nll``,
the gold answer's teacher-forced NLL (nats per token) after the question, and, where the examples say which
passage holds the answer (``has_answer``, as the synthetic set does), the same split by where that passage
sits for the method (``answer_nll_by_place`` / ``em_by_place``: ``decoder``, ``encoder`` or ``absent``, the
passage beyond the ``k`` given or left out by ``truncated``), so that a checkpoint moving towards reading its
encoder shows before its answers turn exact.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cepe.eval.common import EvalSetup, iter_source, limit_items, run_examples, split_sentences
from cepe.eval.methods import Request
from cepe.eval.metrics import exact_match

_SYLLABLES = ("ka", "lo", "mir", "ven", "tas", "dor", "bel", "qui", "rho", "zan", "fel", "gri", "sul", "mo")
_ATTRIBUTES = (
    ("favourite colour", ("red", "blue", "green", "yellow", "purple", "orange", "silver", "black")),
    ("home town", ("Leeds", "Bristol", "Oxford", "Dundee", "Cardiff", "Norwich", "Bath", "York")),
    ("pet", ("a cat", "a parrot", "a goat", "a tortoise", "a rabbit", "a hamster", "a horse", "a dog")),
    ("lucky number", tuple(str(n) for n in (7, 13, 21, 42, 58, 64, 77, 99))),
)


def read_qa(path: str | Path) -> list[dict[str, Any]]:
    """Read a QA file (JSON list or JSONL) and check the fields."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"QA file {p} does not exist")
    text = p.read_text(encoding="utf-8")
    rows = (
        json.loads(text)
        if text.lstrip().startswith("[")
        else [json.loads(x) for x in text.splitlines() if x.strip()]
    )
    for i, r in enumerate(rows):
        for key in ("question", "answers"):
            if key not in r:
                raise ValueError(f"{p}: example {i} lacks {key!r} (expected question, answers, ctxs)")
        if isinstance(r["answers"], str):
            r["answers"] = [r["answers"]]
        r.setdefault("ctxs", [])
    return rows


def synthetic_qa(
    source: dict[str, Any], num_questions: int, num_passages: int, passage_words: int = 60, seed: int = 0
) -> list[dict[str, Any]]:
    """Deterministic QA examples in the standard format: a made-up person's attribute is planted as a
    sentence into one passage cut from ``source`` documents; that passage sits at a uniformly random rank
    among ``num_passages`` (the others are distractors). The passages carry no retrieval scores: their
    order says nothing about where the answer is, so REPLUG weighs its passes uniformly."""
    rng = random.Random(seed)
    passages: list[tuple[str, str]] = []
    for doc in iter_source(source):
        words = doc["text"].split()
        title = doc.get("title") or doc["id"]
        passages += [
            (title, " ".join(words[i : i + passage_words])) for i in range(0, len(words), passage_words)
        ]
        if len(passages) >= 20 * num_passages + 4 * num_questions:
            break
    if len(passages) < num_passages + 1:
        raise ValueError("the synthetic QA source has too few passages; use a larger corpus")
    out, names = [], set()
    while len(out) < num_questions:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(3)).capitalize()
        if name in names:
            continue
        names.add(name)
        attr, values = rng.choice(_ATTRIBUTES)
        value = rng.choice(values)
        ctxs = [{"title": t, "text": x} for t, x in rng.sample(passages, num_passages)]
        gold = rng.randrange(num_passages)
        sents = split_sentences(ctxs[gold]["text"]) or [ctxs[gold]["text"]]
        pos = rng.randrange(len(sents) + 1)
        sents.insert(pos, f"The {attr} of {name} is {value}. ")
        ctxs[gold] = {**ctxs[gold], "text": "".join(sents).strip(), "has_answer": True}
        out.append(
            {
                "question": f"What is the {attr} of {name}?",
                "answers": [value],
                "ctxs": ctxs,
                "gold_rank": gold,
            }
        )
    return out


def answer_place(ex: dict[str, Any], k: int, n_dec: int, method: str) -> str | None:
    """Where the passage that holds ``ex``'s answer sits for ``method`` given ``k`` passages of which the
    first ``n_dec`` go to the decoder: ``"decoder"``, ``"encoder"`` (CEPE's passages after the decoder's;
    REPLUG's, each in its own pass) or ``"absent"`` (beyond ``k``, or dropped by ``truncated``); None when
    no passage says ``has_answer``."""
    rank = next((i for i, c in enumerate(ex["ctxs"]) if c.get("has_answer")), None)
    if rank is None:
        return None
    if rank >= k:
        return "absent"
    if method == "replug":
        return "encoder"
    if rank < n_dec:
        return "decoder"
    return "encoder" if method == "cepe" else "absent"


@dataclass
class Config:
    """Settings (defaults: the paper's, with a file; ``configs/eval/qa.yaml`` runs the synthetic set).

    Attributes:
        path: QA file (standard format); None = synthetic set from ``synthetic``.
        demos_path: demonstrations file (default: the first ``num_demos`` synthetic / file examples,
            excluded from the test set).
        synthetic: ``{"source": {...}, "num_questions", "passage_words", "num_passages"}``; each question's
            answer is planted at a random rank among ``num_passages`` (default: the largest k), of which
            the first k are given, so a smaller k often leaves the answer out (``em_by_place`` splits
            that). Give ``num_passages`` to keep the same questions when the largest k changes.
        ks: passages per question (paper 10..60); decoder_passages: in the decoder for CEPE (paper 10).
        num_demos: demonstrations (paper 2), each with its top-1 passage.
        demo_passage: which passage a demonstration shows: ``top`` (its first, the paper's top-1
            retrieved passage, which in the paper's data usually holds the answer) or ``answer`` (the
            first marked ``has_answer``, else the first). The synthetic set plants each answer in a
            passage of random rank, so with ``top`` a demonstration shows a passage that holds its
            answer only one time in ``num_passages``; ``answer`` shows one that does. The recorded QA
            results use ``top``.
        max_new_tokens: generation length; generation stops at a newline.
        passage_template / demo_template / question_template: prompt pieces.
    """

    path: str | None = None
    demos_path: str | None = None
    synthetic: dict[str, Any] = field(
        default_factory=lambda: {"source": {"corpus": "bbc"}, "num_questions": 200, "passage_words": 100}
    )
    ks: list[int] = field(default_factory=lambda: [10, 20, 30, 60])
    decoder_passages: int = 10
    num_demos: int = 2
    demo_passage: str = "top"
    num_examples: int | None = None
    max_new_tokens: int = 20
    passage_template: str = "Document (Title: {title}): {text}\n\n"
    question_template: str = "Question: {question}\nAnswer:"
    demo_answer_template: str = " {answer}\n\n\n"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.demo_passage not in ("top", "answer"):
            raise ValueError(f"demo_passage must be 'top' or 'answer', got {self.demo_passage!r}")


def demo_context(ctxs: list[dict[str, Any]], choice: str) -> dict[str, Any] | None:
    """The passage a demonstration shows (``Config.demo_passage``); None without passages."""
    if not ctxs:
        return None
    if choice == "answer":
        return next((c for c in ctxs if c.get("has_answer")), ctxs[0])
    return ctxs[0]


def run(setup: EvalSetup, cfg: Config) -> dict[str, Any]:
    if cfg.path:
        data = read_qa(cfg.path)
    else:
        syn = dict(cfg.synthetic)
        source = syn.pop("source", {"corpus": "bbc"})
        num_questions = int(syn.pop("num_questions", 200)) + cfg.num_demos
        passage_words = int(syn.pop("passage_words", 100))
        num_passages = int(syn.pop("num_passages", max(cfg.ks)))
        if syn:
            raise ValueError(
                f"unknown synthetic QA key(s) {sorted(syn)}: use source, num_questions, passage_words, "
                "num_passages"
            )
        if max(cfg.ks) > num_passages:
            raise ValueError(
                f"ks {cfg.ks} asks for more passages than synthetic.num_passages ({num_passages}) holds; "
                "raise num_passages or drop the larger k"
            )
        data = synthetic_qa(source, num_questions, num_passages, passage_words, seed=cfg.seed)
    if cfg.demos_path:
        demos, tests = read_qa(cfg.demos_path)[: cfg.num_demos], data
    else:
        demos, tests = data[: cfg.num_demos], data[cfg.num_demos :]
    tests = limit_items(tests, cfg.num_examples, setup)

    def passage(c: dict[str, Any]) -> str:
        return cfg.passage_template.format(title=c.get("title", ""), text=c.get("text", ""))

    shown = [demo_context(d["ctxs"], cfg.demo_passage) for d in demos]
    demo_text = "".join(
        (passage(c) if c is not None else "")
        + cfg.question_template.format(question=d["question"])
        + cfg.demo_answer_template.format(answer=d["answers"][0])
        for d, c in zip(demos, shown)
    )
    demo_ids = setup.encode(demo_text)
    stops = setup.newline_ids()
    rows = []
    for k in cfg.ks:
        for method in setup.methods:

            def answer(m, ex, _k=k, _method=method):
                ctxs = ex["ctxs"][:_k]
                q_ids = setup.encode(cfg.question_template.format(question=ex["question"]))
                n_dec = _k if _method in ("full", "streamingllm") else min(cfg.decoder_passages, _k)
                dec_ids = [t for c in ctxs[:n_dec] for t in setup.encode(passage(c))]
                if _method == "replug":  # each pass: demos, one passage, question
                    ctx = [demo_ids + setup.encode(passage(c)) for c in ctxs]
                    scores = [float(c["score"]) for c in ctxs] if all("score" in c for c in ctxs) else None
                    req = Request(q_ids, 0, ctx, scores)
                elif _method == "cepe":
                    ctx = [setup.encode(passage(c)) for c in ctxs[n_dec:]]
                    req = Request(demo_ids + dec_ids + q_ids, 0, ctx)
                else:
                    req = Request(demo_ids + dec_ids + q_ids, 0)
                req.max_new_tokens, req.stop_ids = cfg.max_new_tokens, stops
                pred = setup.decode(m.generate(req)).split("\n")[0].strip()
                gold = setup.encode(cfg.demo_answer_template.format(answer=ex["answers"][0]).rstrip("\n"))
                forced = Request(req.input_ids + gold, len(gold), req.context, req.context_scores)
                nll = -float(m.score([forced])[0].mean())
                em = exact_match(pred, ex["answers"])
                return {"em": float(em), "nll": nll}, req.num_tokens + cfg.max_new_tokens + len(gold)

            vals, cost = run_examples(setup, method, tests, answer, f"qa k={k}")
            n_dec = k if method in ("full", "streamingllm") else min(cfg.decoder_passages, k)
            places = [answer_place(ex, k, n_dec, method) for ex in tests]
            by_place = {
                p: [v for v, q in zip(vals, places, strict=True) if q == p]
                for p in ("decoder", "encoder", "absent")
                if p in places
            }
            rows.append(
                {
                    "method": method,
                    "setting": {"k": k},
                    "metric": "em",
                    "value": 100.0 * sum(v["em"] for v in vals) / max(1, len(vals)),
                    "n": len(vals),
                    "answer_nll": round(sum(v["nll"] for v in vals) / max(1, len(vals)), 4),
                    **(
                        {
                            "answer_nll_by_place": {
                                p: round(sum(v["nll"] for v in vs) / len(vs), 4) for p, vs in by_place.items()
                            },
                            "em_by_place": {
                                p: round(100.0 * sum(v["em"] for v in vs) / len(vs), 2)
                                for p, vs in by_place.items()
                            },
                            "n_by_place": {p: len(vs) for p, vs in by_place.items()},
                        }
                        if None not in places
                        else {}
                    ),
                    **cost,
                }
            )
    return {
        "task": "qa",
        "rows": rows,
        "plot_x": "k",
        "notes": ["synthetic set" if not cfg.path else cfg.path],
        "extra_markdown": place_table(rows),
    }


def place_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per k and method, the gold answer's NLL (nats per token) and exact match, overall and by
    where the answer's passage sits (questions in brackets)."""
    from cepe.tables import pipe_table

    places = ("decoder", "encoder", "absent")
    head = [
        "k",
        "method",
        "answer NLL",
        *[f"NLL, answer in {p} (n)" for p in places],
        "EM, answer in encoder",
    ]
    body = []
    for r in rows:
        nll, n, em = r.get("answer_nll_by_place", {}), r.get("n_by_place", {}), r.get("em_by_place", {})
        body.append(
            [str(r["setting"]["k"]), r["method"], f"{r['answer_nll']:.3f}"]
            + [f"{nll[p]:.3f} ({n[p]})" if p in nll else "" for p in places]
            + [f"{em['encoder']:.1f}" if "encoder" in em else ""]
        )
    lines = ["Gold answers, teacher-forced after the question (nats per token; lower is better):", ""]
    return "\n".join(lines + pipe_table(head, body))
