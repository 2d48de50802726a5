"""Where does an adapter help or hurt against the decoder alone, and how strong should its gates be?

On the validation windows of ``configs/eval/lm_val.yaml`` (retrieval split, never trained on; one total,
the decoder reads the last ``--window`` tokens, the tokens before go to the encoder in ``--chunk`` chunks)
it prints the mean NLL of the last ``--eval-tokens`` tokens:

1. by token kind: the (previous, current) bigram occurs in the encoder's text / only the previous token
   does / neither (a reader that copies wins on the first, should not lose on the others);
2. with every per-head gate of a gated adapter (``init_mode: gate``) scaled by each factor of
   ``--scales`` (a too-strong cross-attention shows as a minimum below 1).

For an adapter with the output mixture (``CepeConfig.output_mix``) the first table adds the mean mixing
weight λ each token kind gets (a head that knows where reading helps gives the first kind the most).

Usage: python scripts/gate_probe.py ADAPTER [--total 1024] [--scales 0 0.25 0.5 0.75 1]
Writes nothing; pause a training run on the same cores first.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from cepe.compute import autocast
from cepe.configio import read_config_file
from cepe.eval.common import chunk_tail_aligned, iter_source
from cepe.eval.tasks.lm import sample_sequences
from cepe.generation import load_model


def windows(tok, config: str | dict, total: int, window: int, chunk: int, per_domain: int):
    """``[(domain, decoder ids (1, W), encoder chunks (1, K, L), context ids)]`` as ``cepe eval lm`` takes
    them (same sampler, seed 0), from an lm config file or its mapping."""
    cfg = read_config_file(config) if isinstance(config, str) else config
    out = []
    for src in cfg["sources"]:
        docs = [tok(d["text"])["input_ids"] for d in iter_source(src)]
        for seq in sample_sequences(docs, total, per_domain, 0, cfg.get("windows_per_document", 1)):
            ctx = seq[:-window]
            enc = torch.tensor([chunk_tail_aligned(ctx, chunk)])
            out.append((src["name"], torch.tensor([seq[-window:]]), enc, ctx))
    return out


@torch.no_grad()
def token_nll(model, dec: torch.Tensor, enc: torch.Tensor | None, n: int) -> torch.Tensor:
    """NLL ``(n,)`` of the last ``n`` tokens of ``dec`` ``(1, W)``, bf16 autocast where it is fast, as the evaluations."""
    with autocast("cpu"):
        logits = model(input_ids=dec, encoder_input_ids=enc).logits[0, :-1].float()
    return -logits.log_softmax(-1).gather(-1, dec[0, 1:, None])[-n:, 0]


def nll_and_mix(model, dec: torch.Tensor, enc: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_nll` with the context, and the output mixture's λ ``(n,)`` for the same tokens (the
    mixing head's logit captured from that forward pass; zeros for an adapter without the mixture)."""
    if getattr(model, "mix_head", None) is None:
        return token_nll(model, dec, enc, n), torch.zeros(n)
    seen: list[torch.Tensor] = []
    hook = model.mix_head.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    try:
        nll = token_nll(model, dec, enc, n)
    finally:
        hook.remove()
    return nll, torch.sigmoid(seen[-1].float().reshape(-1)[:-1][-n:])


def window_args(p: argparse.ArgumentParser) -> None:
    """The adapter and the validation windows' layout (:func:`windows`), shared with the other probes."""
    p.add_argument("adapter")
    p.add_argument("--config", default="configs/eval/lm_val.yaml")
    p.add_argument("--total", type=int, default=1024)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--eval-tokens", type=int, default=256)
    p.add_argument("--per-domain", type=int, default=4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    window_args(p)
    p.add_argument("--scales", type=float, nargs="*", default=[0.0, 0.25, 0.4, 0.5, 0.75, 1.0])
    a = p.parse_args()
    torch.manual_seed(0)
    model, tok, _ = load_model(a.adapter)
    data = windows(tok, a.config, a.total, a.window, a.chunk, a.per_domain)

    mixed = getattr(model, "mix_head", None) is not None
    kinds: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for domain, dec, enc, ctx in data:
        with_ctx, lam = nll_and_mix(model, dec, enc, a.eval_tokens)
        alone = token_nll(model, dec, None, a.eval_tokens)
        ids, bigrams, seen = dec[0].tolist(), set(zip(ctx[:-1], ctx[1:])), set(ctx)
        for i in range(a.eval_tokens):
            j = len(ids) - a.eval_tokens + i
            kind = (
                "bigram in context"
                if (ids[j - 1], ids[j]) in bigrams
                else "previous in context"
                if ids[j - 1] in seen
                else "neither"
            )
            k = kinds[(domain, kind)]
            k[0] += 1
            k[1] += with_ctx[i].item()
            k[2] += alone[i].item()
            k[3] += lam[i].item()
    head = "| domain | token kind | n | with context | decoder alone | difference |" + (" mean λ |" * mixed)
    print(head + "\n" + "|---" * (head.count("|") - 1) + "|")
    for (domain, kind), (n, c, t, lsum) in sorted(kinds.items()):
        row = f"| {domain} | {kind} | {n} | {c / n:.3f} | {t / n:.3f} | {(c - t) / n:+.3f} |"
        print(row + (f" {lsum / n:.3f} |" if mixed else ""))

    gates = [m.gate for m in model.cross_attention_modules() if m.gate is not None]
    if not gates:
        print("\n(no per-head gates: the scale sweep needs an adapter with init_mode gate)")
        return
    original = [g.detach().clone() for g in gates]
    alone = sum(token_nll(model, d, None, a.eval_tokens).mean().item() for _, d, _, _ in data) / len(data)
    print(
        f"\ndecoder alone: mean NLL {alone:.4f}\n\n| gate scale | mean NLL | against decoder alone |\n|---|---|---|"
    )
    for s in a.scales:
        with torch.no_grad():
            for g, o in zip(gates, original):
                g.copy_(o * s)
        nll = sum(token_nll(model, d, e, a.eval_tokens).mean().item() for _, d, e, _ in data) / len(data)
        print(f"| {s:g} | {nll:.4f} | {nll - alone:+.4f} |")


if __name__ == "__main__":
    main()
