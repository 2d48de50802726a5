"""Long-document tasks in the ZeroSCROLLS style (§7, App. C.3): the document, then the instruction.

The decoder keeps the last ``decoder_window`` tokens (document tail + instruction; paper 2K); the rest of
the document goes to the CEPE encoder in chunks (up to ``max_total_tokens`` in all, e.g. 2K + 30K).
``full`` reads everything in the decoder, ``truncated`` only the window, ``replug`` one pass per chunk.
Metrics: token F1 (QA), accuracy (multiple choice), ROUGE-L (summaries).

Data: the ACL papers with their aspect summaries here (:func:`cepe.data.acl_summaries`), or JSONL with
``document``/``instruction``/``answers`` fields, or ZeroSCROLLS records (``input``, ``output``,
``document_start_index``, ``document_end_index``, ``query_start_index``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cepe.eval.common import EvalSetup, chunk_tail_aligned, limit_items, run_examples, wrap_prompt
from cepe.eval.methods import Request, standard_request
from cepe.eval.metrics import text_metric


def read_longdoc(path: str | Path) -> list[dict[str, Any]]:
    """Examples ``{"document", "instruction", "answers"}`` from JSONL (own or ZeroSCROLLS fields).

    A ZeroSCROLLS ``input`` is the task's instructions, the document, a separator, the query and the
    answer's opening: the instructions become the example's ``prefix`` (before the document) and the rest
    after the document its ``instruction``, which already opens the answer (``own_answer_prefix``)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"long-document file {p} does not exist")
    out = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        r = json.loads(line)
        extra: dict[str, Any] = {}
        if "document" in r:
            doc, instr, ans = r["document"], r.get("instruction", ""), r.get("answers", r.get("output", ""))
        elif "input" in r and "document_end_index" in r:
            text, start, end = r["input"], r.get("document_start_index", 0), r["document_end_index"]
            doc, instr, ans = text[start:end], text[end:], r.get("output", "")
            extra = {"prefix": text[:start], "own_answer_prefix": True}
        else:
            raise ValueError(
                f"{p}:{i + 1}: expected fields document/instruction/answers or ZeroSCROLLS input/output/"
                "document_end_index"
            )
        out.append(
            {
                "document": doc,
                "instruction": instr,
                "answers": [ans] if isinstance(ans, str) else ans,
                **extra,
            }
        )
    return out


def acl_examples(
    split: str, aspect: str, instruction: str, max_docs: int | None, held_out: bool = True
) -> list[dict[str, Any]]:
    """ACL papers paired with one aspect summary (challenge / approach / outcome). ``split`` is the
    summaries' own split; with ``held_out`` only papers outside the training part of the training data's
    document split (:data:`cepe.eval.tasks.lm.HELD_OUT`) are kept, papers no shipped adapter trained on."""
    from cepe.data.corpora import acl_papers, acl_summaries
    from cepe.data.split import SplitFractions, assign_split

    from .lm import HELD_OUT

    summaries = {s["paper_id"]: s for s in acl_summaries(split)}
    fractions = SplitFractions(test=HELD_OUT["test_fraction"], retrieval=HELD_OUT["retrieval_fraction"])
    out = []
    for doc in acl_papers():
        if held_out and assign_split(doc["id"], HELD_OUT["split_seed"], fractions) == "train":
            continue
        s = summaries.get(doc["paper_id"])
        if s and s.get(aspect):
            out.append({"document": doc["text"], "instruction": instruction, "answers": [s[aspect]]})
            if max_docs is not None and len(out) >= max_docs:
                break
    return out


@dataclass
class Config:
    """Settings.

    Attributes:
        path: JSONL file (None = ACL papers with ``aspect`` summaries of ``split``).
        held_out: ACL papers only from outside the training part of the training data's document split
            (about 11 of aclsum's 100 test papers; false: all of them, most of which were trained on).
        instruction: used for the ACL papers.
        decoder_window: decoder tokens incl. the instruction (paper 2048).
        max_total_tokens: cap on document + instruction tokens (None = all; paper 2K+2K, 2K+30K, all).
        chunk_length: the context's pieces (aligned to the window); CEPE encodes each piece in chunks of its
            adapter's ``chunk_length`` (``methods.cepe.chunk_length`` overrides it), so a longer piece is split
            further and a shorter one is one padded chunk.
        metric: ``rouge_l``, ``f1`` or ``accuracy``.
        max_new_tokens: paper 50 (QA) / 1024 (summaries).
        chat_template: ``auto``, true or false.
        answer_prefix: text after the instruction (without a chat template).
        sampling: generation kwargs for cepe/full/truncated (e.g. GovReport: do_sample, top_p 0.95,
            temperature 1.0, min_new_tokens 10); streamingllm and replug are greedy only. With
            ``do_sample`` each example draws from the run seed and its index, so a method's answers
            do not depend on which methods ran before it.
    """

    path: str | None = None
    split: str = "test"
    held_out: bool = True
    aspect: str = "challenge"
    instruction: str = "In one sentence, what problem does the paper above address?"
    decoder_window: int = 2048
    max_total_tokens: int | None = None
    chunk_length: int = 256
    metric: str = "rouge_l"
    max_new_tokens: int = 64
    num_examples: int | None = None
    chat_template: bool | str = "auto"
    answer_prefix: str = "Answer:"
    sampling: dict[str, Any] = field(default_factory=dict)


def longdoc_request(method: str, pre: list[int], doc: list[int], suf: list[int], cfg: Config) -> Request:
    """The prompt ``pre + doc + suf`` (the document's last ``max_total_tokens`` less the prompt's tokens) as
    ``method`` reads it: the document's last tokens up to ``decoder_window`` in the decoder, the earlier
    ones in pieces of ``chunk_length`` aligned to them in the encoder (CEPE), in REPLUG's passes (each
    ``pre + piece + tail + suf``), dropped (truncated), or all in the decoder (full, StreamingLLM)."""
    if cfg.max_total_tokens is not None:
        keep = cfg.max_total_tokens - len(pre) - len(suf)
        doc = doc[max(0, len(doc) - keep) :] if keep > 0 else []  # (doc[-0:] would keep all of it)
    room = cfg.decoder_window - len(pre) - len(suf)
    if room <= 0:
        raise ValueError(f"decoder_window {cfg.decoder_window} leaves no room for the document")
    tail, head = doc[-room:] if doc else [], doc[:-room] if len(doc) > room else []
    if method in ("full", "streamingllm"):
        req = Request(pre + doc + suf)
    elif method == "replug" and head:
        req = Request(tail + suf, 0, [pre + p for p in chunk_tail_aligned(head, cfg.chunk_length)])
    else:
        req = standard_request(method, chunk_tail_aligned(head, cfg.chunk_length), pre + tail + suf)
    req.max_new_tokens, req.stop_ids = cfg.max_new_tokens, ()
    return req


def run(setup: EvalSetup, cfg: Config) -> dict[str, Any]:
    metric = text_metric(cfg.metric)
    if cfg.path:
        data = read_longdoc(cfg.path)
    else:
        data = acl_examples(cfg.split, cfg.aspect, cfg.instruction, cfg.num_examples, cfg.held_out)
    data = limit_items(data, cfg.num_examples, setup)
    before, after = wrap_prompt(setup, cfg.chat_template)
    suffix_text = "\n\n{instr}" + (after if before else "\n" + cfg.answer_prefix)
    rows = []
    for method in setup.methods:

        def answer(m, item, _method=method):
            i, ex = item
            if cfg.sampling.get("do_sample"):  # each example's draws its own: not the methods run before
                import torch

                torch.manual_seed(setup.seed * 1_000_003 + i)
            pre = setup.encode(before + ex.get("prefix", ""))
            if ex.get("own_answer_prefix"):  # the record's text after the document, as it is
                suf = setup.encode(ex["instruction"].rstrip() + (after if before else ""))
            else:
                suf = setup.encode(suffix_text.format(instr=ex["instruction"].strip()))
            req = longdoc_request(_method, pre, setup.encode(ex["document"]), suf, cfg)
            kwargs = cfg.sampling if _method in ("cepe", "full", "truncated") else {}
            pred = setup.decode(m.generate(req, **kwargs)).strip()
            return metric(pred, ex["answers"]), req.num_tokens + cfg.max_new_tokens

        vals, cost = run_examples(setup, method, list(enumerate(data)), answer, "longdoc")
        rows.append(
            {
                "method": method,
                "setting": {"decoder_window": cfg.decoder_window, "max_total": cfg.max_total_tokens or "all"},
                "metric": cfg.metric,
                "value": 100.0 * sum(vals) / max(1, len(vals)),
                "n": len(vals),
                **cost,
            }
        )
    return {"task": "longdoc", "rows": rows, "notes": [cfg.path or f"ACL papers, {cfg.aspect} summaries"]}
