"""Evaluation methods behind one interface: CEPE and the baselines of the paper.

Every task turns an example into a :class:`Request` per method (see :func:`standard_request`) and calls
:meth:`Method.score` (log-probabilities of the last ``num_targets`` tokens) or :meth:`Method.generate`
(greedy continuation). The methods:

- ``cepe``: ``input_ids`` in the decoder, every ``context`` piece through the encoder (pieces longer than
  the chunk length are split into several chunks);
- ``full`` / ``truncated``: decoder only; the task puts all context (full) or none (truncated) into
  ``input_ids``;
- ``streamingllm``: decoder only with attention sinks and a recent window (:mod:`cepe.eval.streaming`);
- ``replug``: one decoder pass per context piece prepended to the input, mixed (:mod:`cepe.eval.replug`).

Shape legend: B batch, K chunks, L chunk length, T tokens, V vocabulary.
Logits are computed only on the positions that predict a scored token (``logits_to_keep``) and turned
into fp32 log-probabilities.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cepe.eval.config import METHODS


@dataclass
class Request:
    """One model call.

    Attributes:
        input_ids: decoder input tokens ``(T,)``.
        num_targets: score the last ``num_targets`` tokens of ``input_ids`` (0 for generation).
        context: context pieces (encoder chunks for CEPE, prepended pieces for REPLUG), in reading order.
        context_scores: retriever scores, one per piece (REPLUG weights); ``None`` means uniform.
        max_new_tokens: tokens to generate (generation only).
        stop_ids: token ids that end generation (besides the tokenizer's end of sequence).
    """

    input_ids: list[int]
    num_targets: int = 0
    context: list[list[int]] = field(default_factory=list)
    context_scores: list[float] | None = None
    max_new_tokens: int = 0
    stop_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens the request feeds to the model (context + input)."""
        return len(self.input_ids) + sum(len(c) for c in self.context)


def standard_request(
    method: str,
    pieces: Sequence[Sequence[int]],
    decoder_ids: Sequence[int],
    num_targets: int = 0,
    scores: Sequence[float] | None = None,
    **kwargs: Any,
) -> Request:
    """The usual mapping of (context pieces, decoder input) onto a method.

    ``full`` and ``streamingllm`` read ``concat(pieces) + decoder_ids`` in the decoder, ``truncated`` only
    ``decoder_ids``, ``cepe`` and ``replug`` get the pieces as context.
    """
    dec = list(decoder_ids)
    if method in ("full", "streamingllm"):
        flat = [t for p in pieces for t in p]
        return Request(flat + dec, num_targets, **kwargs)
    if method == "truncated":
        return Request(dec, num_targets, **kwargs)
    if method in ("cepe", "replug"):
        return Request(
            dec,
            num_targets,
            [list(p) for p in pieces],
            list(scores) if scores is not None else None,
            **kwargs,
        )
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def autocast_context(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast`` for ``dtype`` on ``device`` (no-op when ``dtype`` is None)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """fp32 log-probabilities of ``targets``.

    Args:
        logits: ``(..., N, V)`` predictions for the N target tokens.
        targets: ``(..., N)`` token ids.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


class Method:
    """Base class: holds the decoder and how to run it."""

    name = "method"

    def __init__(
        self,
        decoder: torch.nn.Module,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int = 0,
        autocast_dtype: torch.dtype | None = None,
        batch_size: int = 8,
    ):
        self.decoder = decoder
        eos = (
            [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
        )
        self.eos_ids = tuple(int(e) for e in eos)
        self.pad_token_id = int(pad_token_id)
        self.autocast_dtype = autocast_dtype
        self.batch_size = max(1, batch_size)

    @property
    def device(self) -> torch.device:
        return next(self.decoder.parameters()).device

    def autocast(self):
        return autocast_context(self.device, self.autocast_dtype)

    def score(self, requests: Sequence[Request]) -> list[torch.Tensor]:
        """Per request, fp32 log-probabilities ``(num_targets,)`` of its last ``num_targets`` tokens."""
        raise NotImplementedError

    def generate(self, request: Request) -> list[int]:
        """Greedy continuation of one request (new tokens only, stop token excluded)."""
        raise NotImplementedError

    def _stops(self, request: Request) -> set[int]:
        return set(self.eos_ids) | set(request.stop_ids)


def check_targets(r: Request) -> None:
    """Raise ``ValueError`` unless ``r`` scores between 1 and ``len(input_ids) - 1`` tokens."""
    if r.num_targets <= 0 or r.num_targets >= len(r.input_ids):
        raise ValueError(
            f"num_targets must be in [1, len(input_ids) - 1]; got {r.num_targets} for {len(r.input_ids)} "
            "input tokens (the first token has no prediction: give at least one token of prefix)"
        )


def _groups(requests: Sequence[Request], batch_size: int) -> list[list[int]]:
    """Indices of requests grouped by input length (no padding needed), at most ``batch_size`` each."""
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(requests):
        by_len[len(r.input_ids)].append(i)
    out = []
    for idx in by_len.values():
        out.extend(idx[s : s + batch_size] for s in range(0, len(idx), batch_size))
    return out


def _trim_stop(new: list[int], stops: set[int]) -> list[int]:
    for i, t in enumerate(new):
        if t in stops:
            return new[:i]
    return new


class DecoderMethod(Method):
    """Decoder only (the ``full`` and ``truncated`` baselines): ``input_ids`` is all the model sees."""

    name = "decoder"

    def _forward_logits(self, ids: torch.Tensor, keep: int, group: list[Request]) -> torch.Tensor:
        return self.decoder(input_ids=ids, logits_to_keep=keep, use_cache=False).logits

    @torch.no_grad()
    def score(self, requests: Sequence[Request]) -> list[torch.Tensor]:
        return [lp for lp, _ in self.score_with_greedy(requests)]

    @torch.no_grad()
    def score_with_greedy(self, requests: Sequence[Request]) -> list[tuple[torch.Tensor, bool]]:
        """Like :meth:`score`, plus whether every target token is the argmax of its prediction."""
        out: list[tuple[torch.Tensor, bool] | None] = [None] * len(requests)
        for idx in _groups(requests, self.batch_size):
            group = [requests[i] for i in idx]
            for r in group:
                check_targets(r)
            ids = torch.tensor([r.input_ids for r in group], device=self.device)
            n_max = max(r.num_targets for r in group)
            with self.autocast():
                logits = self._forward_logits(ids, n_max + 1, group)  # (B, n_max+1, V)
            for b, (i, r) in enumerate(zip(idx, group)):
                n = r.num_targets
                pred = logits[b, -(n + 1) : -1]
                greedy = bool((pred.argmax(-1) == ids[b, -n:]).all())
                out[i] = (target_logprobs(pred, ids[b, -n:]).cpu(), greedy)
        return out  # type: ignore[return-value]

    def _generate_kwargs(self, request: Request) -> dict[str, Any]:
        return {}

    @torch.no_grad()
    def generate(self, request: Request, **sampling: Any) -> list[int]:
        ids = torch.tensor([request.input_ids], device=self.device)
        stops = self._stops(request)
        kwargs: dict[str, Any] = {"do_sample": False, "num_beams": 1}
        kwargs.update(sampling)
        with self.autocast():
            seq = self._call_generate(
                ids,
                max_new_tokens=request.max_new_tokens,
                eos_token_id=sorted(stops) or None,
                pad_token_id=self.pad_token_id,
                attention_mask=torch.ones_like(ids),
                **self._generate_kwargs(request),
                **kwargs,
            )
        return _trim_stop(seq[0, ids.shape[1] :].tolist(), stops)

    def _call_generate(self, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.decoder.generate(ids, **kwargs)


class CepeMethod(DecoderMethod):
    """CEPE: ``input_ids`` in the decoder, context pieces as ``(K, L)`` encoder chunks."""

    name = "cepe"

    def __init__(self, model: torch.nn.Module, chunk_length: int | None = None, **kwargs: Any):
        super().__init__(model, **kwargs)
        self.model = model
        cfg = getattr(model, "cepe_config", None)
        self.chunk_length = int(chunk_length or getattr(cfg, "chunk_length", 0) or 256)

    def encoder_inputs(self, group: Sequence[Request]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(encoder_input_ids, encoder_attention_mask)`` ``(B, K, L)`` for a group, or None without
        context."""
        from cepe.chunking import chunk_ids, collate_chunks

        if all(not r.context for r in group):
            return None
        items = []
        for r in group:
            parts = [chunk_ids(p, self.chunk_length, pad_id=self.pad_token_id) for p in r.context if p]
            if parts:
                items.append((torch.cat([c for c, _ in parts]), torch.cat([m for _, m in parts])))
            else:
                empty = torch.zeros((0, self.chunk_length), dtype=torch.long)
                items.append((empty, empty.bool()))
        ids, mask = collate_chunks(items, pad_id=self.pad_token_id)
        return ids.to(self.device), mask.to(self.device)

    def _forward_logits(self, ids: torch.Tensor, keep: int, group: list[Request]) -> torch.Tensor:
        enc = self.encoder_inputs(group)
        kwargs: dict[str, Any] = {}
        if enc is not None:
            kwargs = {"encoder_input_ids": enc[0], "encoder_attention_mask": enc[1]}
        return self.model(input_ids=ids, logits_to_keep=keep, use_cache=False, **kwargs).logits

    def _generate_kwargs(self, request: Request) -> dict[str, Any]:
        enc = self.encoder_inputs([request])
        if enc is None:
            return {}
        return {"encoder_input_ids": enc[0], "encoder_attention_mask": enc[1]}

    def _call_generate(self, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.model.generate(ids, **kwargs)
