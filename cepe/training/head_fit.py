"""``cepe fit-heads``: the output mixture's heads fitted in full batch on recorded per-token statistics.

A stage that trains only the mixing head and the copy head (``train_only: [mix_head, copy_head]``) over a
frozen reader, with heads that read the suffix-match inputs and not the hidden states (``mix_hidden:
false``), has a loss that depends on the heads through a handful of numbers per scored token: each side's
log-probability of the target (with and without the context), the copy's probability of it, whether a
suffix occurs, and the heads' inputs. Those do not change while the heads train, so they are recorded once
(the recipe's own examples, layouts and compute dtype: the batches its first ``steps`` optimizer steps
read) and the heads are fitted on them to convergence by L-BFGS, instead of by tens of noisy AdamW steps.

Every ``held_out_every``-th example (by index) is held out of the fit and scored: the fitted heads, the
heads the recipe starts from, and the heads of other adapters over the same inputs or fewer (``compare``)
on the same tokens, by example kind and (continuation examples) by context length. Outputs in
``output_dir``: ``stats/`` (the records, one file per step: a rerun skips the steps recorded), ``adapter/``
(the model with the fitted heads), ``fit.json``, ``fit.md`` and ``fit.png`` (the objective by iteration).

Shape legend: N scored tokens, F a head's inputs.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cepe.alloc import purge

from .config import TASK_KINDS, TrainConfig
from .fit_config import HeadFitConfig

STATS_DIR = "stats"
RECORDS_FILE = "records.json"  # in the records folder: whose they are
HEADS = ("mix_head", "copy_head")


@dataclass
class TokenStats:
    """Everything the mixture's loss needs at N scored tokens, over a frozen reader.

    Attributes:
        x_mix: ``(N, F)`` the mixing head's inputs, as the head sees them (in the compute dtype's rounding).
        x_copy: ``(N, F')`` the copy head's inputs, or None without a copy head.
        lp_ctx, lp_dec: ``(N,)`` the target's log-probability with and without the context.
        p_copy: ``(N,)`` the copy's probability of the target (0 where no suffix occurs).
        has: ``(N,)`` bool, a suffix occurs (the copy takes part).
        task: ``(N,)`` long, the example's kind (index into ``TASK_KINDS``).
        example: ``(N,)`` long, the example's global index.
    """

    x_mix: torch.Tensor
    x_copy: torch.Tensor | None
    lp_ctx: torch.Tensor
    lp_dec: torch.Tensor
    p_copy: torch.Tensor
    has: torch.Tensor
    task: torch.Tensor
    example: torch.Tensor

    def __len__(self) -> int:
        return int(self.lp_ctx.shape[0])

    def cpu(self) -> TokenStats:
        """The same statistics in CPU memory."""
        return TokenStats(**{k: None if v is None else v.cpu() for k, v in self.__dict__.items()})

    def select(self, keep: torch.Tensor) -> TokenStats:
        """The tokens where ``keep`` ``(N,)`` is True."""
        return TokenStats(**{k: None if v is None else v[keep] for k, v in self.__dict__.items()})

    @staticmethod
    def cat(parts: list[TokenStats]) -> TokenStats:
        """One set of the tokens of all ``parts`` in order."""
        keys = parts[0].__dict__
        return TokenStats(
            **{k: None if keys[k] is None else torch.cat([getattr(p, k) for p in parts]) for k in keys}
        )


@dataclass
class Heads:
    """A mixing head and (optionally) a copy head as plain fp64 tensors: ``w_mix`` ``(F,)``, ``b_mix`` ``()``,
    ``w_copy`` ``(F',)``, ``b_copy`` ``()``."""

    w_mix: torch.Tensor
    b_mix: torch.Tensor
    w_copy: torch.Tensor | None = None
    b_copy: torch.Tensor | None = None

    @staticmethod
    def of(model: nn.Module) -> Heads:
        """The heads of ``model`` (a :class:`~cepe.modeling.CepeForCausalLM` with the output mixture)."""
        heads = {h: getattr(model, h) for h in HEADS if getattr(model, h) is not None}
        return Heads.from_state({f"{h}.{k}": v for h, m in heads.items() for k, v in m.state_dict().items()})

    @staticmethod
    def from_state(state: dict[str, torch.Tensor]) -> Heads:
        """The heads in an adapter's tensors (``mix_head.weight`` ``(1, F)``, ``mix_head.bias``, ...)."""

        def get(name: str) -> torch.Tensor | None:
            t = state.get(name)
            return None if t is None else t.detach().cpu().double().reshape(-1)

        w_mix, b_mix = get("mix_head.weight"), get("mix_head.bias")
        if w_mix is None or b_mix is None:
            raise ValueError("no mixing head (mix_head.weight / mix_head.bias) among the adapter's tensors")
        b_copy = get("copy_head.bias")
        return Heads(w_mix, b_mix[0], get("copy_head.weight"), None if b_copy is None else b_copy[0])

    def copy_into(self, model: nn.Module) -> None:
        """Write these weights into ``model``'s heads (their dtype and device)."""
        with torch.no_grad():
            for head, w, b in (
                (model.mix_head, self.w_mix, self.b_mix),
                (model.copy_head, self.w_copy, self.b_copy),
            ):
                if head is None or w is None or b is None:
                    continue
                head.weight.copy_(w.reshape(head.weight.shape).to(head.weight))
                head.bias.copy_(b.reshape(head.bias.shape).to(head.bias))


def head_nll(stats: TokenStats, heads: Heads) -> torch.Tensor:
    """The mixture's negative log-likelihood ``(N,)`` (fp64) at the recorded tokens under ``heads``: what
    the training loss computes (``cepe.training.speed.mixture_token_nll``) from the same numbers."""
    from cepe.mixture import copy_mix_nll, mix_nll

    nll = mix_nll(stats.lp_ctx, stats.lp_dec, stats.x_mix.double() @ heads.w_mix + heads.b_mix)  # (N,)
    if heads.w_copy is None or stats.x_copy is None:
        return nll
    c = stats.x_copy.double() @ heads.w_copy + heads.b_copy  # (N,)
    return copy_mix_nll(nll, c, stats.p_copy, stats.has)


def head_names(c: Any, hidden_size: int) -> dict[str, list[str] | None]:
    """The inputs of each head (:func:`cepe.mixture.head_inputs`) of a :class:`~cepe.config.CepeConfig`
    ``c``; None for a head it does not have."""
    from cepe.config import COPY_HEAD_INPUTS
    from cepe.mixture import head_inputs

    shared = (hidden_size, c.mix_match, c.mix_hidden, c.mix_length, c.mix_agree)
    return {
        "mix_head": head_inputs(*shared) if c.output_mix else None,
        "copy_head": head_inputs(*shared, *(bool(getattr(c, n)) for n in COPY_HEAD_INPUTS))
        if c.mix_copy
        else None,
    }


# ------------------------------------------------------------------------------------------- recording
def check_recipe(cfg: TrainConfig) -> None:
    """Raise ``ValueError`` unless ``cfg`` trains the mixture's heads alone over a frozen reader, on inputs
    that can be recorded."""
    c = cfg.cepe or {}
    problems = []
    if cfg.stage != "cepe":
        problems.append(f"its stage is {cfg.stage!r}, not 'cepe'")
    if not c.get("output_mix"):
        problems.append("it has no output mixture (cepe.output_mix)")
    if c.get("mix_hidden", True):
        problems.append("its heads read the 2·D hidden states (set cepe.mix_hidden: false)")
    if c.get("mix_copy_prob"):
        problems.append(
            "its copy head reads the mixture's own expectation (mix_copy_prob), which moves with the heads"
        )
    if not cfg.train_only or set(cfg.train_only) - set(HEADS):
        problems.append(
            f"it trains more than the heads (train_only: {cfg.train_only}; give [mix_head, copy_head])"
        )
    if cfg.online_teacher or cfg.align_coef:
        problems.append("its loss is more than the mixture's next-token loss (online_teacher, align_coef)")
    if problems:
        raise ValueError(
            "cepe fit-heads fits the heads of a stage that trains them alone over a frozen reader, but "
            + "; ".join(problems)
        )


@torch.no_grad()
def record_batch(model: nn.Module, batch: dict[str, torch.Tensor], use_bf16: bool) -> TokenStats | None:
    """The :class:`TokenStats` of one collated batch (with ``task`` and ``index``; chunks as the step reads
    them), computed as :class:`~cepe.training.models.StageModule` computes the loss; None where the batch
    has no context (the heads take no part there)."""
    from cepe.mixture import copy_agreement_feature, copy_recency_feature, reader_sure_feature, top_logprob

    from .speed import HeadWeight, chunked_reader_inputs, chunked_target_logprobs

    dev = batch["input_ids"].device
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_bf16):
        ctx = model.prepare_context(
            batch["encoder_input_ids"], batch["encoder_attention_mask"], cross_attention_cache="states"
        )
        if ctx is None:
            return None
        base = model.decoder.get_decoder()
        ids, labels = batch["input_ids"], batch["labels"]
        with model.use_context(ctx):
            hidden = base(input_ids=ids, use_cache=False).last_hidden_state  # (B, T, D)
        with model.use_context(None):
            alone = base(input_ids=ids, use_cache=False).last_hidden_state
        match, copy = ctx.suffix_inputs(ids, 0)  # (B, T, F), (B, T)
        sel = labels[:, 1:] != -100  # (B, T-1)
        h, h_dec, y = hidden[:, :-1][sel], alone[:, :-1][sel], labels[:, 1:][sel]
        dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else h.dtype
        cp = None if model.copy_head is None else copy[:, :-1][sel]  # (N,) where each token's copy lies
        top = None  # (N,) the reader's top log-probability where a suffix occurs (mix_copy_sure)
        read = None  # (N,) the reader's probability of a draw from the copy (mix_copy_read)
        want_top = cp is not None and model.cepe_config.mix_copy_sure
        want_read = cp is not None and model.cepe_config.mix_copy_read
        if getattr(model.decoder.config, "final_logit_softcapping", None):  # the model's own capped head
            lp_ctx, lp_dec = (
                model.lm_logits(x).float().log_softmax(-1).gather(-1, y[:, None])[:, 0] for x in (h, h_dec)
            )
            if want_top or want_read:  # the reader's capped logits once, where a suffix occurs
                logits = model.lm_logits(h[cp.has]).float()
                top, read = torch.zeros_like(lp_ctx), torch.zeros_like(lp_ctx)
                top[cp.has] = top_logprob(logits)
                read[cp.has] = cp[cp.has].expected(logits.log_softmax(-1))
                top, read = (top if want_top else None), (read if want_read else None)
        else:
            with torch.autocast(dev.type, enabled=False):
                w = HeadWeight().get(model.decoder, dtype)
                lp_ctx = chunked_target_logprobs(h, w, y)
                lp_dec = chunked_target_logprobs(h_dec, w, y)
                if want_top or want_read:
                    top, read = chunked_reader_inputs(h, w, cp, want_top, want_read)
    m = match[:, :-1][sel]  # (N, F) fp32
    x_mix = m.to(h.dtype).float()  # as mix_logit casts its inputs
    x_copy, p_copy, has = None, torch.zeros_like(lp_ctx), torch.zeros_like(y, dtype=torch.bool)
    if cp is not None:
        p_copy, has = cp.target_probs(y), cp.has
        own = []
        if model.cepe_config.mix_copy_near:
            own.append(copy_recency_feature(cp))
        if top is not None:
            own.append(reader_sure_feature(top, cp.has))
        if model.cepe_config.mix_copy_top:
            own.append(cp.top_share())
        if read is not None:
            own.append(copy_agreement_feature(read, cp.has))
        if model.cepe_config.mix_copy_count:
            own.append(cp.count_feature())
        xc = torch.cat([m, torch.stack(own, dim=-1).to(m.dtype)], dim=-1) if own else m
        x_copy = xc.to(h.dtype).float()
    rows = sel.nonzero()[:, 0]  # (N,) each token's row
    task = batch.get("task")
    task = torch.full_like(rows, TASK_KINDS.index("lm")) if task is None else task[rows]
    return TokenStats(
        x_mix,
        x_copy,
        lp_ctx.float(),
        lp_dec.float(),
        p_copy.float(),
        has,
        task.long(),
        batch["index"][rows].long(),
    )


def step_batches(cfg: TrainConfig, make: Any, step: int) -> Iterator[dict[str, torch.Tensor]]:
    """The collated micro-batches of optimizer step ``step`` of ``cfg``, as training reads them (examples
    from ``make``, :func:`cepe.training.trainer.example_maker`; chunks regrouped as the step reads them)."""
    from .trainer import micro_batch

    for micro in range(cfg.batch_size // cfg.micro_batch_size):
        yield micro_batch(cfg, make, step, micro, keep_index=True)


def copy_target_probs(
    batch: dict[str, torch.Tensor], order: int, decay: float, wrap: bool = False
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The copy's probability of each scored target ``(N,)`` fp32 of one collated batch and the largest
    share one token has of its votes ``(N,)`` (the ``mix_copy_top`` input), in the order of
    :func:`record_batch` (None where it records nothing: no context), with the votes weighed by ``decay``
    (``CepeConfig.mix_copy_decay``) and suffixes up to ``order`` tokens: from the token ids alone, so
    records made with one decay can be fitted with another; ``wrap``: the adapter's ``mix_hash`` is
    ``"wrap"``."""
    from cepe.mixture import context_successors, context_token_ids, copy_spans, suffix_hashes

    if batch.get("encoder_input_ids") is None:
        return None
    ids = context_token_ids(batch["encoder_input_ids"], batch.get("encoder_attention_mask"))
    if not bool((ids >= 0).any()):
        return None
    labels = batch["labels"]
    sel = labels[:, 1:] != -100  # (B, T-1)
    table = context_successors(ids, ids >= 0, order, decay=decay, wrap=wrap)
    spans = copy_spans(batch["input_ids"], table, hashes=suffix_hashes(batch["input_ids"], order, wrap=wrap))
    cp = spans[:, :-1][sel]
    return cp.target_probs(labels[:, 1:][sel]), cp.top_share()


def recopy(cfg: TrainConfig, model: nn.Module, steps: int, decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:attr:`TokenStats.p_copy` ``(N,)`` of the records of steps ``0 .. steps - 1`` of ``cfg``
    (:func:`record`), and the copy's top share ``(N,)``, with the copy's votes weighed by ``decay`` instead
    of the recipe's: the examples are made again, the reader is not run."""
    from .trainer import example_maker

    make = example_maker(cfg, model)
    order = int(model.cepe_config.mix_match)
    parts = [
        got
        for step in range(steps)
        for batch in step_batches(cfg, make, step)
        if (got := copy_target_probs(batch, order, decay, model.cepe_config.mix_hash == "wrap")) is not None
    ]
    return torch.cat([p for p, _ in parts]), torch.cat([t for _, t in parts])


def record(
    cfg: TrainConfig, model: nn.Module, stats_dir: Path, steps: int, progress: bool = True
) -> TokenStats:
    """Record the stats of the batches of steps ``0 .. steps - 1`` of ``cfg`` into ``stats_dir`` (one file
    a step, written atomically; a step already there is read, not recomputed) and return them all, in CPU
    memory. The reader runs where ``model`` is, in the compute dtype of ``cfg.bf16`` on that device. The
    folder names the recipe (its fingerprint) and the compute dtype it was recorded in: records of another
    raise ``ValueError``."""
    from cepe.compute import resolve_bf16
    from cepe.fileio import atomic_path, write_json

    from .speed import hold_frozen_linears
    from .trainer import example_maker

    dev = next(model.parameters()).device
    use_bf16 = resolve_bf16(cfg.bf16, dev)
    stats_dir.mkdir(parents=True, exist_ok=True)
    # the suffix inputs' hash (the records hold those inputs; without suffix matches it plays no part)
    mix_hash = str(model.cepe_config.mix_hash) if model.cepe_config.mix_match else "none"
    what = {
        "recipe": cfg.output_dir,
        "fingerprint": cfg.fingerprint(),
        "bf16": use_bf16,
        "mix_hash": mix_hash,
    }
    note = stats_dir / RECORDS_FILE
    if note.exists():
        had = json.loads(note.read_text())
        if mix_hash == "none":
            had["mix_hash"] = "none"
        had.setdefault("mix_hash", "unknown (recorded before the hash was noted)")
        keys = ("fingerprint", "bf16", "mix_hash")
        if {k: had.get(k) for k in keys} != {k: what[k] for k in keys}:
            raise ValueError(
                f"{stats_dir} holds the records of {had.get('recipe')} (fingerprint {had.get('fingerprint')}, "
                f"bf16 {had.get('bf16')}, suffix hash {had['mix_hash']}), not of this recipe "
                f"({what['fingerprint']}, bf16 {use_bf16}, suffix hash {mix_hash}): give another records "
                "folder (or output_dir), or remove these records to make them again"
            )
    else:
        write_json(note, what, indent=1)
    model.eval()
    make = example_maker(cfg, model)
    if use_bf16:  # the same bf16 matmuls as training, without a cast of each frozen weight per call
        hold_frozen_linears(model.decoder, torch.bfloat16)
    parts: list[TokenStats] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc="recording", unit="step")
    for step in range(steps):
        path = stats_dir / f"step_{step:06d}.pt"
        if path.exists():
            got = [TokenStats(**d) for d in torch.load(path, weights_only=True, map_location="cpu")]
        else:
            got = []
            for batch in step_batches(cfg, make, step):
                s = record_batch(model, {k: v.to(dev) for k, v in batch.items()}, use_bf16)
                if s is not None:
                    got.append(s.cpu())
            with atomic_path(path) as tmp:
                torch.save([s.__dict__ for s in got], tmp)
            if dev.type == "cpu":  # jemalloc's kept pages back to the kernel, as training does each step
                purge()
        parts += got
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if not parts:
        raise ValueError(f"none of the first {steps} steps of {cfg.output_dir} has a context: nothing to fit")
    return TokenStats.cat(parts)


# ------------------------------------------------------------------------------------------------ fitting
def fit(
    stats: TokenStats,
    start: Heads,
    max_iter: int,
    l2: float = 0.0,
    fixed: list[torch.Tensor] | None = None,
    weight: torch.Tensor | None = None,
) -> tuple[Heads, list[float]]:
    """The heads that minimise the mean of :func:`head_nll` over ``stats`` (weighted by ``weight`` ``(N,)``
    where given) plus ``l2 / 2`` times the sum of
    their squared weights in standardised units (biases free), by full-batch L-BFGS (strong Wolfe line
    search, fp64) from ``start``, on standardised inputs (folded back: the returned heads take the raw
    inputs). ``fixed``: per head (mixing, copy) a bool mask ``(F,)`` of the weights kept at ``start``'s.
    Returns the heads and the mean NLL at each evaluation, the first at ``start``, the last at the
    returned heads."""
    xs = [stats.x_mix.double()] + ([] if start.w_copy is None else [stats.x_copy.double()])
    mus = [x.mean(0) for x in xs]
    sds = [torch.where(x.std(0) > 1e-6, x.std(0), torch.ones_like(x.std(0))) for x in xs]
    # in standardised units: w' = w·sd, b' = b + w·mu
    flat = [start.w_mix * sds[0], (start.b_mix + start.w_mix @ mus[0]).reshape(1)]
    if start.w_copy is not None:
        flat += [start.w_copy * sds[1], (start.b_copy + start.w_copy @ mus[1]).reshape(1)]
    theta0 = torch.cat(flat).detach().clone()
    sizes = [t.numel() for t in flat]
    is_weight = torch.cat([torch.full((n,), i % 2 == 0, dtype=torch.bool) for i, n in enumerate(sizes)])
    held = torch.zeros_like(is_weight)  # entries of theta kept at their start
    for i, mask in enumerate(fixed or []):
        if mask is not None:
            if mask.shape != (sizes[2 * i],):
                raise ValueError(
                    f"fixed: head {i}'s mask has {mask.numel()} entries for {sizes[2 * i]} weights"
                )
            at = sum(sizes[: 2 * i])
            held[at : at + sizes[2 * i]] = mask
    free = theta0[~held].clone().requires_grad_(True)

    def full(f: torch.Tensor) -> torch.Tensor:
        return theta0.masked_scatter(~held, f)

    def unpack(t: torch.Tensor) -> Heads:
        parts = list(torch.split(t, sizes))
        w_mix = parts[0] / sds[0]
        heads = Heads(w_mix, parts[1][0] - w_mix @ mus[0])
        if len(parts) > 2:
            w_copy = parts[2] / sds[1]
            heads.w_copy, heads.b_copy = w_copy, parts[3][0] - w_copy @ mus[1]
        return heads

    history: list[float] = []
    opt = torch.optim.LBFGS(
        [free],
        lr=1.0,
        max_iter=max_iter,
        history_size=20,
        tolerance_grad=1e-9,
        tolerance_change=1e-12,
        line_search_fn="strong_wolfe",
    )

    w = None if weight is None else weight.double() / weight.double().sum()

    def mean_nll(heads: Heads) -> torch.Tensor:
        nll = head_nll(stats, heads)
        return nll.mean() if w is None else (nll * w).sum()

    def closure() -> torch.Tensor:
        opt.zero_grad()
        theta = full(free)
        nll = mean_nll(unpack(theta))
        loss = nll + 0.5 * l2 * theta[is_weight & ~held].square().sum()
        loss.backward()
        history.append(float(nll.detach()))
        return loss

    opt.step(closure)
    with torch.no_grad():
        out = unpack(full(free.detach()))
        history.append(float(mean_nll(out)))
    return out, history


# ------------------------------------------------------------------------------------------------ the job
def _compare_heads(path: str, names: dict[str, list[str] | None], hidden_size: int) -> Heads:
    """The heads of adapter ``path`` over the recipe's inputs ``names`` (per head): each of their inputs must
    be among the recipe's, and an input they lack gets a zero weight (what they compute, unchanged)."""
    from cepe.config import CepeConfig
    from cepe.mixture import widen_head
    from cepe.modeling import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_adapter_file

    p = Path(path)
    if not (p / ADAPTER_CONFIG).is_file():
        raise FileNotFoundError(f"compare: {p / ADAPTER_CONFIG} not found; give a cepe adapter directory")
    theirs = head_names(CepeConfig.load(p / ADAPTER_CONFIG), hidden_size)
    state = load_adapter_file(p / ADAPTER_WEIGHTS)
    for head in HEADS:
        mine, other = names[head], theirs[head]
        if (mine is None) != (other is None) or (other is not None and not set(other) <= set(mine)):
            raise ValueError(
                f"compare: the {head} of {path} takes {_describe(other)}, the recipe's "
                f"{_describe(mine)}: only heads whose inputs are among the recipe's can be scored on "
                "these records"
            )
        if other is not None and other != mine:  # zero weights on the inputs they lack
            theirs_head = nn.Linear(len(other), 1, dtype=torch.float64)
            with torch.no_grad():
                theirs_head.weight.copy_(state[f"{head}.weight"])
            state = {**state, f"{head}.weight": widen_head(theirs_head, other, mine).weight.detach()}
    return Heads.from_state(state)


def int8_heads(heads: Heads) -> Heads:
    """``heads`` as an adapter exported with ``quantize="int8"`` holds them (:mod:`cepe.quant`: each weight
    row in int8 with its scale, the biases in fp32)."""
    from cepe.quant import dequantize_int8, quantize_int8_rowwise

    ws = {"m": heads.w_mix[None]} | ({} if heads.w_copy is None else {"c": heads.w_copy[None]})
    back = dequantize_int8(quantize_int8_rowwise(ws))
    w_copy = None if heads.w_copy is None else back["c"][0].double()
    return Heads(back["m"][0].double(), heads.b_mix, w_copy, heads.b_copy)


def _describe(names: list[str] | None) -> str:
    return (
        "nothing (no such head)"
        if names is None
        else f"{len(names)} inputs ({', '.join(names[:6])}{', ...' if len(names) > 6 else ''})"
    )


LENGTH_BINS = (0, 1024, 2048, 4096, 6144, 7168)  # context tokens: the lower edges of the report's bins


def _bin_name(i: int) -> str:
    lo = f"{LENGTH_BINS[i] // 1024}K"
    return f"{lo}+" if i + 1 == len(LENGTH_BINS) else f"{lo}-{LENGTH_BINS[i + 1] // 1024}K"


def _scores(stats: TokenStats, heads: Heads, length_col: int | None = None) -> dict[str, Any]:
    """Mean NLL of ``heads`` over ``stats`` and its :func:`_breakdown`."""
    if not len(stats):
        return {"nll": None, "by_task": {}}
    nll = head_nll(stats, heads)
    return {"nll": float(nll.mean()), **_breakdown(stats, nll, length_col)}


def _breakdown(stats: TokenStats, nll: torch.Tensor, length_col: int | None) -> dict[str, Any]:
    """A per-token NLL ``(N,)`` by example kind and (``length_col``: the column of the length input in
    the mixing head's inputs) the continuation examples' by context length (:data:`LENGTH_BINS`)."""
    from cepe.mixture import LENGTH_UNIT

    nll = nll.double()
    out: dict[str, Any] = {
        "by_task": {
            TASK_KINDS[k]: float(nll[stats.task == k].mean()) for k in sorted(set(stats.task.tolist()))
        }
    }
    if length_col is not None:  # the length as the head reads it (rounded as recorded: bins, not counts)
        ctx = torch.expm1(stats.x_mix[:, length_col].double()) * LENGTH_UNIT
        which = torch.bucketize(ctx, torch.tensor(LENGTH_BINS[1:], dtype=torch.float64) - 0.5)
        lm = stats.task == TASK_KINDS.index("lm")
        out["lm_by_length"] = {
            _bin_name(i): float(nll[lm & (which == i)].mean())
            for i in range(len(LENGTH_BINS))
            if bool((lm & (which == i)).any())
        }
    return out


def _named(weights: torch.Tensor | None, names: list[str] | None) -> dict[str, float] | None:
    return (
        None if weights is None or names is None else {n: round(float(w), 6) for n, w in zip(names, weights)}
    )


def fit_device(name: str | None) -> torch.device:
    """The device the reader records on: ``name``, or cuda when available, else cpu."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(
            f"device {name!r} is not a device torch knows ({e}): give cpu, cuda or cuda:N"
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: this torch sees no CUDA device; give cpu (or leave device unset)")
    return dev


def run_head_fit(cfg: HeadFitConfig) -> dict[str, Any]:
    """Record, fit, score and write (see the module's docstring); returns what ``fit.json`` holds."""
    from cepe.compute import resolve_bf16
    from cepe.fileio import write_json, write_text

    from .config import load_config
    from .models import build_model

    recipe = load_config(cfg.recipe, [], stage="cepe")
    check_recipe(recipe)
    out = Path(cfg.output_dir or f"{recipe.output_dir}-fit")
    steps = recipe.steps if cfg.steps is None else cfg.steps
    dev = fit_device(cfg.device)
    t0 = time.time()
    model = build_model(recipe).to(dev)
    c = model.cepe_config
    d = int(model.decoder.config.hidden_size)
    names = head_names(c, d)
    unknown = sorted(
        f for f in cfg.fixed if not any(f in (n, f"{h}:{n}") for h in HEADS for n in names[h] or [])
    )
    if unknown:
        raise ValueError(
            f"fixed: {unknown} are no inputs of this recipe's heads; they take "
            f"{_describe(names['mix_head'])} and {_describe(names['copy_head'])}"
        )
    others = {path: _compare_heads(path, names, d) for path in cfg.compare}  # fail before the long part
    if cfg.copy_decays and not c.mix_copy:
        raise ValueError(
            "copy_decays weigh the copy's votes, and this recipe has no copy (cepe.mix_copy): drop copy_decays"
        )
    if cfg.copy_decays and c.mix_copy_read:
        raise ValueError(
            "copy_decays reuse the records, but this recipe's copy head reads the reader's probability of the "
            "copy's tokens (mix_copy_read), which moves with the decay: record each decay (cepe.mix_copy_decay "
            "in the recipe) instead"
        )
    stats = record(recipe, model, Path(cfg.records) if cfg.records else out / STATS_DIR, steps, cfg.progress)
    recorded_s = time.time() - t0
    held = (
        (stats.example % cfg.held_out_every == 0)
        if cfg.held_out_every
        else torch.zeros(len(stats), dtype=torch.bool)
    )
    train, test = stats.select(~held), stats.select(held)
    start = Heads.of(model)
    t1 = time.time()
    masks = [
        None
        if names[h] is None
        else torch.tensor([n in cfg.fixed or f"{h}:{n}" in cfg.fixed for n in names[h]])
        for h in HEADS
    ]
    weights = None
    if cfg.task_weights:
        unknown_kinds = sorted(set(cfg.task_weights) - set(TASK_KINDS))
        if unknown_kinds:
            raise ValueError(
                f"task_weights: {unknown_kinds} are no example kinds; they are {list(TASK_KINDS)}"
            )
        per_kind = torch.tensor(
            [float(cfg.task_weights.get(k, 1.0)) for k in TASK_KINDS], dtype=torch.float64
        )

        def weights(s: TokenStats) -> torch.Tensor:
            return per_kind[s.task]

        if not bool(weights(train).gt(0).any()):
            raise ValueError(f"task_weights {cfg.task_weights} leave no fitted token a positive weight")
    fitted, history = fit(
        train, start, cfg.max_iter, cfg.l2, masks, None if weights is None else weights(train)
    )
    fit_s = time.time() - t1
    col = names["mix_head"].index("n") if "n" in names["mix_head"] else None
    swept = {}  # the same fit with the copy's votes weighed otherwise: held-out scores
    t_col = (names["copy_head"] or []).index("t") if "t" in (names["copy_head"] or []) else None
    for decay in cfg.copy_decays:
        p_copy, top = recopy(recipe, model, steps, float(decay))
        if len(p_copy) != len(stats):
            raise ValueError(
                f"the records hold {len(stats)} tokens, the examples made again {len(p_copy)}: the "
                "records are not of this recipe's examples (record them again: remove the records folder)"
            )
        other = replace(stats, p_copy=p_copy)
        if (
            t_col is not None
        ):  # the top share moves with the decay too (as recorded: the compute dtype's rounding)
            other.x_copy = stats.x_copy.clone()
            dtype = torch.bfloat16 if resolve_bf16(recipe.bf16, dev) else torch.float32
            other.x_copy[:, t_col] = top.to(dtype).float()
        part = other.select(~held)
        heads_d, _ = fit(part, start, cfg.max_iter, cfg.l2, masks, None if weights is None else weights(part))
        swept[f"decay {float(decay):g}"] = _scores(other.select(held), heads_d, col)
    fitted.copy_into(model)
    model.eval()
    model.save_pretrained(out / "adapter")

    result: dict[str, Any] = {
        "config": asdict(cfg),
        "recipe": recipe.output_dir,
        "steps": steps,
        "tokens": {"fit": len(train), "held_out": len(test)},
        "examples": {
            "fit": int(train.example.unique().numel()),
            "held_out": int(test.example.unique().numel()),
        },
        "iterations": len(history),
        "objective": {"start": history[0], "fitted": history[-1], "by_iteration": history},
        "held_out": {
            "fitted": _scores(test, fitted, col),
            "fitted, int8": _scores(test, int8_heads(fitted), col),
            "start": _scores(test, start, col),
            **{f"compare:{p}": _scores(test, h, col) for p, h in others.items()},
            **swept,
            **{
                name: {"nll": None}
                if not len(test)
                else {"nll": float(-lp.double().mean()), **_breakdown(test, -lp, col)}
                for name, lp in (("decoder alone", test.lp_dec), ("reader alone", test.lp_ctx))
            },
        },
        "fit": {"fitted": _scores(train, fitted), "start": _scores(train, start)},
        "weights": {
            "mix_head": {"bias": float(fitted.b_mix), "weights": _named(fitted.w_mix, names["mix_head"])},
            "copy_head": None
            if fitted.w_copy is None
            else {"bias": float(fitted.b_copy), "weights": _named(fitted.w_copy, names["copy_head"])},
        },
        "seconds": {"record": round(recorded_s, 1), "fit": round(fit_s, 2)},
        "adapter": str(out / "adapter"),
    }
    write_json(out / "fit.json", result, indent=1)
    write_text(out / "fit.md", report_markdown(result))
    _plot(history, out / "fit.png")
    return result


def report_markdown(result: dict[str, Any]) -> str:
    """``fit.md``: the held-out tables (mean NLL, by kind; the continuation examples by context length)
    and the fitted weights."""
    from cepe.tables import pipe_table

    held = result["held_out"]
    kinds = sorted({k for v in held.values() for k in v.get("by_task", {})})
    rows = []
    for name, v in held.items():
        nll = v.get("nll")
        rows.append(
            [name, "-" if nll is None else f"{nll:.4f}", "-" if nll is None else f"{math.exp(nll):.3f}"]
            + [f"{v['by_task'][k]:.4f}" if k in v.get("by_task", {}) else "-" for k in kinds]
        )
    lines = [
        f"# Heads fitted on {result['recipe']}'s first {result['steps']} steps",
        "",
        f"{result['tokens']['fit']} tokens of {result['examples']['fit']} examples fitted, "
        f"{result['tokens']['held_out']} of {result['examples']['held_out']} held out; "
        f"{result['iterations']} L-BFGS evaluations, objective {result['objective']['start']:.5f} → "
        f"{result['objective']['fitted']:.5f}.",
        "",
        "Held-out NLL per token:",
        "",
        *pipe_table(["heads", "NLL", "perplexity", *kinds], rows),
        "",
    ]
    if any(name.startswith("compare:") for name in held):
        lines += [
            "`compare:PATH`: that adapter's heads over this reader's records, not that adapter's reader: "
            "it compares heads, not readers (`cepe eval` on each adapter compares the two).",
            "",
        ]
    bins = [
        b
        for b in map(_bin_name, range(len(LENGTH_BINS)))
        if any(b in v.get("lm_by_length", {}) for v in held.values())
    ]
    if bins:
        lines += [
            "Held-out NLL per token of the continuation (lm) examples, by context length:",
            "",
            *pipe_table(
                ["heads", *bins],
                [
                    [name, *(f"{v['lm_by_length'][b]:.4f}" if b in v["lm_by_length"] else "-" for b in bins)]
                    for name, v in held.items()
                    if "lm_by_length" in v
                ],
            ),
            "",
        ]
    for head, w in result["weights"].items():
        if w is None:
            continue
        cells = ", ".join(f"{n} {v:+.3f}" for n, v in w["weights"].items())
        lines += [f"`{head}`: bias {w['bias']:+.3f}; {cells}", ""]
    return "\n".join(lines)


def _plot(history: list[float], path: Path) -> None:
    """The objective by L-BFGS evaluation (skipped without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cepe.fileio import atomic_path

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(range(len(history)), history)
    ax.set_xlabel("L-BFGS function evaluation")
    ax.set_ylabel("mean NLL (fitted tokens)")
    ax.set_title("head fit")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def print_summary(result: dict[str, Any]) -> None:
    """The held-out lines of a finished fit, for the terminal."""
    print(json.dumps({k: v.get("nll") for k, v in result["held_out"].items()}, indent=1))
    print(f"wrote {result['adapter']} and fit.json / fit.md / fit.png beside it")
