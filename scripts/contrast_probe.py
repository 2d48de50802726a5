"""Greedy answers that weigh what the encoder adds: context-aware decoding for CEPE, as a probe.

A probe, not a model option: it runs any ``cepe eval ...`` command line with CEPE's greedy generation
choosing, at every step, the token that maximises ``(1 + alpha) · log p(y | context, x) − alpha · log p(y | x)``
among the tokens whose probability with the context is at least ``--plausibility`` times the most likely
one's (context-aware decoding, with the plausibility cut of contrastive decoding). ``p(y | x)`` is the
same model with no context: exactly the frozen decoder on its own window (the invariant the tests hold). Where the decoder alone and CEPE agree nothing changes; where the decoder's
own window pulls the answer away from what the encoder holds (a sentence of the window copied instead of
the needle, a full stop where the needle goes on) the context's side is weighed up. Scores (perplexity,
answer NLL) are unchanged: only ``generate`` is.

Usage: python scripts/contrast_probe.py --alpha 0.5 eval needle --model ADAPTER --config configs/eval/needle_val4.yaml \
           --methods cepe --autocast auto --out OUT
Pause a training run on the same cores first.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from cepe.cli import main as cepe_main
from cepe.eval.methods import CepeMethod


class ContrastWithoutContext(LogitsProcessor):
    """Turns CEPE's next-token logits ``(B, V)`` into context-aware scores, running ``model`` without
    context on the same tokens (its own KV cache, one new token a step after the prompt)."""

    def __init__(self, model: torch.nn.Module, alpha: float, plausibility: float) -> None:
        self.model, self.alpha, self.plausibility = model, alpha, plausibility
        self.cache: Any = None
        self.seen = 0
        params = inspect.signature(model.decoder.forward).parameters  # newer decoders name it ``cache``
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    def plain_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The model's last-position logits with no context ``(B, V)``, fed only the tokens it has not seen."""
        out = self.model(
            input_ids=input_ids[:, self.seen :],
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_arg: self.cache},
        )
        self.cache, self.seen = out.past_key_values, input_ids.shape[1]
        return out.logits[:, -1]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        with_ctx = torch.log_softmax(scores.float(), dim=-1)
        plain = torch.log_softmax(self.plain_logits(input_ids).float(), dim=-1)
        mixed = (1 + self.alpha) * with_ctx - self.alpha * plain
        floor = with_ctx.max(dim=-1, keepdim=True).values + torch.log(torch.tensor(self.plausibility))
        return mixed.masked_fill(with_ctx < floor, float("-inf")).to(scores.dtype)


def install(alpha: float, plausibility: float) -> None:
    """Make every CEPE ``generate`` of this process context-aware."""
    if alpha < 0:
        raise SystemExit(f"error: --alpha must be 0 or more, got {alpha}")
    if not 0 < plausibility <= 1:
        raise SystemExit(f"error: --plausibility must be in (0, 1], got {plausibility}")

    def call_generate(self, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if ids.shape[0] != 1 or int(kwargs.get("num_beams", 1)) != 1:
            raise SystemExit("error: the contrast probe decodes one greedy sequence at a time")
        procs = LogitsProcessorList([ContrastWithoutContext(self.model, alpha, plausibility)])
        return self.model.generate(ids, logits_processor=procs, **kwargs)

    CepeMethod._call_generate = call_generate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alpha", type=float, required=True, help="weight of the context's contribution")
    ap.add_argument(
        "--plausibility", type=float, default=0.1, help="keep tokens at least this share of the top one"
    )
    a, rest = ap.parse_known_args()
    install(a.alpha, a.plausibility)
    return cepe_main(rest)


if __name__ == "__main__":
    sys.exit(main())
