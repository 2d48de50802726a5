"""Where does the cross-attention look when the needle is asked for? Attention mass on the needle by layer.

For a needle config (default ``configs/eval/needle_val.yaml``, the validation needle: never the reported
one for choices) it builds each (total, depth) prompt as ``cepe eval needle`` does for CEPE, runs one
forward pass, and at the prompt's last token (where the answer starts) reads every cross-attention layer's
softmax over [null key] + encoder tokens (with ``--forced``, at the last token of that text after the
prompt: for example the needle's words up to the one that must be copied). It prints, per total (mean over depths):

- ``needle``: mass on the needle's tokens (mean over heads), the layer with the most, and the best head's;
- ``null``: mass on the null key (adapters with ``null_key``);
- ``uniform``: what a head spreading evenly over the encoder tokens puts on the needle;
- ``next``: the model's five most likely next tokens there (where the answer is won or lost; with an
  output mixture, the mixture's), and ``alone``: the decoder alone's over the same window.

A reader that finds the needle keeps its mass as the haystack grows; one whose needle mass halves from 2K
to 4K (as the uniform share does) is diluted by the extra keys.

With ``--find TEXT`` it runs no model: for each (total, depth) it says whether TEXT's tokens stand in
the decoder's window or in the encoder, and how many distinct decoder windows each total has (the depth
moves the needle, not always the window).

Usage: python scripts/needle_probe.py ADAPTER [--config configs/eval/needle_val.yaml] [--json OUT]
       python scripts/needle_probe.py ADAPTER --config FILE --find "TEXT"
Writes only ``--json`` (and the table beside it as ``.md``); pause a training run on the same cores first.
"""

from __future__ import annotations

import argparse

import torch

from cepe.chunking import chunk_ids
from cepe.cross_attention import CrossAttention
from cepe.eval.api import task_config
from cepe.eval.cli import load_eval_config
from cepe.eval.tasks.needle import Config, build_haystack, needle_request, prompt_parts
from cepe.fileio import write_json, write_text
from cepe.generation import load_model


class _Setup:  # what prompt_parts reads of an EvalSetup
    def __init__(self, tok):
        self.tokenizer = tok

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def find(flat: list[int], needle: list[int]) -> list[int]:
    """Flat encoder positions of the needle's tokens (its longest run found whole, else nothing)."""
    n = len(needle)
    for cut in range(max(1, n // 2)):  # the first token may merge with the preceding text
        sub = needle[cut:]
        for i in range(len(flat) - len(sub) + 1):
            if flat[i : i + len(sub)] == sub:
                return list(range(i, i + len(sub)))
    return []


def probe(model, tok, cfg: Config, bf16: bool, forced: str = "") -> list[dict]:
    setup = _Setup(tok)
    sentences, needle, pre, suf = prompt_parts(setup, cfg)
    suf = suf + (setup.encode(forced) if forced else [])
    captured: dict[int, torch.Tensor] = {}

    def hook(mod: CrossAttention, args, out):
        hidden, ctx = args[:2]
        ctx = ctx.base if ctx.base is not None else ctx  # an output mixture's doubled context: its own
        h = hidden[:1, -1:]  # the row that reads the context (an output mixture adds the decoder alone's)
        q = mod.q_proj(mod.layernorm(h)).view(1, 1, mod.num_heads, mod.head_dim)
        if mod.q_norm is not None:
            q = mod.q_norm(q)
        q = q.transpose(1, 2).float()  # (1, H, 1, hd)
        if ctx.q_scale is not None:
            q = q * ctx.q_scale.float()
        if mod.length_exp is not None:  # the context-length exponents scale the scores, as the layer does
            q = mod.length_scaled(q, ctx)
        k = ctx.kv[mod.layer_idx][0].float()  # (1, KV, S (+1 with a null key), hd)
        k = k.repeat_interleave(mod.num_heads // k.shape[1], dim=1)
        scores = (q @ k.transpose(-1, -2))[0, :, 0] * mod.scale  # (H, S')
        mask = (
            ctx.key_mask[0] if ctx.key_mask is not None else torch.ones(ctx.states.shape[1], dtype=torch.bool)
        )
        if mod.null_key is not None:
            mask = torch.cat([mask.new_ones(1), mask])
        captured[mod.layer_idx] = scores.masked_fill(~mask, float("-inf")).softmax(-1)

    mods = [m for m in model.modules() if isinstance(m, CrossAttention)]
    if any(m.run_bias is not None for m in mods):
        raise SystemExit(
            "needle_probe reads each layer's softmax from its scores, and this adapter adds run biases "
            "(run_bias) to them, which the probe does not: its masses would not be the adapter's"
        )
    handles = [m.register_forward_hook(hook) for m in mods]
    rows = []
    try:
        for total in cfg.totals:
            for depth in cfg.depths:
                hay = build_haystack(sentences, needle, total, depth)
                req = needle_request("cepe", hay, pre, suf, cfg)
                parts = [chunk_ids(p, cfg.chunk_length, pad_id=tok.pad_token_id or 0) for p in req.context]
                enc = torch.cat([c for c, _ in parts])[None]
                emask = torch.cat([m for _, m in parts])[None]
                flat = enc[0][emask[0]].tolist()  # the states hold the real tokens only
                pos = find(flat, needle)
                if not pos:
                    continue  # the needle is in the decoder window
                captured.clear()
                with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                    out = model(
                        input_ids=torch.tensor([req.input_ids]),
                        encoder_input_ids=enc,
                        encoder_attention_mask=emask,
                        logits_to_keep=1,
                    )
                probs, ids = out.logits[0, -1].float().softmax(-1).topk(5)
                with (
                    torch.no_grad(),
                    torch.autocast("cpu", torch.bfloat16, enabled=bf16),
                    model.use_context(None),
                ):
                    alone = model.decoder(input_ids=torch.tensor([req.input_ids]), logits_to_keep=1).logits
                a_probs, a_ids = alone[0, -1].float().softmax(-1).topk(5)
                off = 1 if mods[0].null_key is not None else 0
                idx = torch.tensor(pos) + off
                layers = {}
                for li, p in sorted(captured.items()):
                    per_head = p[:, idx].sum(-1)  # (H,)
                    layers[li] = {
                        "needle": float(per_head.mean()),
                        "best_head": float(per_head.max()),
                        "null": float(p[:, 0].mean()) if off else 0.0,
                        "by_token": [round(float(x), 4) for x in p[int(per_head.argmax()), idx]],
                    }
                rows.append(
                    {
                        "total": total,
                        "depth": depth,
                        "encoder_tokens": int(emask.sum()),
                        "needle_tokens": len(pos),
                        "needle_text": [tok.decode([t]) for t in flat[pos[0] : pos[-1] + 1]],
                        "uniform": len(pos) / int(emask.sum()),
                        "next": [[tok.decode([int(t)]), round(float(q), 4)] for t, q in zip(ids, probs)],
                        "alone": [[tok.decode([int(t)]), round(float(q), 4)] for t, q in zip(a_ids, a_probs)],
                        "layers": layers,
                    }
                )
    finally:
        for h in handles:
            h.remove()
    return rows


def summary(rows: list[dict]) -> list[str]:
    lines = [
        "| total | enc tokens | uniform | needle (mean layer) | best layer: needle | best head | null |",
        "|---|---|---|---|---|---|---|",
    ]
    for total in sorted({r["total"] for r in rows}):
        rs = [r for r in rows if r["total"] == total]
        layers = rs[0]["layers"].keys()
        mean = {li: sum(r["layers"][li]["needle"] for r in rs) / len(rs) for li in layers}
        head = {li: sum(r["layers"][li]["best_head"] for r in rs) / len(rs) for li in layers}
        null = sum(sum(r["layers"][li]["null"] for li in layers) / len(layers) for r in rs) / len(rs)
        best = max(mean, key=mean.get)
        lines.append(
            f"| {total} | {sum(r['encoder_tokens'] for r in rs) / len(rs):.0f} "
            f"| {sum(r['uniform'] for r in rs) / len(rs):.4f} | {sum(mean.values()) / len(mean):.4f} "
            f"| L{best}: {mean[best]:.3f} | {max(head.values()):.3f} | {null:.3f} |"
        )
    lines += [
        "",
        "| total | depth | next token: top 5 (probability) | the decoder alone's |",
        "|---|---|---|---|",
    ]
    for r in rows:
        top, alone = (
            ", ".join(f"{t!r} {q:.2f}" for t, q in r[k]).replace("|", "/") for k in ("next", "alone")
        )
        lines.append(f"| {r['total']} | {r['depth']} | {top} | {alone} |")
    return lines


def load_adapter_tokenizer(adapter: str):
    """The tokenizer of ``adapter``'s decoder (its ``cepe_config.json``), without loading any weights."""
    from pathlib import Path

    from cepe.assets import load_tokenizer
    from cepe.config import CepeConfig
    from cepe.modeling import ADAPTER_CONFIG

    cfg = Path(adapter) / ADAPTER_CONFIG
    name = CepeConfig.load(cfg).decoder_name_or_path if cfg.is_file() else None
    return load_tokenizer(name or adapter)


def find_text(tok, cfg: Config, text: str) -> list[str]:
    """Where ``text``'s tokens stand in each (total, depth) prompt: decoder window, encoder, or neither."""
    setup = _Setup(tok)
    sentences, needle, pre, suf = prompt_parts(setup, cfg)
    key = setup.encode(text)

    def holds(seq: list[int]) -> bool:  # as the probe finds a needle: its first token may have merged
        return bool(find(seq, key))

    lines = ["| total | depth | in the decoder window | in the encoder |", "|---|---|---|---|"]
    windows: dict[int, set] = {}
    for total in cfg.totals:
        for depth in cfg.depths:
            req = needle_request("cepe", build_haystack(sentences, needle, total, depth), pre, suf, cfg)
            windows.setdefault(total, set()).add(tuple(req.input_ids))
            enc = [t for part in req.context for t in part]
            lines.append(f"| {total} | {depth} | {holds(list(req.input_ids))} | {holds(enc)} |")
    lines.append("")
    lines += [f"{total}: {len(w)} distinct decoder window(s) over the depths" for total, w in windows.items()]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("adapter")
    ap.add_argument("--config", default="configs/eval/needle_val.yaml")
    ap.add_argument("--set", action="append", default=[], help="config overrides, key=value")
    ap.add_argument(
        "--forced", default="", help="text after the prompt (the answer's opening): read at its last token"
    )
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    ap.add_argument("--json", help="write the per-layer rows here")
    ap.add_argument(
        "--find", help="no model: where this text stands in each prompt (decoder window, encoder)"
    )
    a = ap.parse_args()
    _, settings, _ = load_eval_config("needle", a.config, a.set)
    cfg = task_config("needle", settings)
    if a.find:
        print("\n".join(find_text(load_adapter_tokenizer(a.adapter), cfg, a.find)))
        return
    model, tok, _ = load_model(a.adapter)
    rows = probe(model, tok, cfg, not a.fp32, a.forced)
    lines = summary(rows)
    print("\n".join(lines))
    if a.json:
        write_json(a.json, rows, indent=1)
        head = f"# Needle attention: {a.adapter}, {a.config}" + (f", forced {a.forced!r}" if a.forced else "")
        write_text(a.json.removesuffix(".json") + ".md", head + "\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
