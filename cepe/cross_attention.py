"""Cross-attention from the decoder stream to the encoder states Φ, and its generation caches.

Computation (matching the released checkpoints): ``q = q_proj(RMSNorm(h))``, ``k = k_proj(Φ)``,
``v = v_proj(Φ)``, GQA, no rotary embedding, scale ``1/sqrt(hd)``, fp32 softmax, ``o_proj``; padded
encoder positions are masked as keys; an example with no context gets exactly zero.

Cache modes for generation:
- ``"kv"``: K/V projected once per prompt, cached per layer (fastest decode, most memory); with autograd
  on (training, gradient checkpointing) nothing is cached and it computes what ``"states"`` does.
- ``"states"``: only Φ is kept; K/V are re-projected at every step (the reference code's behaviour).
- ``"absorbed"``: only Φ is kept; ``k_proj`` is folded into the query and ``v_proj`` applied after
  the attention-weighted sum of Φ, so no per-layer K/V is ever materialised.

Shape legend: B batch, T query tokens, S encoder tokens, D_dec / D_enc widths, H / KV heads, hd head dim.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from .layers import ATTENTION_KERNELS, RMSNorm, attention_sdpa, attention_sdpa_lse, norm_scale
from .mixture import CopySpans, Successors


@dataclass
class CrossContext:
    """The encoder output that every cross-attention layer reads during one forward or generate call.

    Attributes:
        states: Φ ``(B, S, D_enc)``.
        key_mask: ``(B, S)`` bool (True = real token), or None when every position is real.
        mode: cache mode, ``"kv" | "states" | "absorbed"``.
        impl: attention kernel, ``"sdpa" | "eager"``.
        q_scale: ``(B, 1, 1, 1)`` score multipliers (long-input scaling), or None.
        log_n: ``(B,)`` fp32 log of each example's real context tokens (at least 1), kept only for
            ``CepeConfig.length_scale``; None otherwise.
        has_context: ``(B, 1, 1)`` 1.0 where the example has at least one real key, else 0.0; None = all.
        out_scale: multiplier on every layer's output (``CepeConfig.context_scale``).
        kv: per-layer cache of projected ``(K, V)`` (mode ``"kv"``).
        match_kv: per-layer cache of the match-strength keys (``CepeConfig.match_gate``, mode ``"kv"``).
        match_memo: per layer, the match statistics of its last call under autograd with the query and
            ``k_proj`` version they came from: gradient checkpointing runs each layer again in backward
            with the same query, and the statistics (no gradient) are then reused, not recomputed.
        read_state: per layer, where each head read at every decoder position so far
            (``CepeConfig.induction_gate``, ``run_bias``): ``(B, H, P)`` long, entry ``i`` the key the query
            at position ``i`` attended to most (-1: padding, or not seen by this context), so that an
            incremental call starting after ``past ≤ P`` tokens continues from entry ``past − 1``: the call
            that follows, and also one on a cropped cache (assisted decoding) or another continuation of a
            shorter prefix, reads what a single call over the whole sequence reads (see :meth:`fork` for
            interleaved branches); kept only without autograd.
        read_memo: :attr:`match_memo` for the induction statistic and the run biases' successor keys.
        match_ids: ``(B, S)`` the context's token ids in order, -1 on padding (``CepeConfig.mix_match``:
            the output mixture's suffix-match inputs); None otherwise.
        match_order: K, the suffix lengths those inputs cover (0 = none).
        match_length: the head's length input follows the K indicators (``CepeConfig.mix_length``).
        match_length_cap: contexts longer than this many tokens read as this long in that input
            (``CepeConfig.mix_length_cap``; None: no cap).
        match_agree: the K successor agreements follow those (``CepeConfig.mix_agree``).
        match_copy: the output mixture copies after the longest matched suffix (``CepeConfig.mix_copy``).
        match_near: its copy head reads how far back each match lies (``CepeConfig.mix_copy_near``).
        match_decay: the copy's votes weighed by how far back each stands (``CepeConfig.mix_copy_decay``;
            0: each one vote).
        match_wrap: the suffixes hashed as adapters saved before the hash fix hash them
            (``CepeConfig.mix_hash`` ``"wrap"``; ``cepe.mixture.HASH_MODES``).
        mix_tail: the decoder's tokens so far ``(B, P)`` (-1 on padding and where unknown), by position, so
            that an incremental call starting after ``past ≤ P`` tokens takes the ``K - 1`` tokens before
            ``past`` from it (the call that follows, a cropped cache, another continuation of a shorter
            prefix); kept only without autograd.
        reads, base: in a context made by :meth:`with_decoder_rows`, the number of leading rows that read
            and the context of those rows alone: cross-attention runs over ``base`` for them and gives the
            other rows exactly zero, so the rows that read nothing cost nothing (None otherwise). Such a
            context serves ``2 × reads`` decoder rows over ``base``'s tensors (nothing is stored for the
            rows that read nothing).
    """

    states: torch.Tensor
    key_mask: torch.Tensor | None = None
    mode: str = "kv"
    impl: str = "sdpa"
    q_scale: torch.Tensor | None = None
    has_context: torch.Tensor | None = None
    out_scale: float = 1.0
    log_n: torch.Tensor | None = None
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    align: AlignProbe | None = None
    match_kv: dict[int, MatchKeys] = field(default_factory=dict)
    match_memo: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = field(default_factory=dict)
    read_state: dict[int, torch.Tensor] = field(default_factory=dict)
    read_memo: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = field(default_factory=dict)
    doubled: CrossContext | None = field(default=None, repr=False, compare=False)
    match_ids: torch.Tensor | None = None
    match_order: int = 0
    match_length: bool = False
    match_length_cap: int | None = None
    match_agree: bool = False
    match_copy: bool = False
    match_near: bool = False
    match_decay: float = 0.0
    match_wrap: bool = False
    mix_tail: torch.Tensor | None = None
    grams: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = field(
        default=None, repr=False, compare=False
    )
    successors: Successors | None = field(default=None, repr=False, compare=False)
    reads: int | None = None
    base: CrossContext | None = field(default=None, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        """Decoder rows this context serves."""
        return 2 * self.reads if self.base is not None else self.states.shape[0]

    def reorder(self, rows: torch.Tensor) -> None:
        """Follow a reordering of the decoder's rows (beam search): each layer's :attr:`read_state` row i
        becomes row ``rows[i]``'s, and so does the decoder's tail (:attr:`mix_tail`: the first rows, those
        that read the context, when the context was doubled for the output mixture)."""
        for layer, where in list(self.read_state.items()):
            self.read_state[layer] = where.index_select(0, rows.to(where.device))
        if self.mix_tail is not None:
            tail = self.mix_tail
            self.mix_tail = tail.index_select(0, rows[: tail.shape[0]].to(tail.device))
        if self.base is not None:  # the rows that read keep their layers' state in the base context
            self.base.reorder(rows[: self.reads])

    def fork(self) -> CrossContext:
        """This context with its own copy of the per-position history (:attr:`read_state`,
        :attr:`mix_tail`; the tensors are shared, nothing is copied): give each branch its own fork when
        several continuations of one prefix cache run interleaved (one branch's call after another's
        that went further than the branch point), since a context keeps one history, that of its last
        call. Branches run one after another need none: a call after ``past`` tokens reads the history
        before ``past`` only. A doubled context (the output mixture) forks with its base."""
        if self.base is not None:
            out = self.base.fork().with_decoder_rows()
            out.mix_tail, out.successors, out.grams = self.mix_tail, self.successors, self.grams
            return out
        # the projections (kv, match_kv) are the same: shared, not redone; histories are replaced, not
        # changed in place, by later calls
        out = dataclasses.replace(
            self, read_state=dict(self.read_state), read_memo={}, match_memo={}, doubled=None
        )
        if self.doubled is not None:  # the output mixture's suffix history lives in the doubled context
            d, mine = out.with_decoder_rows(), self.doubled
            d.mix_tail, d.successors, d.grams = mine.mix_tail, mine.successors, mine.grams
        return out

    def suffix_features(self, input_ids: torch.Tensor, past: int) -> torch.Tensor:
        """The suffix-match inputs ``(n, T, F)`` of the decoder rows ``input_ids`` ``(n, T)``: the features
        of :meth:`suffix_inputs`."""
        return self.suffix_inputs(input_ids, past)[0]

    def suffix_inputs(self, input_ids: torch.Tensor, past: int) -> tuple[torch.Tensor, CopySpans | None]:
        """The suffix-match inputs ``(n, T, K (+ 1) (+ K))`` of the decoder rows ``input_ids`` ``(n, T)``
        (the first ``n`` rows of this context), a call that starts after ``past`` decoder tokens, and with
        :attr:`match_copy` where each position's copy lies (``cepe.mixture.CopySpans`` ``(n, T)``; else
        None). The tokens before the call come from :attr:`mix_tail`, the tokens by position, when it
        holds ``past`` or more (a continuation, or a cropped cache); else they are unknown and match
        nothing, with a warning (:func:`warn_unknown_history`). Without autograd this call's tokens are
        kept after the first ``past``. The features: the K indicators, with :attr:`match_length` the context's length input, then
        with :attr:`match_agree` the K successor agreements (``cepe.mixture.head_inputs``)."""
        from cepe.mixture import (
            context_successors,
            copy_spans,
            grams_of,
            length_feature,
            suffix_agreement,
            suffix_hashes,
        )

        if self.match_ids is None or self.match_order < 1:
            raise ValueError(
                "the output mixture's suffix-match inputs (mix_match) need the context's token ids: give "
                "encoder_input_ids (with encoder_hidden_states: the token ids of the states' positions)"
            )
        n, k = input_ids.shape[0], self.match_order
        if self.successors is None or len(self.successors.keys) < n:  # one table: grams and copies
            ids = self.match_ids[:n]
            self.successors = context_successors(
                ids, ids >= 0, k, recency=self.match_near, decay=self.match_decay, wrap=self.match_wrap
            )
            self.grams = grams_of(self.successors)
        before = history_before(self.mix_tail, n, past)  # (n, past) or None
        if before is None and past > 0 and k > 1:
            warn_unknown_history("the output mixture's suffix matches (mix_match)", past, self.mix_tail)
        tail = None
        if before is not None and k > 1:  # the K - 1 tokens before the call, -1 before position 0
            tail = torch.cat([input_ids.new_full((n, k - 1), -1), before.to(input_ids.device)], dim=1)
            tail = tail[:, -(k - 1) :]
        hashes = suffix_hashes(input_ids, k, tail, self.match_wrap)  # per order (n, T)
        agree = suffix_agreement(input_ids, self.grams[:n], tail, hashes)  # (n, T, K)
        spans = None
        if self.match_copy:
            spans = copy_spans(input_ids, self.successors.rows(n), tail, hashes)
        feats = (agree > 0).float()
        if not torch.is_grad_enabled() and k > 1:
            if before is None:  # the tokens before this call are unknown
                before = input_ids.new_full((n, past), -1)
            self.mix_tail = torch.cat([before.to(input_ids.device), input_ids], dim=1)  # (n, past + T)
        if self.match_length:
            n_real = (self.match_ids[:n] >= 0).sum(-1)  # (n,) real context tokens
            if self.match_length_cap is not None:
                n_real = n_real.clamp_max(self.match_length_cap)
            col = length_feature(n_real).to(feats.device)[:, None, None].expand(n, feats.shape[1], 1)
            feats = torch.cat([feats, col], dim=-1)
        if self.match_agree:
            feats = torch.cat([feats, agree], dim=-1)
        return feats, spans

    def with_decoder_rows(self) -> CrossContext:
        """This context for a decoder batch of ``2B`` rows whose last ``B`` rows read nothing (the output
        mixture runs the decoder with and without the context in one batch): cross-attention runs over
        this context for the first ``B`` rows and gives the others exactly zero; nothing is copied (its
        tensors are this context's). Made once per context."""
        if self.base is not None:
            raise ValueError("this context is already doubled for the output mixture")
        if self.doubled is None:
            b = self.batch_size
            self.doubled = CrossContext(
                self.states,
                self.key_mask,
                self.mode,
                self.impl,
                self.q_scale,
                self.has_context,
                out_scale=self.out_scale,
                log_n=self.log_n,
                match_ids=self.match_ids,
                match_order=self.match_order,
                match_length=self.match_length,
                match_length_cap=self.match_length_cap,
                match_agree=self.match_agree,
                match_copy=self.match_copy,
                match_near=self.match_near,
                match_decay=self.match_decay,
                match_wrap=self.match_wrap,
                reads=b,
                base=self,
            )
        return self.doubled

    def expand(self, batch: int) -> CrossContext:
        """The context repeated for a batch of ``batch`` rows (beam search, several samples)."""
        if batch == self.batch_size:
            return self
        if batch % self.batch_size:
            raise ValueError(
                f"decoder batch {batch} is not a multiple of the context batch {self.batch_size}"
            )
        r = batch // self.batch_size
        if self.base is not None:  # doubled: the reading rows' context repeated, doubled again
            return self.base.expand(self.base.batch_size * r).with_decoder_rows()

        def rep(t):
            return None if t is None else t.repeat_interleave(r, dim=0)

        return CrossContext(
            rep(self.states),
            rep(self.key_mask),
            self.mode,
            self.impl,
            rep(self.q_scale),
            rep(self.has_context),
            out_scale=self.out_scale,
            log_n=rep(self.log_n),
            match_ids=rep(self.match_ids),
            match_order=self.match_order,
            match_length=self.match_length,
            match_length_cap=self.match_length_cap,
            match_agree=self.match_agree,
            match_copy=self.match_copy,
            match_near=self.match_near,
            match_decay=self.match_decay,
            match_wrap=self.match_wrap,
        )


def history_before(history: torch.Tensor | None, rows: int, past: int) -> torch.Tensor | None:
    """The first ``past`` positions ``(rows, ..., past)`` of a per-position history ``(rows, ..., P)``
    (``CrossContext.read_state``'s, ``mix_tail``), or None when there is nothing before (``past`` 0) or it
    does not hold them: no history, another number of rows, or fewer than ``past`` positions (the cache
    holds tokens this context did not see)."""
    if history is None or past == 0 or history.shape[0] != rows or history.shape[-1] < past:
        return None
    return history[..., :past]


def warn_unknown_history(what: str, past: int, history: torch.Tensor | None) -> None:
    """Warn that an incremental call after ``past`` decoder tokens finds no history of them in its context
    (``history``: what it holds), so ``what`` reads those tokens as unknown and the logits differ from a
    single call over the whole sequence."""
    import warnings

    held = "none" if history is None else f"{tuple(history.shape)}"
    warnings.warn(
        f"cepe: a call continues a cache of {past} decoder tokens, but this context has no record of them "
        f"(its history: {held}), so {what} treat them as unknown and the logits differ from one call over "
        "the whole sequence: pass the same cross_context to every call on that cache (model.generate "
        "does), starting from an empty cache",
        RuntimeWarning,
        stacklevel=3,
    )


@dataclass
class AlignProbe:
    """Attention supervision for training (the ``align_coef`` copy-warmup option): the first ``heads``
    query heads of the listed layers are asked to attend, from decoder position t, to encoder position
    ``targets[b, t]`` (the copy of the token that follows; -1 = no target).

    Attributes:
        targets: ``(B, T)`` long encoder positions (after key packing), -1 where unsupervised.
        heads: supervised query heads per layer (the first ones).
        layers: supervised decoder layer indices (None = every cross-attention layer).
        losses: one mean negative log attention probability per supervised layer, filled by the forward.
        reference: compute it by :func:`align_nll_ref` (every position's scores) instead of
            :func:`align_nll` (the supervised positions' alone).
    """

    targets: torch.Tensor
    heads: int = 1
    layers: frozenset[int] | None = None
    losses: list[torch.Tensor] = field(default_factory=list)
    reference: bool = False

    def wants(self, layer_idx: int) -> bool:
        return self.layers is None or layer_idx in self.layers

    def loss(self) -> torch.Tensor:
        """Mean over supervised layers (0 when none ran)."""
        if not self.losses:
            return self.targets.new_zeros((), dtype=torch.float32)
        return torch.stack(self.losses).mean()


def align_nll(
    q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None, scale: float, probe: AlignProbe
) -> torch.Tensor:
    """Mean ``-log p(attend to target)`` of the first ``probe.heads`` heads (fp32 scores), computed for the
    supervised positions alone: :func:`align_nll_ref`'s value and gradient without the ``(B, h, T, S)``
    scores of the positions that have no target (most of a batch of continuation examples; a batch
    without targets costs nothing).

    Args:
        q: ``(B, H, T, hd)``; k: ``(B, KV, S, hd)``; key_mask: ``(B, S)`` bool or None.
    """
    h = min(probe.heads, q.shape[1])
    groups = q.shape[1] // k.shape[1]
    tgt = probe.targets  # (B, T)
    valid = tgt >= 0
    count = int(valid.sum())
    if count == 0:  # 0, still connected to the graph, as the reference gives it
        return (q[:, :h].float().sum() + k.float().sum()) * 0.0
    heads = torch.arange(h, device=k.device) // groups  # the key head each supervised query head reads
    total = q.new_zeros((), dtype=torch.float32)
    for b in range(q.shape[0]):
        rows = valid[b].nonzero().squeeze(-1)  # (n,)
        if rows.numel() == 0:
            continue
        kb = k[b].index_select(0, heads).float()  # (h, S, hd)
        scores = (
            torch.matmul(q[b, :h].index_select(1, rows).float(), kb.transpose(-1, -2)) * scale
        )  # (h, n, S)
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask[b][None, None, :], torch.finfo(scores.dtype).min)
        logp = torch.log_softmax(scores, dim=-1)
        total = total + logp.gather(-1, tgt[b, rows][None, :, None].expand(h, -1, 1)).sum()
    return -total / (count * h)


def align_nll_ref(
    q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None, scale: float, probe: AlignProbe
) -> torch.Tensor:
    """:func:`align_nll`, the plain reference: the scores of every position, then the supervised ones picked.

    Args:
        q: ``(B, H, T, hd)``; k: ``(B, KV, S, hd)``; key_mask: ``(B, S)`` bool or None.
    """
    h = min(probe.heads, q.shape[1])
    groups = q.shape[1] // k.shape[1]
    kh = k.repeat_interleave(groups, dim=1)[:, :h] if groups > 1 else k[:, :h]  # (B, h, S, hd)
    scores = torch.matmul(q[:, :h].float(), kh.float().transpose(-1, -2)) * scale  # (B, h, T, S)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], torch.finfo(scores.dtype).min)
    logp = torch.log_softmax(scores, dim=-1)
    tgt = probe.targets  # (B, T)
    valid = tgt >= 0
    picked = logp.gather(-1, tgt.clamp_min(0)[:, None, :, None].expand(-1, h, -1, 1))[..., 0]  # (B, h, T)
    picked = picked * valid[:, None, :]
    return -picked.sum() / (valid.sum() * h).clamp_min(1)


MATCH_LOGIT_BOUND = 50.0  # |m| is clamped here: beyond it a gate's sigmoid is saturated anyway


def _match_features(m: torch.Tensor, e_s: torch.Tensor, log_n: torch.Tensor) -> torch.Tensor:
    """``(m, κ̂)`` ``(B, H, T, 2)`` from the log-mean-exp ``m`` and the expected score ``E_p[s]``."""
    m = m.clamp(-MATCH_LOGIT_BOUND, MATCH_LOGIT_BOUND)
    denom = log_n.clamp_min(math.log(2.0))[:, None, None]  # (B, 1, 1)
    return torch.stack([m, (e_s - m) / denom], dim=-1)


@torch.no_grad()
def match_stats_ref(
    q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """How strongly each head's query matches the context: the reference (explicit fp32 scores).

    For head h at token t with scores ``s_j = scale·q·k_j`` over the n real keys and ``p = softmax(s)``:
    ``m = logsumexp(s) − log n`` (the log-mean-exp: about 0 for scores that are all alike, large where a
    few keys stand out) and ``κ̂ = (log n − H(p)) / log n`` (the attention's concentration: 0 for uniform
    attention, 1 for all of it on one key). Carries no gradient (a sensor for ``CepeConfig.match_gate``).

    Args:
        q: ``(B, H, T, hd)``; k: ``(B, KV, S, hd)``; key_mask: ``(B, S)`` bool or None.

    Returns:
        ``(B, H, T, 2)`` fp32: ``(m, κ̂)``.
    """
    groups = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale  # (B, H, T, S)
    if key_mask is None:
        n = torch.full((q.shape[0],), k.shape[2], device=q.device)
    else:
        n = key_mask.sum(-1)
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    log_n = n.clamp_min(1).float().log()  # (B,)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    e_s = (p * scores.masked_fill(p == 0, 0.0)).sum(-1)
    return _match_features(lse - log_n[:, None, None], e_s, log_n)


@dataclass
class MatchKeys:
    """The keys and values that give :func:`match_stats_sdpa` its statistics from one fused attention.

    Real key j is ``[k_j, 0, 0]`` with value ``[k_j, 1, 0]``; key 0 is a "mean" key ``[0, 1, 0]`` with value
    ``[0, 0, 1]`` whose score is ``log n`` (the query carries ``log n / scale`` in that slot). Its attention
    share is then ``σ(−m)``, the real keys' share ``σ(m)``, and their value sum ``σ(m)·E_p[k]``.

    Attributes:
        k, v: ``(B, KV, 1 + S, hd + 2)`` in :func:`match_dtype` (the autocast dtype under autocast: the
            fused attention would cast fp32 keys to it anyway, so this only saves the copies).
        mask: ``(B, 1 + S)`` bool or None.
        log_n: ``(B,)`` log of the number of real keys (at least 1).
    """

    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    log_n: torch.Tensor

    @classmethod
    @torch.no_grad()
    def build(cls, k: torch.Tensor, key_mask: torch.Tensor | None) -> MatchKeys:
        """From the real keys ``(B, KV, S, hd)`` and their mask ``(B, S)``, in :func:`match_dtype`."""
        b, kvh, s, hd = k.shape
        ka = k.new_zeros(b, kvh, 1 + s, hd + 2, dtype=match_dtype(k.device))
        va = torch.zeros_like(ka)
        ka[:, :, 0, hd] = 1.0
        va[:, :, 0, hd + 1] = 1.0
        ka[:, :, 1:, :hd] = k
        va[:, :, 1:, :hd] = k
        va[:, :, 1:, hd] = 1.0
        if key_mask is None:
            n = torch.full((b,), s, device=k.device)
            mask = None
        else:
            n = key_mask.sum(-1)
            mask = torch.cat([key_mask.new_ones(b, 1), key_mask], dim=1)
        return cls(ka, va, mask, n.clamp_min(1).float().log())


def match_dtype(device: torch.device) -> torch.dtype:
    """The dtype the match statistics' attention runs in: the autocast dtype under autocast (where the
    attention would cast its fp32 inputs to it anyway), else fp32."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return torch.float32


@torch.no_grad()
def match_stats_sdpa(q: torch.Tensor, keys: MatchKeys, scale: float) -> torch.Tensor:
    """:func:`match_stats_ref` from one fused attention over :class:`MatchKeys` (no ``(T, S)`` scores kept).
    Under autocast that attention runs in the autocast dtype, as the layer's own attention does.

    Args:
        q: ``(B, H, T, hd)``.

    Returns:
        ``(B, H, T, 2)`` fp32: ``(m, κ̂)``.
    """
    b, h, t, hd = q.shape
    qf = q.float()
    qa = q.new_zeros(b, h, t, hd + 2, dtype=keys.k.dtype)
    qa[..., :hd] = qf  # (rounded as autocast would round the fp32 query)
    qa[..., hd] = (keys.log_n / scale)[:, None, None]
    o = attention_sdpa(qa, keys.k, keys.v, keys.mask, scale)  # (B, H, T, hd + 2)
    real = o[..., hd].clamp_min(1e-30)  # σ(m)
    mean = o[..., hd + 1].clamp_min(1e-30)  # σ(−m)
    e_s = scale * (qf * o[..., :hd]).sum(-1) / real
    return _match_features(real.log() - mean.log(), e_s, keys.log_n)


READ_CHUNK = 1 << 24  # scores held at once by :func:`induction_stats` (per chunk of queries)


def next_keys(key_mask: torch.Tensor | None, b: int, s: int, device: torch.device) -> torch.Tensor:
    """``(B, S)`` long: for every key, the index of the next real key after it (-1 where none): the text's
    next token, since chunks are laid out in order and packing keeps real keys in order."""
    idx = torch.arange(s, device=device)
    if key_mask is None:
        nxt = idx + 1
        nxt = torch.where(nxt < s, nxt, torch.full_like(nxt, -1))
        return nxt[None].expand(b, -1)
    pos = torch.where(key_mask, idx[None], torch.full_like(idx[None], s))  # (B, S): s = not real
    after = torch.cat([pos[:, 1:], pos.new_full((b, 1), s)], dim=1)
    nxt = after.flip(-1).cummin(-1).values.flip(-1)  # first real index > j
    return torch.where(nxt < s, nxt, torch.full_like(nxt, -1))


def successor_keys(
    best: torch.Tensor, prev: torch.Tensor | None, key_mask: torch.Tensor | None, s: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each query's previous query read, and the real key after it.

    Args:
        best: ``(B, H, T)`` long, the key each query attended to most (``j*_t``).
        prev: ``(B, H)`` long, the previous call's last ``j*`` (generation), or None.
        key_mask: ``(B, S)`` bool or None; s: S.

    Returns:
        ``(before, succ)``, both ``(B, H, T)`` long: ``j*_{t-1}`` (-1 where there is no previous token) and
        ``j⁺``, the real key after it (-1 where there is no previous token or it read the last real key).
    """
    b, h, t = best.shape
    before = best.new_full((b, h, 1), -1) if prev is None else prev[..., None]
    before = torch.cat([before, best[..., :-1]], dim=-1)  # (B, H, T): where the previous query read
    nxt = next_keys(key_mask, b, s, best.device)  # (B, S)
    succ = nxt.gather(1, before.clamp_min(0).reshape(b, -1)).view(b, h, t)
    return before, torch.where(before >= 0, succ, torch.full_like(succ, -1))


def gather_keys(x: torch.Tensor, idx: torch.Tensor, groups: int) -> torch.Tensor:
    """``x`` ``(B, KV, S, d)`` at the keys ``idx`` ``(B, H, T)`` (clamped at 0) of each query head, whose KV
    head is ``h // groups``: ``(B, H, T, d)``."""
    b, h, _ = idx.shape
    rows = torch.arange(b, device=x.device)[:, None, None]
    kv_head = (torch.arange(h, device=x.device) // groups)[None, :, None]
    return x[rows, kv_head, idx.clamp_min(0)]


def _induction_feature(
    q: torch.Tensor,
    k: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
    lse: torch.Tensor,
    best: torch.Tensor,
    prev: torch.Tensor | None,
) -> torch.Tensor:
    """``ι̂`` ``(B, H, T)`` fp32 from each query's logsumexp ``lse`` and most-attended key ``best`` (both
    ``(B, H, T)``) and the previous call's last ``best`` ``prev`` ``(B, H)`` (None: no previous token)."""
    b, h, t, hd = q.shape
    s = k.shape[2]
    n = torch.full((b,), s, device=q.device) if key_mask is None else key_mask.sum(-1)
    log_n = n.clamp_min(1).float().log()[:, None, None]  # (B, 1, 1)
    before, succ = successor_keys(best, prev, key_mask, s)
    ks = gather_keys(k.float(), succ, h // k.shape[1])  # (B, H, T, hd)
    score = scale * (q.float() * ks).sum(-1)  # (B, H, T): the query's score on the successor
    feat = ((score - lse + log_n) / log_n.clamp_min(math.log(2.0))).clamp(-1.0, 1.0)
    feat = torch.where(succ >= 0, feat, torch.full_like(feat, -1.0))  # read the last key: nothing follows
    return torch.where(before >= 0, feat, torch.zeros_like(feat))  # no previous token: no evidence


@torch.no_grad()
def induction_stats_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
    prev: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether each head's reading continues a run through the context: the reference (fp32 scores).

    With ``p_t = softmax(s_t)`` head h's attention at token t over the n real keys, ``j*_{t-1}`` the key
    its previous token's query attended to most and ``j⁺`` the real key after it (the text's next token):
    ``ι̂_t = clamp(log(n · p_t(j⁺)) / log n, −1, 1)``: 1 when the head now reads the token after the one
    it read before (a copy going on: an induction step), 0 for uniform attention, −1 when it reads
    elsewhere; 0 where there is no previous token (the first token of a call with no ``prev``) and −1
    where ``j*_{t-1}`` is the last real key. Carries no gradient (a sensor for
    ``CepeConfig.induction_gate``).

    Args:
        q: ``(B, H, T, hd)``; k: ``(B, KV, S, hd)``; key_mask: ``(B, S)`` bool or None.
        prev: ``(B, H)`` long, the previous call's last ``j*`` (generation), or None.

    Returns:
        ``(ι̂ (B, H, T) fp32, j*_{T-1} (B, H) long)``.
    """
    best, lse = best_keys_ref(q, k, key_mask, scale)
    return _induction_feature(q, k, key_mask, scale, lse, best, prev), best[..., -1]


@torch.no_grad()
def induction_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
    prev: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`induction_stats_ref` with the scores in the inputs' dtype, grouped by KV head (no repeated
    keys) and computed for a chunk of queries at a time (:func:`best_keys`).

    ``lse``: each query's logsumexp ``(B, H, T)`` over the real keys where the caller has it already (the
    match statistics' ``m + log n``): only the argmax is then taken from the scores, the costly fp32
    logsumexp pass is skipped."""
    best, own = best_keys(q, k, key_mask, scale, need_lse=lse is None)
    lse_t = own if lse is None else lse.float()
    return _induction_feature(q, k, key_mask, scale, lse_t, best, prev), best[..., -1]


@torch.no_grad()
def best_keys_ref(
    q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's most-attended real key ``j*`` ``(B, H, T)`` long and its logsumexp ``(B, H, T)`` fp32
    over the real keys, from fp32 scores (the reference)."""
    groups = q.shape[1] // k.shape[1]
    scores = torch.matmul(q.float(), k.float().repeat_interleave(groups, dim=1).transpose(-1, -2)) * scale
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return scores.argmax(-1), torch.logsumexp(scores, dim=-1)


@torch.no_grad()
def best_keys(
    q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None, scale: float, need_lse: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`best_keys_ref` with the scores in the keys' dtype, grouped by KV head (no repeated keys), a
    chunk of queries at a time (at most :data:`READ_CHUNK` scores held); the logsumexp only if
    ``need_lse`` (else None)."""
    b, h, t, hd = q.shape
    kvh, s = k.shape[1], k.shape[2]
    g = h // kvh
    qg = q.to(k.dtype).reshape(b, kvh, g, t, hd)
    step = max(1, READ_CHUNK // max(1, b * h * s))
    sums, best = [], []
    masked = None if key_mask is None else ~key_mask[:, None, None, :]
    for t0 in range(0, t, step):
        qc = qg[:, :, :, t0 : t0 + step]
        tc = qc.shape[3]
        sc = torch.matmul(qc.reshape(b, kvh, g * tc, hd), k.transpose(-1, -2))  # (B, KV, G·Tc, S)
        sc.mul_(scale)
        if masked is not None:
            sc.masked_fill_(masked, float("-inf"))
        # max's indices are argmax's (the first of equal maxima) at a quarter of its time on CPU (bf16)
        best.append(sc.max(-1).indices.view(b, h, tc))
        if need_lse:
            sums.append(torch.logsumexp(sc.float(), dim=-1).view(b, h, tc))
    return torch.cat(best, dim=-1), torch.cat(sums, dim=-1) if need_lse else None


class KeysLogsumexp(torch.autograd.Function):
    """Each query's logsumexp over the keys ``k`` (those ``key_mask`` allows), ``(B, H, T)`` fp32, with its
    exact gradient, never holding more than :data:`READ_CHUNK` scores: forward and backward recompute
    them a chunk of queries at a time, the products in the keys' dtype (bf16 under autocast, as the
    fused kernel's), exponentials and sums in fp32: ``∂lse_t/∂q_t = scale·Σ_j p_tj k_j``,
    ``∂lse_t/∂k_j = scale·p_tj q_t``.

    ``apply(q (B, H, T, hd), k (B, KV, S, hd), key_mask (B, S) bool or None, scale)``: where the fused CPU
    kernel runs, :func:`cepe.layers.attention_sdpa_lse` gives the same with no pass of its own."""

    @staticmethod
    def _chunks(q, k, key_mask, scale):
        b, h, t, hd = q.shape
        kvh, s = k.shape[1], k.shape[2]
        g = h // kvh
        qg = q.to(k.dtype).reshape(b, kvh, g, t, hd)
        step = max(1, READ_CHUNK // max(1, b * h * s))
        masked = None if key_mask is None else ~key_mask[:, None, None, :]
        for t0 in range(0, t, step):
            qc = qg[:, :, :, t0 : t0 + step]
            tc = qc.shape[3]
            qc = qc.reshape(b, kvh, g * tc, hd)
            sc = torch.matmul(qc, k.transpose(-1, -2)).float().mul_(scale)  # (B, KV, G·Tc, S)
            if masked is not None:
                sc.masked_fill_(masked, float("-inf"))
            yield t0, tc, qc, sc

    @staticmethod
    def forward(ctx, q, k, key_mask, scale):
        b, h = q.shape[:2]
        parts = [
            torch.logsumexp(sc, dim=-1).view(b, h, tc)
            for _, tc, _, sc in KeysLogsumexp._chunks(q, k, key_mask, scale)
        ]
        lse = torch.cat(parts, dim=-1)
        ctx.save_for_backward(q, k, key_mask, lse)
        ctx.scale = scale
        return lse

    @staticmethod
    def backward(ctx, grad):
        q, k, key_mask, lse = ctx.saved_tensors
        b, h, t, hd = q.shape
        kvh = k.shape[1]
        g = h // kvh
        grad_g = grad.float().reshape(b, kvh, g, t)
        lse_g = lse.reshape(b, kvh, g, t)
        dq = torch.empty(b, kvh, g, t, hd, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        for t0, tc, qc, sc in KeysLogsumexp._chunks(q, k, key_mask, ctx.scale):
            w = grad_g[:, :, :, t0 : t0 + tc].reshape(b, kvh, g * tc, 1)
            p = torch.exp(sc - lse_g[:, :, :, t0 : t0 + tc].reshape(b, kvh, g * tc, 1))  # (B, KV, G·Tc, S)
            p.mul_(w * ctx.scale)
            p = p.to(k.dtype)
            dq[:, :, :, t0 : t0 + tc] = torch.matmul(p, k).view(b, kvh, g, tc, hd)
            dk += torch.matmul(p.transpose(-1, -2), qc)
        return dq.view(b, h, t, hd).to(q.dtype), dk.to(k.dtype), None, None


def zero_linear(d_in: int, d_out: int, like: torch.Tensor) -> nn.Linear:
    """A ``Linear(d_in, d_out)`` with bias, all zero, on ``like``'s device and dtype (a gate that starts
    exactly at 1)."""
    lin = nn.Linear(d_in, d_out, bias=True, device=like.device, dtype=like.dtype)
    with torch.no_grad():
        lin.weight.zero_()
        lin.bias.zero_()
    return lin


class CrossAttention(nn.Module):
    """One cross-attention block; returns the update ``o_proj(attn(...))`` to add to the residual stream.

    Parameter names follow the released checkpoints: ``layernorm``, ``q_proj``, ``k_proj``, ``v_proj``,
    ``o_proj`` (no biases).
    """

    def __init__(
        self,
        decoder_hidden: int,
        encoder_hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        layer_idx: int,
        gated: bool = False,
        qk_norm: bool = False,
        null_key: bool = False,
        token_gate: bool = False,
        match_gate: bool = False,
        length_scale: int | None = None,
        length_scale_below: bool = False,
        length_scale_above: bool = False,
        short_gate: bool = False,
        long_gate: bool = False,
        induction_gate: bool = False,
        run_bias: bool = False,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_idx = layer_idx
        self.scale = 1.0 / math.sqrt(head_dim)
        self.layernorm = RMSNorm(decoder_hidden, eps)
        self.q_proj = nn.Linear(decoder_hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(encoder_hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(encoder_hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, decoder_hidden, bias=False)
        # Per-head gate (init_mode "gate", Flamingo style but one gate per head): head h's output is
        # scaled by tanh(gate[h]) before o_proj, zero at init, so copied heads that already help can
        # turn on one by one.
        self.gate = nn.Parameter(torch.zeros(num_heads)) if gated else None
        # Decoders whose self-attention normalises every query and key head (Qwen 3, Gemma 3) get the
        # same per-head norms here (copied at init), so copied q/k live on the scale their weights expect.
        # A learned "no match" key per KV head whose value is zero (``CepeConfig.null_key``): a query
        # that finds nothing in the context can put its attention there, and the head adds less (only
        # its softmax share over the real keys): head h's output is attn(real keys) · σ(lse − q·n_h).
        self.null_key = nn.Parameter(torch.zeros(num_kv_heads, head_dim)) if null_key else None
        # A per-token, per-head strength (``CepeConfig.token_gate``): head h's output is scaled by
        # 2·σ(w_h·RMSNorm(h_t) + b_h), exactly 1 at its zero init, so each token can read less (or more)
        # of the context than the head's fixed strength gives.
        self.token_gate = zero_linear(decoder_hidden, num_heads, self.q_proj.weight) if token_gate else None
        # A per-token, per-head strength from how strongly the head's query matches the context
        # (``CepeConfig.match_gate``): head h's output is scaled by 2·σ(a_h·m + c_h·κ̂ + b_h) (its logit added
        # to the token gate's), from the log-mean-exp m of its scores and its attention's concentration κ̂
        # (:func:`match_stats_ref`), each standardised by ``match_norm``; rows (a, c, b), zero: exactly 1 at
        # init.
        self.match_gate = nn.Parameter(torch.zeros(num_heads, 3)) if match_gate else None
        if match_gate:
            self.add_match_norm()
        self.match_record: list[torch.Tensor] | None = None  # set by CepeForCausalLM.calibrate_match_gate
        # A per-head exponent of the context's length (``CepeConfig.length_scale``): head h's query is
        # scaled by (n / length_scale)^τ_h, τ zero at init (exactly 1).
        self.length_exp = nn.Parameter(torch.zeros(num_heads)) if length_scale else None
        self.length_ref = float(length_scale or 0)
        self.length_below = bool(length_scale_below)  # n capped at length_ref: longer contexts unscaled
        # ``CepeConfig.length_scale_above``: longer contexts' own exponent τ'_h, times
        # (max(n, length_ref) / length_ref)^τ'_h, zero at init.
        self.length_exp_above = (
            nn.Parameter(torch.zeros(num_heads)) if length_scale and length_scale_above else None
        )
        # Gates for contexts shorter than the pivot (``CepeConfig.short_gate``): a token gate and, with
        # match gates, weights on their statistics, whose logit is multiplied by max(0, log(length_ref / n)):
        # zero at init and at contexts of length_ref tokens or more; and their mirror for longer contexts
        # (``CepeConfig.long_gate``), times max(0, log(n / length_ref)), zero at length_ref tokens or fewer.
        self.short_gate: nn.Linear | None = None
        self.short_match: nn.Parameter | None = None
        self.long_gate: nn.Linear | None = None
        self.long_match: nn.Parameter | None = None
        for side, on in (("short", short_gate), ("long", long_gate)):
            if on:
                if not length_scale:
                    raise ValueError(
                        f"{side}_gate needs length_scale (the pivot on whose side the gates act)"
                    )
                self.add_side_gate(side)
        # A per-head weight on whether the head's reading continues a run through the context
        # (``CepeConfig.induction_gate``): its logit w_h·ι̂ (:func:`induction_stats_ref`) is added to the
        # other gates' (or gives 2·σ(w_h·ι̂) alone); zero at init, exactly 1.
        self.induction_gate = nn.Parameter(torch.zeros(num_heads)) if induction_gate else None
        self.induction_record: list[torch.Tensor] | None = None  # (B, H, T) features, for probes
        # A per-head bias β_h on the score of the key after the one the head's previous query attended to
        # most (``CepeConfig.run_bias``): a copy in progress is continued where the current token alone
        # matches many keys; zero at init, exactly the layer without it.
        self.run_bias = nn.Parameter(torch.zeros(num_heads)) if run_bias else None
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def project_kv(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Φ ``(B, S, D_enc)`` -> K, V ``(B, KV, S, hd)``."""
        b, s, _ = states.shape
        k = self.k_proj(states).view(b, s, self.num_kv, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = self.v_proj(states).view(b, s, self.num_kv, self.head_dim).transpose(1, 2)
        return k.transpose(1, 2), v

    def forward(
        self, hidden: torch.Tensor, ctx: CrossContext, past: int = 0, pad: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``hidden`` ``(B, T, D_dec)`` (residual stream after self-attention) -> update ``(B, T, D_dec)``.

        ``past``: decoder tokens already in the self-attention cache (an incremental call continues a
        sequence from there: the induction gates then carry on from the previous call). ``pad``: ``(B, T)``
        bool, True on padding columns (a left-padded batch), whose queries count as no previous token for
        the next (induction gates, run biases); None: every column is a token.
        """
        if ctx.base is not None:  # the output mixture's doubled batch: only the first rows read
            n = int(ctx.reads)
            upd = self.forward(hidden[:n], ctx.base, past, None if pad is None else pad[:n])  # (n, T, D_dec)
            return torch.cat([upd, upd.new_zeros((hidden.shape[0] - n, *upd.shape[1:]))])
        b, t, _ = hidden.shape
        normed = self.layernorm(hidden)
        q = self.q_proj(normed).view(b, t, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = q.transpose(1, 2)  # (B, H, T, hd)
        if ctx.q_scale is not None:
            q = q * ctx.q_scale.to(q.dtype)  # scales every score of that example
        if self.length_exp is not None:
            q = self.length_scaled(q, ctx)
        key_mask = ctx.key_mask
        match = induction = succ = None
        if (
            ctx.mode == "absorbed"
            and self.k_norm is None
            and self.null_key is None
            and self.match_gate is None
            and self.induction_gate is None
            and self.run_bias is None
            and (ctx.align is None or not ctx.align.wants(self.layer_idx))  # it scores the keys themselves
        ):
            out = self._absorbed(q, ctx.states.to(q.dtype), key_mask, ctx.impl)
        else:
            if ctx.mode == "kv" and not torch.is_grad_enabled():
                # Cached only without autograd: with it, every pass (gradient checkpointing recomputes
                # layers in backward) must project K/V itself so that gradients reach k/v_proj and Φ.
                if self.layer_idx not in ctx.kv:
                    # Stored contiguous in (B, KV, S, hd): the projection's (B, S, KV, hd) layout, read
                    # through a transpose, makes every later decode step's attention ~1.7x slower on CPU.
                    # A null key is stored with them (key 0), so decode steps copy nothing.
                    k, v = self.project_kv(ctx.states.to(q.dtype))
                    if self.null_key is not None:
                        k, v, _ = self.with_null_key(k, v, None)
                    ctx.kv[self.layer_idx] = (k.contiguous(), v.contiguous())
                k, v = ctx.kv[self.layer_idx]
                nulled = self.null_key is not None
            else:  # "states" (or "kv" under autograd; "absorbed" with per-head key norms or a null key,
                # which cannot be folded into the query): re-project at every call
                k, v = self.project_kv(ctx.states.to(q.dtype))
                nulled = False
            if ctx.align is not None and ctx.align.wants(self.layer_idx):  # over the real keys
                nll = align_nll_ref if ctx.align.reference else align_nll
                ctx.align.losses.append(nll(q, k[:, :, int(nulled) :], key_mask, self.scale, ctx.align))
            if self.match_gate is not None:  # over the real keys too
                match = self.match_stats(q, k[:, :, int(nulled) :], key_mask, ctx)
            if self.induction_gate is not None or self.run_bias is not None:  # (B, H, T) each
                induction, succ = self.read_stats(q, k[:, :, int(nulled) :], key_mask, ctx, past, match, pad)
            if nulled:  # the cache holds it already; the mask gains its column
                if key_mask is not None:
                    key_mask = torch.cat([key_mask.new_ones(key_mask.shape[0], 1), key_mask], dim=1)
            elif self.null_key is not None:
                k, v, key_mask = self.with_null_key(k, v, key_mask)
            if self.run_bias is None:
                out = ATTENTION_KERNELS[ctx.impl](q, k, v, key_mask, self.scale)  # (B, H, T, hd)
            else:  # real keys start after the null key, where there is one
                out = self.attend_run(q, k, v, key_mask, succ, int(self.null_key is not None), ctx.impl)
        if self.gate is not None:
            out = out * torch.tanh(self.gate).to(out.dtype)[None, :, None, None]
        logit = None  # (B, H, T) fp32
        if match is not None:  # (B, H, T, 2) statistics -> (B, H, T) fp32 logits
            if self.match_record is not None:  # rows with context only: (H, rows·T, 2)
                rows = match if ctx.has_context is None else match[ctx.has_context[:, 0, 0] > 0]
                self.match_record.append(rows.transpose(0, 1).reshape(self.num_heads, -1, 2))
            w, norm = self.match_gate.float(), self.match_norm.float()
            feats = (match - norm[None, :, None, 0::2]) / norm[None, :, None, 1::2]
            logit = (feats * w[None, :, None, :2]).sum(-1) + w[None, :, None, 2]
        if self.short_gate is not None or self.long_gate is not None:
            factors = self.side_factors(ctx)
            for gate, weights, factor in zip(
                (self.short_gate, self.long_gate), (self.short_match, self.long_match), factors
            ):
                if gate is None:
                    continue
                side = gate(normed).float().transpose(1, 2)  # (B, H, T)
                if weights is not None:  # exists with match gates only, whose statistics ``feats`` are
                    side = side + (feats * weights.float()[None, :, None, :]).sum(-1)
                side = side * factor[:, None, None]
                logit = side if logit is None else logit + side
        if induction is not None:
            if self.induction_record is not None:  # rows with context only
                rows = induction if ctx.has_context is None else induction[ctx.has_context[:, 0, 0] > 0]
                self.induction_record.append(rows)
            run = induction * self.induction_gate.float()[None, :, None]
            logit = run if logit is None else logit + run
        if logit is not None:
            if self.token_gate is not None:
                # summed in the token gate's own (B, T, H) order, so that with the other gates at zero the
                # sigmoid sees the very tensor the token gate alone gives it: a vectorised sigmoid rounds
                # differently by position (a row's tail, a transposed view) on some CPUs (AVX2)
                logit = self.token_gate(normed).float() + logit.transpose(1, 2)  # (B, T, H)
                out = out * (2 * torch.sigmoid(logit)).to(out.dtype).transpose(1, 2)[..., None]
            else:
                out = out * (2 * torch.sigmoid(logit)).to(out.dtype)[..., None]
        elif self.token_gate is not None:  # (B, T, H) -> (B, H, T, 1)
            out = out * (2 * torch.sigmoid(self.token_gate(normed))).to(out.dtype).transpose(1, 2)[..., None]
        out = self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        if ctx.out_scale != 1.0:
            out = out * ctx.out_scale
        if ctx.has_context is not None:
            out = out * ctx.has_context.to(out.dtype)  # examples without context get exactly zero
        return out

    def side_factors(self, ctx: CrossContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The short and long gates' length features ``(B,)`` each, in fp32: ``max(0, log(length_ref / n))``
        and ``max(0, log(n / length_ref))``."""
        if ctx.log_n is None:
            raise ValueError(
                "short_gate / long_gate need the context's length: build the context with prepare_context"
            )
        r = ctx.log_n - math.log(self.length_ref)
        return (-r).clamp_min(0), r.clamp_min(0)

    def length_scaled(self, q: torch.Tensor, ctx: CrossContext) -> torch.Tensor:
        """``q`` ``(B, H, T, hd)`` times ``(n / length_ref)^τ_h`` per example and head (n at most ``length_ref``
        with ``length_below``) and, with ``length_exp_above``, ``(max(n, length_ref) / length_ref)^τ'_h``,
        in fp32, then back."""
        if ctx.log_n is None:
            raise ValueError(
                "length_scale needs the context's length: build the context with prepare_context"
            )
        log_ref = math.log(self.length_ref)
        log_n = ctx.log_n.clamp_max(log_ref) if self.length_below else ctx.log_n
        expo = self.length_exp.float()[None, :] * (log_n[:, None] - log_ref)  # (B, H)
        if self.length_exp_above is not None:
            expo = expo + self.length_exp_above.float()[None, :] * (ctx.log_n[:, None] - log_ref).clamp_min(0)
        return (q.float() * torch.exp(expo)[:, :, None, None]).to(q.dtype)

    def add_side_gate(self, side: str) -> None:
        """``{side}_gate`` ``Linear(D_dec, H)`` and, with match gates, ``{side}_match`` ``(H, 2)`` (rows a, c),
        zero, where missing; ``side`` is ``"short"`` (``CepeConfig.short_gate``) or ``"long"``."""
        w = self.q_proj.weight
        if getattr(self, f"{side}_gate") is None:
            setattr(self, f"{side}_gate", zero_linear(w.shape[1], self.num_heads, w))
        if self.match_gate is not None and getattr(self, f"{side}_match") is None:
            match = nn.Parameter(torch.zeros(self.num_heads, 2, device=w.device, dtype=w.dtype))
            setattr(self, f"{side}_match", match)

    def add_match_norm(self) -> None:
        """The match gate's feature standardisation ``(H, 4)``: rows ``(μ_m, σ_m, μ_κ, σ_κ)``, a saved
        buffer (``(0, 1, 0, 1)``: the raw features, until ``CepeForCausalLM.calibrate_match_gate``)."""
        w = self.q_proj.weight
        norm = torch.tensor([0.0, 1.0, 0.0, 1.0], device=w.device, dtype=w.dtype).repeat(self.num_heads, 1)
        self.register_buffer("match_norm", norm)

    def match_stats(
        self, q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None, ctx: CrossContext
    ) -> torch.Tensor:
        """``(m, κ̂)`` ``(B, H, T, 2)`` of the queries ``q`` against the real keys ``k`` (no gradient)."""
        if ctx.impl == "eager":
            return match_stats_ref(q, k, key_mask, self.scale)
        if not torch.is_grad_enabled():
            if ctx.mode != "kv":
                return match_stats_sdpa(q, MatchKeys.build(k, key_mask), self.scale)
            if self.layer_idx not in ctx.match_kv:
                ctx.match_kv[self.layer_idx] = MatchKeys.build(k, key_mask)
            return match_stats_sdpa(q, ctx.match_kv[self.layer_idx], self.scale)
        return self._once_per_query(
            ctx.match_memo, q, lambda: match_stats_sdpa(q, MatchKeys.build(k, key_mask), self.scale)
        )

    def _once_per_query(
        self,
        memo: dict[int, tuple[torch.Tensor, int, torch.Tensor]],
        q: torch.Tensor,
        compute: Callable[[], torch.Tensor],
    ) -> torch.Tensor:
        """A no-gradient statistic of the queries ``q``, computed under autograd at most once per query:
        gradient checkpointing recomputes this layer in backward with the same query and keys (same
        context, same ``k_proj`` version), and the first call's result, kept in ``memo`` (this layer's
        entry; ``CrossContext.match_memo`` or ``read_memo``), is then returned instead of ``compute()``."""
        version = self.k_proj.weight._version
        hit = memo.pop(self.layer_idx, None)
        if hit is not None and hit[1] == version and torch.equal(hit[0], q):  # (False on another shape)
            return hit[2]
        out = compute()
        memo[self.layer_idx] = (q.detach(), version, out)
        return out

    def read_stats(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        key_mask: torch.Tensor | None,
        ctx: CrossContext,
        past: int,
        match: torch.Tensor | None = None,
        pad: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Where the heads read (no gradient): ``ι̂`` ``(B, H, T)`` (:func:`induction_stats_ref`; None without
        induction gates) and ``j⁺`` ``(B, H, T)`` long, the real key after the one each head's previous query
        attended to most (:func:`successor_keys`; None without ``run_bias``), of the queries ``q`` against
        the real keys ``k``. An incremental call (``past`` > 0) continues from where this layer's heads read
        at the end of the previous call, when that call ended at ``past``; without autograd the end of this
        call is kept for the next (``CrossContext.read_state``). ``match``: the match statistics of the
        same queries, whose ``m + log n`` is the logsumexp the statistic needs (unclamped below
        :data:`MATCH_LOGIT_BOUND`). ``pad`` ``(B, T)``: padding columns, whose queries read nowhere (the
        next query has no previous token), so that a left-padded row reads as it does alone."""
        history = history_before(ctx.read_state.get(self.layer_idx), q.shape[0], past)  # (B, H, past)
        prev = None if history is None or past == 0 else history[..., past - 1]  # (B, H)
        if history is None and past > 0:
            warn_unknown_history("the induction gates / run biases", past, ctx.read_state.get(self.layer_idx))
        want_feat = self.induction_gate is not None

        @torch.no_grad()
        def compute() -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
            if ctx.impl == "eager":
                best, lse = best_keys_ref(q, k, key_mask, self.scale)
            else:
                lse = None
                if match is not None:
                    n = k.shape[2] if key_mask is None else key_mask.sum(-1)
                    log_n = torch.as_tensor(n, device=q.device).clamp_min(1).float().log().reshape(-1, 1, 1)
                    lse = match[..., 0] + log_n
                best, own = best_keys(q, k, key_mask, self.scale, need_lse=want_feat and lse is None)
                lse = own if lse is None else lse.float()
            if pad is not None:
                best = best.masked_fill(pad[:, None, :], -1)
            feat = _induction_feature(q, k, key_mask, self.scale, lse, best, prev) if want_feat else None
            succ = None if self.run_bias is None else successor_keys(best, prev, key_mask, k.shape[2])[1]
            return feat, succ, best

        if not torch.is_grad_enabled():
            feat, succ, best = compute()
            if history is None:  # where the heads read before this call is unknown
                history = best.new_full((*best.shape[:2], past), -1)
            ctx.read_state[self.layer_idx] = torch.cat([history.to(best.device), best], dim=-1)
            return feat, succ
        return self._once_per_query(ctx.read_memo, q, lambda: compute()[:2])

    def attend_run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_mask: torch.Tensor | None,
        succ: torch.Tensor,
        offset: int,
        impl: str,
    ) -> torch.Tensor:
        """Attention with ``run_bias[h]`` added to each query's score on its key ``j⁺`` (``succ`` ``(B, H, T)``,
        an index into the real keys, which start at ``offset`` of ``k``; -1: no bias): ``(B, H, T, hd)``.

        The reference (``impl`` ``"eager"``) adds the bias to the full score matrix. The fast path runs the
        fused kernel unchanged and corrects its output in closed form: with ``p⁺`` the kernel's attention
        on ``j⁺`` and ``r = (e^β − 1)·p⁺``, the biased attention is ``(out + r·v⁺) / (1 + r)``; ``p⁺`` comes
        from the score on ``j⁺`` and the logsumexp over every key (:class:`KeysLogsumexp`, exact
        gradients; the fused kernel's own where it gives one, :func:`cepe.layers.attention_sdpa_lse`), so
        no ``(B, H, T, S)`` tensor is kept for backward."""
        idx = torch.where(succ >= 0, succ + offset, succ)  # (B, H, T) into k's keys
        beta = self.run_bias.float()[None, :, None]  # (1, H, 1)
        if impl == "eager":
            bias = torch.where(idx >= 0, beta, torch.zeros_like(beta)).expand(idx.shape)
            scores_bias = torch.zeros(*idx.shape, k.shape[2], device=q.device, dtype=torch.float32)
            scores_bias = scores_bias.scatter(-1, idx.clamp_min(0)[..., None], bias[..., None])
            return ATTENTION_KERNELS["eager"](q, k, v, key_mask, self.scale, bias=scores_bias)
        # (B, H, T) logsumexp over every key: the fused kernel's where it gives one (CPU), else its own pass
        out, lse = attention_sdpa_lse(q, k, v, key_mask, self.scale)
        if lse is None:
            lse = KeysLogsumexp.apply(q, k, key_mask, self.scale)
        groups = self.num_heads // self.num_kv
        score = self.scale * (q.float() * gather_keys(k, idx, groups).float()).sum(-1)
        p_next = torch.where(idx >= 0, torch.exp(score - lse), torch.zeros_like(score))
        r = torch.expm1(beta) * p_next  # (B, H, T): > -1 while j⁺ is not the only key with weight
        mixed = (out.float() + r[..., None] * gather_keys(v, idx, groups).float()) / (1 + r).clamp_min(1e-12)[
            ..., None
        ]
        return mixed.to(out.dtype)

    def with_null_key(
        self, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """K, V ``(B, KV, S, hd)`` and the key mask ``(B, S)`` with the null key (value 0) as key 0."""
        b = k.shape[0]
        nk = self.null_key.to(k.dtype)[None, :, None, :].expand(b, -1, 1, -1)  # (B, KV, 1, hd)
        k = torch.cat([nk, k], dim=2)
        v = torch.cat([v.new_zeros(b, v.shape[1], 1, v.shape[3]), v], dim=2)
        if key_mask is not None:
            key_mask = torch.cat([key_mask.new_ones(b, 1), key_mask], dim=1)
        return k, v, key_mask

    def _absorbed(
        self, q: torch.Tensor, states: torch.Tensor, key_mask: torch.Tensor | None, impl: str
    ) -> torch.Tensor:
        """Attention over Φ with ``k_proj`` folded into the query and ``v_proj`` applied afterwards.

        ``q·(W_k φ) = (W_kᵀ q)·φ`` and ``Σ p·(W_v φ) = W_v (Σ p·φ)``: all heads attend to the same
        keys Φ, so every query head is stacked along one query axis.
        """
        b, h, t, hd = q.shape
        groups = h // self.num_kv
        d_enc = states.shape[-1]
        wk = self.k_proj.weight.view(self.num_kv, hd, d_enc)  # (KV, hd, D_enc)
        wv = self.v_proj.weight.view(self.num_kv, hd, d_enc)
        qg = q.reshape(b, self.num_kv, groups * t, hd)  # (B, KV, G·T, hd)
        q_abs = torch.einsum("bkqd,kde->bkqe", qg, wk)  # (B, KV, G·T, D_enc)
        q_abs = q_abs.reshape(b, 1, self.num_kv * groups * t, d_enc)
        phi = states[:, None]  # (B, 1, S, D_enc)
        ctx_sum = ATTENTION_KERNELS[impl](q_abs, phi, phi, key_mask, self.scale)
        ctx_sum = ctx_sum.reshape(b, self.num_kv, groups * t, d_enc)  # Σ p·φ per head
        out = torch.einsum("bkqe,kde->bkqd", ctx_sum, wv)  # (B, KV, G·T, hd)
        return out.reshape(b, h, t, hd)

    @torch.no_grad()
    def init_from_self_attention(
        self,
        self_attn: nn.Module,
        mode: str,
        norm: torch.Tensor | None = None,
        fold: torch.Tensor | None = None,
    ) -> None:
        """Initialise from the layer's self-attention.

        q/k/v are copied (k/v: the first D_enc input columns); o_proj is zero (``mode="zero"``, the paper)
        or copied (``"copy"``, the released code; ``"gate"`` also copies it, behind a zero gate).

        Args:
            norm: ``(D_dec,)`` weight for the query norm (the released code copies the layer's
                ``post_attention_layernorm``); None gives ones.
            fold: ``(D_dec,)`` a decoder norm's weight folded into the k/v input columns, so that on
                unit-RMS states Φ the projections equal the self-attention's on that norm's output.
        """
        n = min(self.k_proj.weight.shape[1], self_attn.k_proj.weight.shape[1])  # D_enc (< D_dec in practice)
        self.q_proj.weight.copy_(self_attn.q_proj.weight)
        wk, wv = self_attn.k_proj.weight[:, :n], self_attn.v_proj.weight[:, :n]
        if fold is not None:
            wk, wv = wk * fold[:n].to(wk.dtype), wv * fold[:n].to(wv.dtype)
        self.k_proj.weight[:, :n].copy_(wk)
        self.v_proj.weight[:, :n].copy_(wv)
        self.layernorm.weight.copy_(norm if norm is not None else torch.ones_like(self.layernorm.weight))
        if mode == "zero":
            self.o_proj.weight.zero_()
        else:
            self.o_proj.weight.copy_(self_attn.o_proj.weight)
        zero_at_init = (
            self.gate,
            self.null_key,
            self.token_gate,
            self.match_gate,
            self.length_exp,
            self.length_exp_above,
            self.short_gate,
            self.short_match,
            self.long_gate,
            self.long_match,
            self.induction_gate,
            self.run_bias,
        )
        for part in (p for p in zero_at_init if p is not None):  # each exactly the layer without it at zero
            for w in part.parameters() if isinstance(part, nn.Module) else [part]:
                w.zero_()
        for name in ("q_norm", "k_norm"):
            mine, theirs = getattr(self, name), getattr(self_attn, name, None)
            if mine is not None:
                if theirs is None:
                    raise ValueError(f"cross-attention has {name} but the layer's self-attention has none")
                mine.weight.copy_(norm_scale(theirs))
