"""Where a fixed-target curve moves between context lengths: the change in each target token's NLL, split by
whether the copy's suffix match (``cepe.mixture.copy_spans``, K = 8) finds the token's prefix in the
context at the shorter length, the longer, both or neither.

The sequences and layout are those of a ``fixedppl`` config (``cepe eval fixedppl``: one decoder window,
its last ``eval_tokens`` scored, the text before it in the encoder's chunks); ``--sequences``,
``--per-document`` and ``--seed`` override the config's. For each pair of consecutive context lengths it
prints the tokens of each kind and their share of the mean change (nats a scored token; the shares add
up to the change of the curve's log).

Usage: python scripts/fixedppl_split.py ADAPTER --config configs/eval/fixedppl_val.yaml
    [--sequences 11 --per-document 2 --seed 5]   (bf16 where the CPU runs it fast, as --autocast auto)
Writes nothing; pause a training run on the same cores first. Shape legend: T decoder tokens.
"""

from __future__ import annotations

import argparse
import math

import torch

from cepe.chunking import chunk_ids, collate_chunks
from cepe.compute import autocast
from cepe.configio import read_config_file
from cepe.eval.common import chunk_tail_aligned, iter_source
from cepe.eval.tasks.fixedppl import Config, fixed_sequences
from cepe.generation import load_model
from cepe.mixture import context_successors, copy_spans

ORDER = 8  # suffix lengths the copy looks for (the shipped adapter's mix_match)


@torch.no_grad()
def token_nll(model, seq: list[int], context: int, cfg: Config) -> tuple[list, list]:
    """The scored tokens' NLL and whether each one's prefix occurs in the context (copy spans), ``(E,)``.
    The context is laid out as ``cepe eval fixedppl`` reads it: pieces of the config's ``chunk_length``
    aligned to the window, each encoded in chunks of the adapter's ``chunk_length``."""
    w, n = cfg.decoder_window, cfg.eval_tokens
    before, dec = seq[len(seq) - w - context : len(seq) - w], torch.tensor([seq[-w:]])
    kw = {}
    if context:
        chunk = int(model.cepe_config.chunk_length)
        parts = [chunk_ids(p, chunk, pad_id=0) for p in chunk_tail_aligned(before, cfg.chunk_length)]
        ids, mask = collate_chunks(
            [(torch.cat([c for c, _ in parts]), torch.cat([m for _, m in parts]))], pad_id=0
        )
        kw = {"encoder_input_ids": ids, "encoder_attention_mask": mask}
    with autocast("cpu"):  # bf16 where it is fast, as --autocast auto
        logits = model(input_ids=dec, **kw).logits.float()  # (1, T, V)
    lp = logits[0, -n - 1 : -1].log_softmax(-1).gather(-1, dec[0, -n:, None])[:, 0]
    has = torch.zeros(n, dtype=torch.bool)
    if context:
        has = copy_spans(dec, context_successors(torch.tensor([before]), None, ORDER)).has[0, -n - 1 : -1]
    return (-lp).tolist(), has.tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("adapter")
    p.add_argument("--config", required=True, help="a fixedppl config (sources, contexts, layout)")
    p.add_argument("--sequences", type=int)
    p.add_argument("--per-document", type=int)
    p.add_argument("--seed", type=int)
    a = p.parse_args()
    raw = read_config_file(a.config)
    keep = {k: v for k, v in raw.items() if k in Config.__dataclass_fields__}
    for key in ("sequences", "per_document", "seed"):
        if getattr(a, key) is not None:
            keep[key] = getattr(a, key)
    cfg = Config(**keep)
    model, tok, _ = load_model(a.adapter)
    model.eval()
    docs = [
        tok.encode(d["text"])
        for s in cfg.sources
        for d in iter_source({"max_documents": cfg.max_documents, **s})
    ]
    seqs = fixed_sequences(docs, cfg)
    print(f"{len(seqs)} sequences from {len(docs)} documents, {cfg.eval_tokens} scored tokens each")
    per = {}
    for c in sorted(cfg.contexts):
        per[c] = [token_nll(model, s, c, cfg) for s in seqs]
        mean = sum(sum(x) for x, _ in per[c]) / (len(seqs) * cfg.eval_tokens)
        print(f"context {c}: perplexity {math.exp(mean):.4f}")
    print("\n| from | to | change (nats a token) | " + " | ".join(KINDS) + " |")
    print("|---" * (3 + len(KINDS)) + "|")
    lengths = sorted(c for c in cfg.contexts if c > 0)
    for lo, hi in zip(lengths, lengths[1:]):
        parts = {k: [0, 0.0] for k in KINDS}
        for (na, ha), (nb, hb) in zip(per[lo], per[hi]):
            for x, y, p_, q in zip(na, nb, ha, hb):
                kind = KINDS[2 * int(p_) + int(q)]
                parts[kind][0] += 1
                parts[kind][1] += y - x
        total = sum(n for n, _ in parts.values())
        cells = " | ".join(f"{n} tokens, {d / total:+.4f}" for n, d in parts.values())
        print(f"| {lo} | {hi} | {sum(d for _, d in parts.values()) / total:+.4f} | {cells} |")


KINDS = ("matched at neither", "matched at the longer only", "matched at the shorter only", "matched at both")

if __name__ == "__main__":
    main()
