"""Which of the output mixture's inputs moves a fixed-target curve between context lengths.

For an adapter with the output mixture (and the copy), the NLL of each fixed target token is a function of
a few numbers per token (:class:`cepe.training.head_fit.TokenStats`): the reader's log-probability, the
decoder's alone, the heads' inputs and the copy's probability of the target. The targets are the same at
every context length, so each step of the curve (say 0.5K -> 1K) can be split by putting one group of those
numbers at the longer length and keeping the rest at the shorter one:

- ``reader``: the reader's log-probability of the target and its certainty (the copy head's ``u``);
- ``length``: the heads' context-length input (``n``), in the mixing head (``mix length``) and in the copy
  head (``copy length``);
- ``matches``: the suffix-match indicators and agreements (``m1..mK``, ``a1..aK``), in each head;
- ``copy``: the copy's probability of the target and where it takes part.

Each group's share is the mean of the change with the group moved alone from the shorter length and with
it moved back alone from the longer one (the two agree when the groups do not interact); ``rest`` is what
the groups' shares leave of the step. The sequences and layout are those of a ``fixedppl`` config, as in
``scripts/fixedppl_split.py``; bf16 where the CPU runs it fast (as ``--autocast auto``).

``--per-sequence`` adds each sequence's change at each step; ``--tokens N`` the N tokens whose NLL changes
most at each step, with the copy's weight μ, the copy's and the reader's view of the token and the heads'
inputs that changed.

Usage: python scripts/fixedppl_parts.py ADAPTER --config configs/eval/fixedppl_val.yaml
    [--per-sequence] [--tokens 10]
Writes nothing; pause a training run on the same cores first. Shape legend: N scored tokens, T decoder
tokens.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import torch

from cepe.chunking import chunk_ids, collate_chunks
from cepe.compute import bf16_is_fast
from cepe.configio import read_config_file
from cepe.eval.common import chunk_tail_aligned, iter_source
from cepe.eval.tasks.fixedppl import Config, fixed_sequences
from cepe.generation import load_model
from cepe.training.head_fit import Heads, TokenStats, head_names, head_nll, record_batch

GROUPS = ("reader", "mix length", "copy length", "mix matches", "copy matches", "copy")


def stats_at(model, seq: list[int], context: int, cfg: Config) -> TokenStats:
    """The mixture's per-token numbers at the ``eval_tokens`` fixed targets of ``seq`` with ``context``
    tokens before the decoder window in the encoder (> 0), laid out as ``cepe eval fixedppl`` reads them
    (pieces of the config's ``chunk_length``, each in chunks of the adapter's)."""
    w, n = cfg.decoder_window, cfg.eval_tokens
    before, dec = seq[len(seq) - w - context : len(seq) - w], torch.tensor([seq[-w:]])
    chunk = int(model.cepe_config.chunk_length)
    parts = [chunk_ids(p, chunk, pad_id=0) for p in chunk_tail_aligned(before, cfg.chunk_length)]
    ids, mask = collate_chunks(
        [(torch.cat([c for c, _ in parts]), torch.cat([m for _, m in parts]))], pad_id=0
    )
    labels = dec.clone()
    labels[:, : w - n] = -100  # the last n tokens are the targets
    batch = {
        "input_ids": dec,
        "labels": labels,
        "encoder_input_ids": ids,
        "encoder_attention_mask": mask,
        "index": torch.tensor([0]),
    }
    got = record_batch(model, batch, bf16_is_fast("cpu"))
    assert got is not None and len(got) == n
    return got


def moved(a: TokenStats, b: TokenStats, group: str, cols: dict[str, list[int]]) -> TokenStats:
    """``a`` with ``group``'s numbers (:data:`GROUPS`) taken from ``b`` (the same targets at another
    length)."""
    if group == "copy":
        return replace(a, p_copy=b.p_copy, has=b.has)
    x_mix, x_copy = a.x_mix.clone(), None if a.x_copy is None else a.x_copy.clone()
    if group == "reader":
        if x_copy is not None:
            x_copy[:, cols["copy u"]] = b.x_copy[:, cols["copy u"]]
        return replace(a, lp_ctx=b.lp_ctx, x_copy=x_copy)
    head = group.split()[0]
    x, y = (x_mix, b.x_mix) if head == "mix" else (x_copy, b.x_copy)
    if x is not None:
        x[:, cols[group]] = y[:, cols[group]]
    return replace(a, x_mix=x_mix, x_copy=x_copy)


def show_tokens(per, lengths, seqs, heads: Heads, names: list[str], tok, n: int, top: int) -> None:
    """Print, for each step, the ``top`` tokens whose NLL changes most (either way)."""
    for lo, hi in zip(lengths, lengths[1:]):
        sa, sb = per[lo], per[hi]
        na, nb = head_nll(sa, heads), head_nll(sb, heads)  # (N,) sequences one after another
        d = nb - na
        up, down = float(d.clamp_min(0).mean()), float(d.clamp_max(0).mean())
        print(
            f"\nFrom {lo} to {hi} the tokens that rise add {up:+.4f} nats a token, those that fall {down:+.4f}; "
            "those that change most (NLL, copy weight μ, p_copy of the token, reader NLL):\n"
        )
        for i in d.abs().argsort(descending=True)[:top].tolist():
            s, j = divmod(i, n)
            tg = seqs[s][-n:]
            mus = []
            for st in (sa, sb):
                mu = 0.0
                if heads.w_copy is not None and bool(st.has[i]):
                    mu = float(torch.sigmoid(st.x_copy[i].double() @ heads.w_copy + heads.b_copy))
                mus.append(mu)
            moved_inputs = {
                x: f"{float(sa.x_copy[i, k]):.2f}->{float(sb.x_copy[i, k]):.2f}"
                for k, x in enumerate(names)
                if abs(float(sa.x_copy[i, k] - sb.x_copy[i, k])) > 1e-3
            }
            print(
                f"- sequence {s}, token {j}: {tok.decode(tg[max(0, j - 6) : j])!r} -> {tok.decode([tg[j]])!r}: "
                f"{float(d[i]):+.3f} (NLL {float(na[i]):.2f} -> {float(nb[i]):.2f}), μ {mus[0]:.3f} -> {mus[1]:.3f}, "
                f"p_copy {float(sa.p_copy[i]):.3f} -> {float(sb.p_copy[i]):.3f}, reader {float(-sa.lp_ctx[i]):.2f} -> "
                f"{float(-sb.lp_ctx[i]):.2f}; inputs {moved_inputs}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("adapter")
    p.add_argument("--config", required=True, help="a fixedppl config (sources, contexts, layout)")
    p.add_argument("--per-sequence", action="store_true", help="also each sequence's change at each step")
    p.add_argument("--tokens", type=int, default=0, help="also the N tokens that change most at each step")
    a = p.parse_args()
    raw = read_config_file(a.config)
    cfg = Config(**{k: v for k, v in raw.items() if k in Config.__dataclass_fields__})
    model, tok, _ = load_model(a.adapter)
    model.eval()
    if model.mix_head is None:
        raise SystemExit(f"{a.adapter} has no output mixture (output_mix): there is nothing to split")
    heads = Heads.of(model)
    names = head_names(model.cepe_config, int(model.decoder.config.hidden_size))
    cols: dict[str, list[int]] = {}
    for head in ("mix", "copy"):
        ns = names[f"{head}_head"] or []
        cols[f"{head} length"] = [i for i, x in enumerate(ns) if x == "n"]
        cols[f"{head} matches"] = [i for i, x in enumerate(ns) if x[0] in "ma" and x[1:].isdigit()]
        cols[f"{head} u"] = [i for i, x in enumerate(ns) if x == "u"]
    docs = [
        tok.encode(d["text"])
        for s in cfg.sources
        for d in iter_source({"max_documents": cfg.max_documents, **s})
    ]
    seqs = fixed_sequences(docs, cfg)
    lengths = sorted(c for c in cfg.contexts if c > 0)
    print(f"{len(seqs)} sequences from {len(docs)} documents, {cfg.eval_tokens} scored tokens each")
    per = {c: TokenStats.cat([stats_at(model, s, c, cfg) for s in seqs]) for c in lengths}
    for c in lengths:
        nll = head_nll(per[c], heads)
        print(
            f"context {c}: perplexity {math.exp(float(nll.mean())):.4f} (reader alone {math.exp(float(-per[c].lp_ctx.double().mean())):.4f})"
        )
    print("\n| from | to | change (nats a token) | " + " | ".join(GROUPS) + " | rest |")
    print("|---" * (4 + len(GROUPS)) + "|")
    for lo, hi in zip(lengths, lengths[1:]):
        sa, sb = per[lo], per[hi]
        fa, fb = head_nll(sa, heads).mean(), head_nll(sb, heads).mean()
        shares = []
        for g in GROUPS:
            fwd = head_nll(moved(sa, sb, g, cols), heads).mean() - fa
            back = fb - head_nll(moved(sb, sa, g, cols), heads).mean()
            shares.append(float(fwd + back) / 2)
        total = float(fb - fa)
        cells = " | ".join(f"{x:+.4f}" for x in shares)
        print(f"| {lo} | {hi} | {total:+.4f} | {cells} | {total - sum(shares):+.4f} |")
    if a.tokens:
        show_tokens(per, lengths, seqs, heads, names["copy_head"] or [], tok, cfg.eval_tokens, a.tokens)
    if a.per_sequence:
        n = cfg.eval_tokens
        print("\nEach sequence's change (nats a token), in order:\n")
        print("| from | to | " + " | ".join(str(i) for i in range(len(seqs))) + " |")
        print("|---" * (2 + len(seqs)) + "|")
        for lo, hi in zip(lengths, lengths[1:]):
            d = (head_nll(per[hi], heads) - head_nll(per[lo], heads)).reshape(len(seqs), n).mean(-1)
            print(f"| {lo} | {hi} | " + " | ".join(f"{float(x):+.4f}" for x in d) + " |")


if __name__ == "__main__":
    main()
