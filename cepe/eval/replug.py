"""REPLUG baseline: one decoder pass per context piece prepended to the input, next-token
distributions mixed with weights ``softmax(score / τ)`` from the retriever (uniform without scores).

``p(y_t) = Σ_j w_j · p(y_t | piece_j, input_<t)``; with a single piece this is plain prepending.
Shape legend: K pieces, T tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from cepe.eval.methods import DecoderMethod, Method, Request, check_targets


def mixture_weights(num: int, scores: Sequence[float] | None, temperature: float = 1.0) -> torch.Tensor:
    """Log mixture weights ``(K,)``: ``log_softmax(scores / τ)``, or uniform when ``scores`` is None."""
    if num <= 0:
        raise ValueError("mixture_weights needs at least one piece")
    if scores is None:
        return torch.full((num,), -torch.log(torch.tensor(float(num))).item(), dtype=torch.float32)
    if len(scores) != num:
        raise ValueError(f"got {len(scores)} retriever scores for {num} context pieces")
    if temperature <= 0:
        raise ValueError("replug temperature must be positive")
    return torch.log_softmax(torch.tensor(scores, dtype=torch.float32) / temperature, dim=0)


class Replug(Method):
    """REPLUG ensemble over context pieces for scoring and greedy generation.

    Args:
        decoder: HF causal LM.
        temperature: τ of the retriever-score softmax.
    """

    name = "replug"

    def __init__(self, decoder: torch.nn.Module, temperature: float = 1.0, **kwargs: Any):
        super().__init__(decoder, **kwargs)
        self.temperature = temperature
        self.inner = DecoderMethod(decoder, **kwargs)

    @torch.no_grad()
    def score(self, requests: Sequence[Request]) -> list[torch.Tensor]:
        results = []
        for r in requests:
            check_targets(r)
            pieces = [p for p in r.context] or [[]]
            logw = mixture_weights(len(pieces), r.context_scores if r.context else None, self.temperature)
            sub = [Request(list(p) + r.input_ids, r.num_targets) for p in pieces]
            logps = torch.stack(self.inner.score(sub))  # (K, n)
            results.append(torch.logsumexp(logps + logw[:, None], dim=0))
        return results

    @torch.no_grad()
    def generate(self, request: Request, **sampling: Any) -> list[int]:
        if sampling.get("do_sample"):
            raise ValueError("replug generation is greedy only; set sampling off for this method")
        pieces = [p for p in request.context] or [[]]
        logw = mixture_weights(
            len(pieces), request.context_scores if request.context else None, self.temperature
        ).to(self.device)
        rows = [list(p) + request.input_ids for p in pieces]
        width = max(len(x) for x in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long, device=self.device)
        mask = torch.zeros((len(rows), width), dtype=torch.long, device=self.device)
        for i, x in enumerate(rows):  # left padding: every row ends at the same column
            ids[i, width - len(x) :] = torch.tensor(x, device=self.device)
            mask[i, width - len(x) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        stops, new, past = self._stops(request), [], None
        step_ids = ids
        for _ in range(request.max_new_tokens):
            with self.autocast():
                out = self.decoder(
                    input_ids=step_ids,
                    attention_mask=mask,
                    position_ids=pos,
                    past_key_values=past,
                    use_cache=True,
                    logits_to_keep=1,
                )
            past = out.past_key_values
            logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)  # (K, V)
            tok = int(torch.logsumexp(logp + logw[:, None], dim=0).argmax())
            if tok in stops:
                break
            new.append(tok)
            step_ids = torch.full((len(rows), 1), tok, dtype=torch.long, device=self.device)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            pos = pos[:, -1:] + 1
        return new
