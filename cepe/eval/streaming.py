"""StreamingLLM baseline: attention sinks plus a window of recent tokens, with position shift.

The key/value cache keeps the first ``sink_tokens`` tokens and the latest ``recent_tokens`` tokens. The
input is read ``stride`` tokens at a time: each stride attends to the whole cache and causally to
itself, then the cache is cut back. Positions are cache positions, not text positions: after ``δ`` tokens
are evicted, the kept recent keys (stored already rotated by RoPE) are rotated by ``-δ`` so that the cache
always holds positions ``0 .. sink + recent - 1``, and new tokens continue from there. With a window that
covers the whole input nothing is evicted and the result equals full attention.

Works with RoPE decoders whose keys are rotated with the half-split convention (Llama, Mistral, Qwen2,
...) through ``model.model.rotary_emb``. The cache holds plain (unbounded) layers for every decoder, also
one whose config names a sliding window (Mistral, Gemma 2): a sliding-window cache layer counts every token
it was ever given as its length, so after an eviction the next tokens would take text positions and the
next eviction the wrong shift; the model's own window still applies, over cache positions.
Shape legend: B batch, KV key/value heads, T tokens, hd head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from cepe.eval.methods import Method, Request, check_targets, target_logprobs


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class StreamingLLM(Method):
    """StreamingLLM scoring and greedy generation for an HF RoPE decoder.

    Args:
        decoder: HF causal LM.
        sink_tokens: attention sinks kept at the start of the cache (paper setting 4).
        recent_tokens: most recent tokens kept (paper setting 2044).
        stride: tokens read per forward pass (1 = the token-by-token setting; paper evaluation 2048).
    """

    name = "streamingllm"

    def __init__(
        self,
        decoder: torch.nn.Module,
        sink_tokens: int = 4,
        recent_tokens: int = 2044,
        stride: int = 2048,
        **kwargs: Any,
    ):
        super().__init__(decoder, **kwargs)
        if sink_tokens < 0 or recent_tokens < 1 or stride < 1:
            raise ValueError("streamingllm needs sink_tokens >= 0, recent_tokens >= 1 and stride >= 1")
        self.sink, self.recent, self.stride = sink_tokens, recent_tokens, stride
        base = getattr(decoder, "model", None)
        rotary = getattr(base, "rotary_emb", None)
        if rotary is None or not hasattr(rotary, "inv_freq"):
            raise ValueError(
                f"streamingllm needs a RoPE decoder exposing model.rotary_emb.inv_freq; "
                f"{type(decoder).__name__} does not (use another baseline for this decoder)"
            )
        self.inv_freq = rotary.inv_freq

    def _rerotate(self, keys: torch.Tensor, shift: int) -> torch.Tensor:
        """Rotate RoPE-rotated keys ``(B, KV, T, hd)`` by ``-shift`` positions."""
        angle = -float(shift) * self.inv_freq.to(device=keys.device, dtype=torch.float32)
        emb = torch.cat((angle, angle), dim=-1)
        cos, sin = emb.cos().to(keys.dtype), emb.sin().to(keys.dtype)
        return keys * cos + _rotate_half(keys) * sin

    def _evict(self, cache: DynamicCache) -> None:
        size = cache.get_seq_length()
        budget = self.sink + self.recent
        if size <= budget:
            return
        shift = size - budget
        for layer in cache.layers:
            k, v = layer.keys, layer.values
            recent_k = self._rerotate(k[:, :, -self.recent :], shift)
            layer.keys = torch.cat([k[:, :, : self.sink], recent_k], dim=2).contiguous()
            layer.values = torch.cat([v[:, :, : self.sink], v[:, :, -self.recent :]], dim=2).contiguous()

    @staticmethod
    def _new_cache() -> DynamicCache:
        """An empty cache of plain layers, whose length is the keys it holds (see the module docstring)."""
        return DynamicCache()

    def _step(self, cache: DynamicCache, ids: torch.Tensor, keep: int) -> torch.Tensor | None:
        """Read ``ids`` ``(1, t)`` at the next cache positions; logits of the last ``keep`` positions."""
        start = cache.get_seq_length()
        pos = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0)
        with self.autocast():
            out = self.decoder(
                input_ids=ids,
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=max(keep, 1),
            )
        self._evict(cache)
        return out.logits if keep > 0 else None

    @torch.no_grad()
    def score(self, requests: list[Request]) -> list[torch.Tensor]:
        results = []
        for r in requests:
            check_targets(r)
            ids = torch.tensor([r.input_ids], device=self.device)
            total, n = ids.shape[1], r.num_targets
            first_needed = total - n - 1  # the logit at position p predicts token p + 1
            cache = self._new_cache()
            pieces = []
            for a in range(0, total, self.stride):
                b = min(a + self.stride, total)
                keep = b - max(a, first_needed) if b > first_needed else 0
                logits = self._step(cache, ids[:, a:b], keep)
                if logits is not None:
                    pieces.append(logits[0])
            pred = torch.cat(pieces)[:-1]  # drop the prediction after the last token
            results.append(target_logprobs(pred, ids[0, -n:]).cpu())
        return results

    @torch.no_grad()
    def generate(self, request: Request, **sampling: Any) -> list[int]:
        if sampling.get("do_sample"):
            raise ValueError("streamingllm generation is greedy only; set sampling off for this method")
        ids = torch.tensor([request.input_ids], device=self.device)
        cache = self._new_cache()
        logits = None
        for a in range(0, ids.shape[1], self.stride):
            b = min(a + self.stride, ids.shape[1])
            logits = self._step(cache, ids[:, a:b], 1 if b == ids.shape[1] else 0)
        stops, new = self._stops(request), []
        for _ in range(request.max_new_tokens):
            tok = int(logits[0, -1].float().argmax())
            if tok in stops:
                break
            new.append(tok)
            logits = self._step(cache, torch.tensor([[tok]], device=self.device), 1)
        return new
