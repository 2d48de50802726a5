"""Does an adapter match a query to the encoder's demonstrations? Synthetic ICL on held-out documents.

Builds ``icl`` training examples (:mod:`cepe.training.synthetic_icl`) from the *test* split of the prepared
training data (documents never trained on), the classes named by arbitrary words (``--arbitrary 1``: no
prior can tell them) or by their own names, and scores the first label of each example's decoder, whose
query has only the encoder's demonstrations to go by. It prints:

- accuracy: the gold label's tokens more likely than every other class's label (summed log-probabilities),
  with the demonstrations in the encoder (CEPE) and with none (the decoder alone); chance is the mean of
  1 / classes;
- where the first ``--heads`` heads of every cross-attention layer look from the position before the
  label: the geometric mean of their attention probability on the latest same-class demonstration's label
  token (the ``icl_align`` target) against that on the latest *other*-class demonstration's (a head that
  matches puts more on the first), and the uniform level 1 / (real keys).

Usage: python scripts/icl_probe.py ADAPTER [--data runs/data/mini] [--examples 48] [--arbitrary 1]
Writes nothing; pause a training run on the same cores first.
"""

from __future__ import annotations

import argparse
import math
import random

import torch

from cepe.compute import autocast
from cepe.cross_attention import AlignProbe
from cepe.generation import load_model
from cepe.modeling import packed_positions
from cepe.training.synthetic_icl import corpus_families, icl_example


def label_logprob(model, prefix: torch.Tensor, labels: list[list[int]], states, key_mask) -> torch.Tensor:
    """Summed log-probability ``(C,)`` of each label after ``prefix`` ``(t,)``, reading the encoded context
    ``states`` ``(1, S, D)`` / ``key_mask`` ``(1, S)`` (None: the decoder alone)."""
    width = max(len(x) for x in labels)
    ids = torch.zeros(len(labels), len(prefix) + width, dtype=torch.long)
    for c, lab in enumerate(labels):
        ids[c, : len(prefix)] = prefix
        ids[c, len(prefix) : len(prefix) + len(lab)] = torch.tensor(lab)
    ctx = None
    if states is not None:  # the chunks were encoded once; every candidate reads the same states
        c = len(labels)
        ctx = model.prepare_context(
            encoder_hidden_states=states.expand(c, -1, -1),
            encoder_attention_mask=key_mask.expand(c, -1),
            cross_attention_cache="states",
        )
    logp = model(input_ids=ids, cross_context=ctx).logits.float().log_softmax(-1)  # (C, t + w, V)
    out = torch.zeros(len(labels))
    for c, lab in enumerate(labels):
        for j, tok in enumerate(lab):
            out[c] += logp[c, len(prefix) + j - 1, tok]
    return out


def attention_on(model, prefix, states, key_mask, position: int, heads: int) -> float:
    """Geometric-mean attention probability (first ``heads`` heads, every layer) from the last prefix
    position on flat encoder position ``position`` (of the unpacked ``key_mask`` ``(1, S)``)."""
    targets = torch.full((1, len(prefix)), -1, dtype=torch.long)
    targets[0, -1] = position
    if model.cepe_config.pack_keys:
        targets = packed_positions(key_mask, targets)
    ctx = model.prepare_context(
        encoder_hidden_states=states, encoder_attention_mask=key_mask, cross_attention_cache="states"
    )
    ctx.align = AlignProbe(targets, heads)
    with model.use_context(ctx):
        model.decoder.get_decoder()(input_ids=prefix[None], use_cache=False)
    return math.exp(-float(torch.stack(ctx.align.losses).mean()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("adapter")
    p.add_argument("--data", default="runs/data/mini", help="prepared training data (its test split is read)")
    p.add_argument("--examples", type=int, default=48)
    p.add_argument(
        "--arbitrary", type=float, default=1.0, help="share of examples with arbitrary label words"
    )
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--chunk-length", type=int, default=64)
    p.add_argument("--decoder", type=int, default=256)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    model, tok, _ = load_model(a.adapter)
    fams = corpus_families(a.data, "test")
    by_family: dict[str, list[int]] = {}  # family -> [examples, right with the encoder, right alone]
    n = right = alone_right = 0
    chance = same = other = uniform = 0.0
    matched = 0
    for i in range(a.examples):
        info: dict = {}
        r = random.Random(a.seed * 100_003 + i)
        enc, mask, dec, labels, align = icl_example(
            fams, a.chunks, a.chunk_length, a.decoder, r, tok, scored=1, arbitrary=a.arbitrary, info=info
        )
        first = int((labels != -100).nonzero()[0, 0])
        prefix, gold = dec[:first], info["scored_classes"][0]
        enc, mask = enc[None], mask[None]
        with torch.no_grad(), autocast("cpu"):
            states, key_mask = model.encode_context(enc, mask)  # (1, S, D), (1, S): once per example
            with_ctx = label_logprob(model, prefix, info["label_ids"], states, key_mask)
            alone = label_logprob(model, prefix, info["label_ids"], None, None)
            hit, alone_hit = int(int(with_ctx.argmax()) == gold), int(int(alone.argmax()) == gold)
            right, alone_right = right + hit, alone_right + alone_hit
            fam = by_family.setdefault(info["family"], [0, 0, 0])
            fam[0], fam[1], fam[2] = fam[0] + 1, fam[1] + hit, fam[2] + alone_hit
            chance += 1 / len(info["label_ids"])
            n += 1
            classes = info["encoder_classes"]
            others = [j for j, c in enumerate(classes) if c != gold]
            if int(align[first - 1]) >= 0 and others:  # the encoder holds both kinds: compare
                j = others[-1]  # the latest other-class demonstration's label, at its first token
                row = enc[0, j, : int(mask[0, j].sum())].tolist()
                at = _label_start(row, info["label_ids"][classes[j]])
                same += math.log(
                    attention_on(model, prefix, states, key_mask, int(align[first - 1]), a.heads)
                )
                other += math.log(
                    attention_on(model, prefix, states, key_mask, j * a.chunk_length + at, a.heads)
                )
                uniform += math.log(1 / int(mask.sum()))
                matched += 1
    print(f"{a.adapter}, arbitrary {a.arbitrary:g}, {n} held-out examples")
    print("| accuracy, demonstrations in the encoder | decoder alone | chance |\n|---|---|---|")
    print(f"| {100 * right / n:.1f} % | {100 * alone_right / n:.1f} % | {100 * chance / n:.1f} % |")
    for name, (k, hit, alone_hit) in sorted(by_family.items()):
        print(f"| {name} ({k}) | {100 * hit / k:.1f} % | {100 * alone_hit / k:.1f} % | |")
    if matched:
        print(
            f"\nattention of the first {a.heads} heads from the position before the label ({matched} examples, "
            f"geometric means): same class's latest label {math.exp(same / matched):.4f}, other class's "
            f"{math.exp(other / matched):.4f}, uniform {math.exp(uniform / matched):.4f}"
        )


def _label_start(row: list[int], label: list[int]) -> int:
    """Offset of ``label``'s first token in a demonstration's tokens ``row``: its last occurrence (the
    label follows the text, then only the separator)."""
    for s in range(len(row) - len(label), -1, -1):
        if row[s : s + len(label)] == label:
            return s
    raise ValueError("a demonstration without its label")


if __name__ == "__main__":
    main()
