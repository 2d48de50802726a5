"""Do the gates' sensors tell a copy from a chance match? The induction statistic against the match statistics.

On the validation windows of ``configs/eval/lm_val.yaml`` (retrieval split; the layout of
``scripts/gate_probe.py``) it records, for every cross-attention head, the induction statistic ι̂
(``CepeConfig.induction_gate``; gates added at zero, so the adapter's function is unchanged) and, for
adapters with match gates, the match statistics (m, κ̂), on the last ``--eval-tokens`` tokens of

- **copy**: the window itself in the encoder (every token continues a copy);
- the window with the text before it in the encoder, by token kind: the (previous, current) bigram occurs
  in the context / only the previous token does (a chance match) / neither.

It prints the mean ι̂ by kind, and how well each sensor separates copies from the two kinds that should not
read (area under the ROC curve, 0.5 = not at all, 1 = perfectly): over all heads, and the mean of each
layer's best head; then every head of every layer at once (a logistic fit on half the windows, measured
on the other half). Writes ``OUT.json`` and ``OUT.md`` when ``--out`` is given.

Usage: python scripts/induction_probe.py ADAPTER [--total 1024] [--out results/.../induction_probe]
Pause a training run on the same cores first.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import torch
from gate_probe import window_args, windows

from cepe.compute import autocast
from cepe.eval.common import chunk_tail_aligned
from cepe.fileio import write_json, write_text
from cepe.generation import load_model

KINDS = ("copy", "bigram in context", "previous in context", "neither")


def auc(pos: torch.Tensor, neg: torch.Tensor) -> float:
    """P(a copy's value > a non-copy's), ties counted half (the Mann-Whitney statistic)."""
    allv = torch.cat([pos, neg]).double()
    order = allv.argsort()
    ranks = torch.empty_like(allv)
    ranks[order] = torch.arange(1, len(allv) + 1, dtype=torch.float64)
    uniq, inv = allv.unique(return_inverse=True)  # average ranks over ties
    sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, ranks)
    counts = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, torch.ones_like(ranks))
    ranks = (sums / counts)[inv]
    r = ranks[: len(pos)].sum().item()
    return (r - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg))


def logistic(x: torch.Tensor, y: torch.Tensor, l2: float = 0.0):
    """A logistic regression of ``y`` on ``x`` ``(N, F)`` (features standardised on ``x``): the score function."""
    x = x.double()
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
    w = torch.zeros(x.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=100)
    z, y = (x - mu) / sd, y.double()

    def loss():
        opt.zero_grad()
        out = torch.nn.functional.binary_cross_entropy_with_logits(z @ w[:-1] + w[-1], y)
        out = out + l2 * (w[:-1] ** 2).sum()
        out.backward()
        return out

    with torch.enable_grad():
        opt.step(loss)
    coef = w[:-1].detach()
    return lambda t: ((t.double() - mu) / sd) @ coef


def separation(pos: list[torch.Tensor], neg: list[torch.Tensor]) -> float:
    """The AUC of one statistic, or of a logistic regression's score on several (fitted on these tokens:
    what the best weights of a gate on them could separate)."""
    if len(pos) == 1:
        return auc(pos[0], neg[0])
    p, q = torch.stack(pos, -1), torch.stack(neg, -1)
    score = logistic(torch.cat([p, q]), torch.cat([torch.ones(len(p)), torch.zeros(len(q))]))
    return auc(score(p), score(q))


def held_out(per_window: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """Every head of every layer at once: ``per_window`` ``[(copy (N, F), other (M, F))]``; fitted on the
    even windows (L2 1e-3) and measured on the odd ones, which it never saw. Returns (fit AUC, held-out AUC)."""
    split = [
        [torch.cat([w[i] for w in per_window[r::2]]) for i in (0, 1)] for r in (0, 1)
    ]  # [[copy, other] of even windows, ... of odd]
    (p, q), (p2, q2) = split
    score = logistic(torch.cat([p, q]), torch.cat([torch.ones(len(p)), torch.zeros(len(q))]), l2=1e-3)
    return auc(score(p), score(q)), auc(score(p2), score(q2))


def kind_of(ids: list[int], j: int, bigrams: set, seen: set) -> str:
    if (ids[j - 1], ids[j]) in bigrams:
        return "bigram in context"
    return "previous in context" if ids[j - 1] in seen else "neither"


@torch.no_grad()
def record(model, dec: torch.Tensor, enc: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    """``{"ι̂": (layers, H, n), "m": ..., "κ̂": ...}`` of one window's last ``n`` tokens."""
    mods = model.cross_attention_modules()
    for m in mods:
        m.induction_record = []
        if m.match_gate is not None:
            m.match_record = []
    try:
        with autocast("cpu"):
            model(input_ids=dec, encoder_input_ids=enc)
        out = {"ι̂": torch.stack([m.induction_record[0][0, :, -n:] for m in mods])}
        if mods[0].match_gate is not None:
            stats = torch.stack([m.match_record[0][:, -n:] for m in mods])  # (layers, H, n, 2)
            out["m"], out["κ̂"] = stats[..., 0], stats[..., 1]
        return out
    finally:
        for m in mods:
            m.induction_record = None
            m.match_record = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    window_args(p)
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    a = p.parse_args()
    torch.manual_seed(0)
    model, tok, _ = load_model(a.adapter)
    model.enable_induction_gate()  # zero weights: the adapter's function is unchanged
    data = windows(tok, a.config, a.total, a.window, a.chunk, a.per_domain)
    n = a.eval_tokens
    values: dict[str, dict[str, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    rows = []  # per window: ({sensor: copy (layers·H, n)}, {sensor: chance matches or none (layers·H, M)})
    for _, dec, enc, ctx in data:
        ids = dec[0].tolist()
        own = torch.tensor([chunk_tail_aligned(ids, a.chunk)])  # the window itself in the encoder
        copy = record(model, dec, own, n)
        for name, t in copy.items():
            values[name]["copy"].append(t)
        got = record(model, dec, enc, n)
        bigrams, seen = set(zip(ctx[:-1], ctx[1:])), set(ctx)
        kinds = [kind_of(ids, len(ids) - n + i, bigrams, seen) for i in range(n)]
        for kind in KINDS[1:]:
            sel = torch.tensor([k == kind for k in kinds])
            for name, t in got.items():
                values[name][kind].append(t[..., sel])
        other = torch.tensor([k != "bigram in context" for k in kinds])
        rows.append(
            (
                {k: v.flatten(0, 1) for k, v in copy.items()},
                {k: v.flatten(0, 1)[:, other] for k, v in got.items()},
            )
        )
    cat = {s: {k: torch.cat(v, dim=-1).float() for k, v in d.items()} for s, d in values.items()}
    layers, heads = cat["ι̂"]["copy"].shape[:2]
    result: dict = {"adapter": a.adapter, "total": a.total, "eval_tokens": n, "windows": len(data)}
    result["mean_iota"] = {k: cat["ι̂"][k].mean().item() for k in KINDS}
    result["tokens"] = {k: int(cat["ι̂"][k].shape[-1]) for k in KINDS}
    sep = {}
    sensors = {name: [name] for name in cat}
    if "m" in cat:  # what a gate sees from several statistics: a logistic fit per head
        sensors["m + κ̂"] = ["m", "κ̂"]
        sensors["m + κ̂ + ι̂"] = ["m", "κ̂", "ι̂"]
    for sensor, names in sensors.items():
        for neg in ("previous in context", "neither"):
            grid = [
                [
                    separation([cat[x]["copy"][i, h] for x in names], [cat[x][neg][i, h] for x in names])
                    for h in range(heads)
                ]
                for i in range(layers)
            ]
            g = torch.tensor(grid)
            sep[f"{sensor}: copies against {neg}"] = {
                "mean over heads": g.mean().item(),
                "best head per layer": g.max(1).values.mean().item(),
                "heads above 0.9": int((g > 0.9).sum()),
                "per head": grid,
            }
    result["auc"] = sep
    wide = {}
    for sensor, names in sensors.items():
        per_window = [tuple(torch.cat([r[i][x] for x in names]).T.float() for i in (0, 1)) for r in rows]
        fit, test = held_out(per_window)
        wide[sensor] = {"fit": fit, "held out": test}
    result["model_wide"] = wide
    grid = torch.tensor(sep["ι̂: copies against neither"]["per head"])
    li, h = divmod(int(grid.argmax()), heads)
    best = {"layer": model.cross_attention_modules()[li].layer_idx, "head": h, "auc": grid[li, h].item()}
    best["share above 0.5"] = {k: (cat["ι̂"][k][li, h] > 0.5).float().mean().item() for k in KINDS}
    result["best_iota_head"] = best
    lines = [
        f"Induction probe of `{a.adapter}` ({len(data)} validation windows, total {a.total}, last {n} tokens)",
        "",
        "| token kind | tokens | mean ι̂ |",
        "|---|---|---|",
        *[f"| {k} | {result['tokens'][k]} | {result['mean_iota'][k]:+.3f} |" for k in KINDS],
        "",
        f"| sensor: copies against | AUC, mean over heads | mean of each layer's best head | heads above 0.9 (of {layers * heads}) |",
        "|---|---|---|---|",
        *[
            f"| {k} | {v['mean over heads']:.3f} | {v['best head per layer']:.3f} | {v['heads above 0.9']} |"
            for k, v in sep.items()
        ],
        "",
        f"The best ι̂ head (decoder layer {best['layer']}, head {best['head']}, AUC {best['auc']:.3f} against neither): "
        + ", ".join(f"{k} {100 * v:.0f} %" for k, v in best["share above 0.5"].items())
        + " of tokens with ι̂ > 0.5.",
        "",
        "Every head of every layer at once, copies against tokens with no bigram match (previous in context or",
        "neither): a logistic fit on the even windows, its AUC there and on the odd windows it never saw.",
        "",
        "| sensors | AUC on the fitted windows | AUC on held-out windows |",
        "|---|---|---|",
        *[f"| {k} | {v['fit']:.3f} | {v['held out']:.3f} |" for k, v in wide.items()],
    ]
    text = "\n".join(lines)
    print(text)
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out.with_suffix(".json"), result)
        write_text(out.with_suffix(".md"), text + "\n")


if __name__ == "__main__":
    main()
