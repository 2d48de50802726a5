"""Could the output mixture's head tell copied tokens from ordinary ones? Heads fitted offline on an adapter's
own reading.

The head of ``CepeConfig.output_mix`` sees the two final hidden states. On held-out text it gives every
token kind about the same λ (``scripts/gate_probe.py``: 0.24-0.35 for tokens whose bigram is in the
context and for tokens whose is not), so the reader's wrong guesses cost ``−log(1 − λ)`` everywhere. This
probe asks, without training the adapter, whether other inputs would let a head separate the two.

On windows of the training split (the layout of ``gate_probe``: one total, the decoder reads the last
``--window`` tokens, the tokens before go to the encoder in ``--chunk`` chunks; ``--train-per-domain``
windows a domain) it records, for every scored token, both final hidden states, the target's
log-probability with and without the context, and K suffix-match indicators (do the decoder's last k
tokens, k = 1..K, occur in the context's text with a token after them:
``cepe.mixture.suffix_matches_ref``). It fits, by full-batch Adam on
the mixture's NLL (``cepe.mixture.mix_nll``), a head on

- ``hidden``: both hidden states (the adapter's own head's inputs);
- ``hidden+match``: the same and the K indicators;
- ``match``: the K indicators alone (K + 1 weights);

and scores each, the adapter's own trained head (``own``, when it has one) and the decoder alone on the
validation windows (``configs/eval/lm_val.yaml``, retrieval split, never trained on): mean NLL and, by
token kind, the difference to the decoder alone and the mean λ.

Usage: python scripts/mix_fit.py ADAPTER [--total 1024] [--order 4] [--train-per-domain 8]
Writes nothing; pause a training run on the same cores first. Shape legend: N scored tokens, D width,
K match orders.
"""

from __future__ import annotations

import argparse
import copy

import torch
from gate_probe import window_args, windows

from cepe.compute import autocast
from cepe.configio import read_config_file
from cepe.generation import load_model
from cepe.mixture import mix_nll, suffix_matches_ref

KINDS = ("bigram in context", "previous in context", "neither")


def token_kinds(ids: list[int], ctx: list[int]) -> list[str]:
    """The kind of each predicted token ``ids[1:]``, as ``gate_probe`` counts them."""
    bigrams, seen = set(zip(ctx[:-1], ctx[1:])), set(ctx)
    return [
        KINDS[0] if (ids[j - 1], ids[j]) in bigrams else KINDS[1] if ids[j - 1] in seen else KINDS[2]
        for j in range(1, len(ids))
    ]


@torch.no_grad()
def collect(model, data, n: int, order: int) -> dict[str, torch.Tensor | list[str]]:
    """Per scored token (the last ``n`` of each window): ``h`` ``(N, 2D)`` (with and without the context),
    ``lp_ctx`` / ``lp_dec`` ``(N,)`` the target's log-probabilities, ``match`` ``(N, K)``, ``own`` ``(N,)``
    the adapter's own mixing logit, and ``kind`` (N token kinds). The hidden states are the head's first
    2·D inputs (an own head may read more after them: ``mix_match``, ``mix_length``, ``mix_agree``).

    Raises:
        SystemExit: the adapter's head does not read the hidden states (``mix_hidden: false``), or its
            output mixes in the copy (``mix_copy``), which a two-way mixture's NLL does not score.
    """
    c = model.cepe_config
    if not c.mix_hidden or c.mix_copy:
        raise SystemExit(
            "mix_fit reads both hidden states from the mixing head's inputs and scores the adapter's own "
            "head as a two-way mixture: this adapter's head "
            + (
                "reads no hidden states (mix_hidden: false)"
                if not c.mix_hidden
                else "mixes in the copy (mix_copy)"
            )
        )
    d = int(model.decoder.config.hidden_size)
    rows: dict[str, list] = {"h": [], "lp_ctx": [], "lp_dec": [], "match": [], "own": [], "kind": []}
    seen: list[torch.Tensor] = []
    hook = model.mix_head.register_forward_hook(lambda _m, inp, out: seen.append((inp[0], out)))
    try:
        for _domain, dec, enc, ctx in data:
            with autocast("cpu"):
                model(input_ids=dec, encoder_input_ids=enc)
            x, a = seen.pop()
            x, a = x.float().reshape(-1, x.shape[-1])[:-1][-n:, : 2 * d], a.float().reshape(-1)[:-1][-n:]
            target = dec[0, 1:][-n:, None]
            for key, h in (("lp_ctx", x[:, :d]), ("lp_dec", x[:, d:])):
                rows[key].append(model.lm_logits(h).float().log_softmax(-1).gather(-1, target)[:, 0])
            ids = dec[0].tolist()
            rows["h"].append(x)
            rows["own"].append(a)
            rows["match"].append(suffix_matches_ref(ids, ctx, order)[:-1][-n:])
            rows["kind"] += token_kinds(ids, ctx)[-n:]
    finally:
        hook.remove()
    return {k: v if k == "kind" else torch.cat(v) for k, v in rows.items()}


def inputs(data: dict, use: str) -> torch.Tensor:
    """The head's inputs ``(N, F)`` for feature set ``use``."""
    parts = {"hidden": [data["h"]], "hidden+match": [data["h"], data["match"]], "match": [data["match"]]}
    return torch.cat(parts[use], dim=-1)


def fit(
    x: torch.Tensor, lp_ctx: torch.Tensor, lp_dec: torch.Tensor, steps: int, lr: float
) -> torch.nn.Linear:
    """A zero-initialised ``Linear(F, 1)`` fitted by full-batch Adam on the mixture's mean NLL (inputs
    standardised inside: the returned head takes raw inputs)."""
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
    head = torch.nn.Linear(x.shape[-1], 1)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    z = (x - mu) / sd
    for _ in range(steps):
        opt.zero_grad()
        mix_nll(lp_ctx, lp_dec, head(z)[:, 0]).mean().backward()
        opt.step()
    raw = copy.deepcopy(head)
    with torch.no_grad():  # fold the standardisation into the weights
        raw.weight.div_(sd)
        raw.bias.sub_((head.weight / sd * mu).sum())
    return raw


def report(name: str, val: dict, a: torch.Tensor, base: float) -> None:
    """One table row: mean NLL, its difference to the decoder alone, and by kind (difference, mean λ)."""
    nll = mix_nll(val["lp_ctx"], val["lp_dec"], a)
    lam = torch.sigmoid(a)
    cells = []
    for kind in KINDS:
        m = torch.tensor([k == kind for k in val["kind"]])
        diff = (nll[m] + val["lp_dec"][m]).mean().item()
        cells.append(f"{diff:+.3f} / {lam[m].mean().item():.2f}")
    print(
        f"| {name} | {nll.mean().item():.4f} | {nll.mean().item() - base:+.4f} | " + " | ".join(cells) + " |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    window_args(p)
    p.add_argument("--train-per-domain", type=int, default=8)
    p.add_argument("--order", type=int, default=4, help="K: suffix lengths 1..K")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--lr", type=float, default=0.05)
    a = p.parse_args()
    torch.manual_seed(0)
    model, tok, _ = load_model(a.adapter)
    own = getattr(model, "mix_head", None) is not None
    if not own:
        model.enable_output_mix()  # a zero head: only its inputs are read
    val_cfg = read_config_file(a.config)
    train_cfg = {**val_cfg, "sources": [{**s, "split": "train"} for s in val_cfg["sources"]]}
    layout = (a.total, a.window, a.chunk)
    train = collect(model, windows(tok, train_cfg, *layout, a.train_per_domain), a.eval_tokens, a.order)
    val = collect(model, windows(tok, val_cfg, *layout, a.per_domain), a.eval_tokens, a.order)
    base = -val["lp_dec"].mean().item()
    print(
        f"{len(train['kind'])} training tokens, {len(val['kind'])} validation tokens; decoder alone "
        f"{base:.4f}; the reader alone {-val['lp_ctx'].mean().item():.4f}\n"
    )
    print("| head | mean NLL | against decoder alone | " + " | ".join(f"{k}: Δ / λ" for k in KINDS) + " |")
    print("|---" * (4 + len(KINDS)) + "|")
    if own:
        report("own (trained)", val, val["own"], base)
    for use in ("hidden", "hidden+match", "match"):
        head = fit(inputs(train, use), train["lp_ctx"], train["lp_dec"], a.steps, a.lr)
        with torch.no_grad():
            report(use, val, head(inputs(val, use))[:, 0], base)
            if use == "match":
                w = ", ".join(f"{v:+.2f}" for v in head.weight[0].tolist())
                print(f"|   (weights k = 1..{a.order}: {w}; bias {head.bias.item():+.2f}) |")


if __name__ == "__main__":
    main()
