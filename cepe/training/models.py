"""Building the model of each stage, and :class:`StageModule`, the loss of one micro-batch.

Shape legend: B batch, K chunks, L chunk length, T decoder tokens, V vocabulary, k teacher tokens.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from cepe.compute import resolve_bf16
from cepe.config import COPY_HEAD_INPUTS, CepeConfig, EncoderConfig, encoder_config_from_decoder
from cepe.cross_attention import AlignProbe
from cepe.dtypes import torch_dtype
from cepe.encoder import EncoderForMaskedLM
from cepe.fileio import atomic_path, write_json
from cepe.mixture import CopySpans
from cepe.modeling import ADAPTER_CONFIG, CepeForCausalLM, packed_positions

from .config import TrainConfig
from .losses import topk_kl
from .speed import HeadWeight, lm_loss, mixture_token_nll

ENCODER_WEIGHTS = "encoder_model.safetensors"
ENCODER_CONFIG = "encoder_config.json"
MLM_WEIGHTS = "mlm_model.safetensors"


def build_decoder(cfg: TrainConfig, name: str | None = None) -> nn.Module:
    """The frozen decoder: a tiny random Llama from ``cfg.tiny_decoder`` or a loaded model (eval mode)."""
    if cfg.tiny_decoder is not None:
        from cepe.tiny import random_decoder

        spec = dict(cfg.tiny_decoder)
        seed = int(spec.pop("seed", 0))
        model = random_decoder("llama", seed, **spec)
        model.config._name_or_path = "tiny"
        return model.to(torch_dtype(cfg.decoder_dtype))
    from cepe.assets import load_decoder_model

    return load_decoder_model(name or cfg.decoder, dtype=torch_dtype(cfg.decoder_dtype))


def decoder_vocab_size(cfg: TrainConfig) -> int:
    """The decoder's vocabulary size, read from its config (no weights loaded)."""
    if cfg.tiny_decoder is not None:
        from transformers import LlamaConfig

        spec = {k: v for k, v in cfg.tiny_decoder.items() if k != "seed"}
        return int(LlamaConfig(**spec).vocab_size)
    from transformers import AutoConfig

    from cepe.assets import resolve_decoder

    return int(AutoConfig.from_pretrained(resolve_decoder(cfg.decoder)).vocab_size)


def encoder_config(cfg: TrainConfig, vocab: int) -> EncoderConfig:
    """The stage's encoder: ``cfg.encoder`` fields over the decoder vocabulary plus one ``[MASK]`` token, or
    the configuration saved with ``cfg.init_encoder``."""
    if cfg.init_encoder is not None:
        return load_encoder_config(cfg.init_encoder)
    return EncoderConfig(vocab_size=vocab + 1, mask_token_id=vocab, **cfg.encoder)


def load_encoder_config(path: str | Path) -> EncoderConfig:
    """The :class:`EncoderConfig` of an MLM stage output directory."""
    p = Path(path) / ENCODER_CONFIG
    if not p.is_file():
        raise FileNotFoundError(
            f"{p} not found: init_encoder must be the output_dir of a finished `cepe pretrain-encoder` run"
        )
    return EncoderConfig(**json.loads(p.read_text()))


def save_encoder(mlm: EncoderForMaskedLM, out_dir: str | Path) -> None:
    """Write the MLM stage artifact: ``encoder_model.safetensors`` (the ``ContextEncoder`` weights that
    CEPE starts from), ``mlm_model.safetensors`` (with the head) and ``encoder_config.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    enc = {k: v.detach().contiguous() for k, v in mlm.encoder.state_dict().items()}
    full = {k: v.detach().contiguous() for k, v in mlm.state_dict().items()}
    for name, tensors in ((ENCODER_WEIGHTS, enc), (MLM_WEIGHTS, full)):
        with atomic_path(out / name) as tmp:
            save_file(tensors, tmp, metadata={"format": "pt"})
    write_json(out / ENCODER_CONFIG, mlm.encoder.config.__dict__, indent=2, sort_keys=True)


def load_encoder_weights(model: CepeForCausalLM, path: str | Path) -> None:
    """Load an MLM stage output's encoder into ``model.encoder`` (strict: names and shapes must match)."""
    state = load_file(Path(path) / ENCODER_WEIGHTS)
    missing, unexpected = model.encoder.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"encoder weights in {path} do not fit the model's encoder: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )


def build_model(cfg: TrainConfig) -> nn.Module:
    """The trainable model of ``cfg.stage``: :class:`EncoderForMaskedLM` (mlm) or :class:`CepeForCausalLM`
    with a frozen decoder (warmup / cepe / ceped), initialised from ``init_encoder`` / ``init_adapter``."""
    if cfg.stage == "mlm":
        torch.manual_seed(cfg.seed)
        enc = encoder_config(cfg, decoder_vocab_size(cfg))
        cepe_kw = cfg.cepe or {}
        return EncoderForMaskedLM(enc, cepe_kw.get("attn_implementation", "sdpa"))
    decoder = build_decoder(cfg)
    torch.manual_seed(cfg.seed)
    if cfg.init_adapter is not None:
        model = CepeForCausalLM.from_pretrained(cfg.init_adapter, decoder=decoder)
        if model.cepe_config.chunk_length != cfg.stage_chunk_length:
            model.cepe_config.chunk_length = cfg.stage_chunk_length
        if cfg.cepe.get("null_key") and not model.cepe_config.null_key:
            model.enable_null_key()  # a stage that adds "no match" keys to an adapter trained without
        if cfg.cepe.get("token_gate") and not model.cepe_config.token_gate:
            model.enable_token_gate()  # per-token head strengths added to an adapter trained without
        if cfg.cepe.get("match_gate") and not model.cepe_config.match_gate:
            model.enable_match_gate()  # match-strength head gates added to an adapter trained without
        if cfg.cepe.get("length_scale"):  # context-length exponents added (an adapter with others: an error)
            model.enable_length_scale(
                int(cfg.cepe["length_scale"]),
                bool(cfg.cepe.get("length_scale_below")),
                bool(cfg.cepe.get("length_scale_above")),
            )
        if cfg.cepe.get("short_gate") and not model.cepe_config.short_gate:
            model.enable_short_gate()  # gates for contexts shorter than the pivot
        if cfg.cepe.get("long_gate") and not model.cepe_config.long_gate:
            model.enable_long_gate()  # and their mirror for longer contexts
        if cfg.cepe.get("induction_gate") and not model.cepe_config.induction_gate:
            model.enable_induction_gate()  # weights on whether reading continues a run
        if cfg.cepe.get("run_bias") and not model.cepe_config.run_bias:
            model.enable_run_bias()  # biases towards the key that continues a run
        if cfg.cepe.get("output_mix"):  # a mixing head over this adapter and the decoder alone
            model.enable_output_mix(
                int(cfg.cepe.get("mix_match", 0)),
                bool(cfg.cepe.get("mix_hidden", True)),
                bool(cfg.cepe.get("mix_length", False)),
                bool(cfg.cepe.get("mix_agree", False)),
            )
            if "mix_length_cap" in cfg.cepe:  # the heads' length input capped (or not: None)
                model.set_mix_length_cap(cfg.cepe["mix_length_cap"])
        if "mix_hash" in cfg.cepe:  # how the suffix matches hash (an adapter's own unless given)
            model.cepe_config.mix_hash = str(cfg.cepe["mix_hash"])
            model.cepe_config.validate()
        if cfg.cepe.get("mix_copy"):  # the copy after the longest matched suffix, and its head
            model.enable_output_copy(*(bool(cfg.cepe.get(k, False)) for k in COPY_HEAD_INPUTS))
            if "mix_copy_decay" in cfg.cepe:  # the copy's votes weighed by how far back they stand
                model.set_mix_copy_decay(float(cfg.cepe["mix_copy_decay"]))
        if "causal" in cfg.encoder:  # the same weights, attending within a chunk the other way
            set_encoder_causal(model, bool(cfg.encoder["causal"]))
    else:
        vocab = int(decoder.config.vocab_size)
        kw = dict(cfg.cepe)
        kw.setdefault("chunk_length", cfg.stage_chunk_length)
        if cfg.stage != "warmup":
            kw.setdefault("train_context_tokens", cfg.n_chunks * cfg.chunk_length)
        if cfg.encoder_init == "decoder":
            enc = encoder_config_from_decoder(
                decoder.config,
                num_layers=int(cfg.encoder.get("num_hidden_layers", 4)),
                causal=bool(cfg.encoder.get("causal", False)),
                output_size=cfg.encoder.get("output_size"),
            )
            kw["share_embeddings"] = True
        else:
            enc = encoder_config(cfg, vocab)
        cepe_cfg = CepeConfig(encoder=enc, **kw)
        if cepe_cfg.decoder_name_or_path is None:
            cepe_cfg.decoder_name_or_path = "tiny" if cfg.tiny_decoder is not None else cfg.decoder
        model = CepeForCausalLM.from_decoder(decoder, cepe_cfg)
        if cfg.encoder_init == "decoder":
            model.init_encoder_from_decoder()
            if cfg.projection_fit_tokens:
                fit_projection(model, cfg)
        if cfg.init_encoder is not None:
            load_encoder_weights(model, cfg.init_encoder)
    for m in model.cross_attention_modules():
        m.float()  # trainable weights stay fp32 (AdamW) even over a bf16 decoder
    model.encoder.float()
    if model.mix_head is not None:
        model.mix_head.float()
    if model.copy_head is not None:
        model.copy_head.float()
    if cfg.freeze_encoder:
        model.encoder.requires_grad_(False)
    if cfg.train_only:
        select_trainable(model, cfg.train_only)
    return model


def fit_projection(model: CepeForCausalLM, cfg: TrainConfig) -> None:
    """Fit the new adapter's down-projection to the encoder's states on the first
    ``cfg.projection_fit_tokens`` tokens of the training split, in chunks of the stage's chunk length."""
    from cepe.data.tokenized import TokenizedCorpus

    length = cfg.stage_chunk_length
    corpus = TokenizedCorpus(cfg.data.corpus)
    n = min(int(cfg.projection_fit_tokens), corpus.stream_length(cfg.data.split)) // length * length
    if n == 0:
        raise ValueError(
            f"projection_fit_tokens: the {cfg.data.split} split has no full chunk of {length} tokens"
        )
    ids = torch.as_tensor(corpus.stream_slice(cfg.data.split, 0, n)).view(1, -1, length)
    model.fit_projection(ids)


def select_trainable(model: nn.Module, parts: list[str]) -> None:
    """Freeze every trainable parameter whose name contains none of ``parts`` (``TrainConfig.train_only``).

    Raises ``ValueError`` when a part matches no trainable parameter (a typo would silently freeze all)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for part in parts:
        if not any(part in n for n, _ in named):
            examples = sorted({n.split(".")[-1] for n, _ in named})
            raise ValueError(
                f"train_only entry {part!r} matches no trainable parameter; names end in {examples} "
                f"(e.g. {named[0][0] if named else 'none'})"
            )
    for n, p in named:
        if not any(part in n for part in parts):
            p.requires_grad_(False)


def set_encoder_causal(model: CepeForCausalLM, causal: bool) -> None:
    """Make the context encoder attend causally (or bidirectionally) within each chunk, in its config (so
    that the saved adapter says so) and in every layer."""
    model.cepe_config.encoder.causal = causal
    for layer in model.encoder.layers:
        layer.self_attn.causal = causal


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer updates (all of the MLM model; the encoder and cross-attention of CEPE)."""
    return [p for p in model.parameters() if p.requires_grad]


def teacher_rows(
    batch: dict[str, torch.Tensor], kinds: list[int] | None, max_context: int | None
) -> torch.Tensor | None:
    """``(B,)`` bool, the examples the online teacher runs for: those of the ``kinds`` (indices in
    ``TASK_KINDS``; None = every kind) whose kept context has at most ``max_context`` tokens (None = any);
    None where every example is taught."""
    rows = None
    if kinds is not None:
        rows = torch.isin(batch["task"], torch.tensor(kinds, device=batch["task"].device))
    if max_context is not None:
        short = batch["encoder_attention_mask"].flatten(1).sum(-1) <= max_context
        rows = short if rows is None else rows & short
    return rows


def _some_taught(batch: dict[str, torch.Tensor]) -> bool:
    """Whether the teacher, run for some examples only (``batch["teacher_rows"]``), taught a scored row of
    this micro-batch: its KL is then that of taught rows, where otherwise it is 0 (the log keeps the two
    apart as ``kl_taught``). False where every example is taught (``kl`` is then the taught KL)."""
    rows = batch.get("teacher_rows")
    if rows is None:
        return False
    return bool(((batch["labels"][:, 1:] != -100) & rows[:, None]).any())


def stage_decoder_name(cfg: TrainConfig) -> str:
    """The name a stage records as its adapters' decoder (``"tiny"`` for a tiny random decoder)."""
    return "tiny" if cfg.tiny_decoder is not None else str(cfg.decoder)


def check_teacher_decoder(teacher_cfg: CepeConfig, cfg: TrainConfig, path: Path) -> None:
    """Check that the teacher adapter at ``path`` (config ``teacher_cfg``) was trained over the stage's
    decoder, which it will run over.

    Raises:
        ValueError: its recorded decoder has another vocabulary size.

    Warns when it records another decoder name (after resolving ``"default"``) of the same vocabulary size:
    a local copy of the same model is fine, another model of the same tokenizer is a wrong teacher.
    """
    from cepe.assets import resolve_decoder

    own = stage_decoder_name(cfg)
    theirs = teacher_cfg.decoder_name_or_path
    vocab = decoder_vocab_size(cfg)
    if teacher_cfg.decoder_vocab_size is not None and int(teacher_cfg.decoder_vocab_size) != vocab:
        raise ValueError(
            f"teacher_adapter {path} was trained over {theirs or 'another decoder'} with a "
            f"{teacher_cfg.decoder_vocab_size}-token vocabulary, but this stage's decoder ({own}) has {vocab}: "
            f"point teacher_adapter at an adapter trained over {own}"
        )
    if theirs is not None and resolve_decoder(theirs) != resolve_decoder(own):
        import warnings

        warnings.warn(
            f"teacher_adapter {path} records its decoder as {theirs!r}; it will run over this stage's "
            f"decoder {own!r}. That is right only if both name the same model.",
            stacklevel=2,
        )


def load_teacher(cfg: TrainConfig) -> CepeForCausalLM:
    """The adapter of ``cfg.teacher_adapter`` over its own frozen copy of the stage's decoder (eval mode, no
    gradients; without its output mixture with ``cfg.teacher_drop_mixture``)."""
    path = Path(str(cfg.teacher_adapter))
    if not path.is_dir():
        raise FileNotFoundError(
            f"teacher_adapter {path} is not a directory: point it at a cepe adapter (a stage's "
            "checkpoints/step_N/adapter, or an exported adapter such as adapters/smollm2-135m-cepe)"
        )
    check_teacher_decoder(CepeConfig.load(path / ADAPTER_CONFIG), cfg, path)
    try:
        teacher = CepeForCausalLM.from_pretrained(path, decoder=build_decoder(cfg))
    except (RuntimeError, ValueError) as err:  # another decoder's width or depth: its weights do not fit
        raise ValueError(
            f"teacher_adapter {path} does not fit this stage's decoder ({stage_decoder_name(cfg)}), so it was "
            f"trained over another decoder; point teacher_adapter at an adapter trained over "
            f"{stage_decoder_name(cfg)}. Loading it said: {err}"
        ) from err
    if cfg.teacher_drop_mixture:
        teacher.disable_output_mix()
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


class StageModule(nn.Module):
    """Wraps the stage's model so that the whole loss runs inside one ``forward`` (one DDP call).

    ``forward(batch)`` returns ``(loss, metrics)``; the loss is fp32 (logits cast before the softmax),
    the forward runs under bf16 autocast when ``bf16`` (``"auto"``: where bf16 is fast on the device). With gradient checkpointing the cross-attention
    context stays installed until :meth:`release` (recomputation in backward reads it); call
    :meth:`release` after ``backward``.
    """

    def __init__(self, model: nn.Module, cfg: TrainConfig) -> None:
        super().__init__()
        self.model = model
        self.stage = cfg.stage
        self.bf16 = cfg.bf16
        self.ce_coef, self.kl_coef = cfg.ce_coef, cfg.kl_coef
        self.kl_form, self.kl_smoothing = cfg.kl_form, cfg.kl_smoothing
        self.align_coef, self.align_heads = cfg.align_coef, cfg.align_heads
        self.align_layers = None if cfg.align_layers is None else frozenset(cfg.align_layers)
        self.online_teacher, self.top_k = cfg.online_teacher, cfg.top_k
        self.teacher_max_context = cfg.teacher_max_context
        # the adapter teaching (teacher_adapter): kept outside the module's parameters and state (not saved,
        # not trained, not wrapped), moved to the batch's device at its first use
        self._teacher = [load_teacher(cfg)] if cfg.teacher_adapter is not None else []
        self.teacher_kinds = None
        if cfg.teacher_tasks is not None:
            from .config import TASK_KINDS

            self.teacher_kinds = [TASK_KINDS.index(k) for k in cfg.teacher_tasks]
        self._held = contextlib.ExitStack()
        self.fast = not getattr(cfg, "reference_path", False)  # chunked head loss, no decoder cache
        self._head = HeadWeight()
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(model)

    def release(self) -> None:
        """Uninstall the context kept for backward recomputation."""
        self._held.close()

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        device = batch["input_ids"].device
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=resolve_bf16(self.bf16, device)):
            if self.stage == "mlm":
                loss, _ = self.model(batch["input_ids"], labels=batch["labels"])
                return loss, {}
            m: CepeForCausalLM = self.model
            self._held.close()
            if self.online_teacher:  # the decoder reads the context itself (no cross-attention installed)
                batch = dict(batch)
                self._run_teacher(m, batch)
            ctx = m.prepare_context(
                batch["encoder_input_ids"], batch["encoder_attention_mask"], cross_attention_cache="states"
            )
            mixed = ctx is not None and m.cepe_config.output_mix
            distill = "teacher_probs" in batch
            # the reference path runs the mixture as one doubled batch (recomputation in backward reads it);
            # distillation scores the mixed logits of the rows it keeps, on both paths
            doubled = mixed and not self.fast and not distill
            self._held.enter_context(m.use_context(ctx.with_decoder_rows() if doubled else ctx))
            if "align_targets" in batch and ctx is not None:
                targets = batch["align_targets"]  # (B, T) flat positions in the unpacked K·L
                if m.cepe_config.pack_keys:
                    targets = packed_positions(batch["encoder_attention_mask"].flatten(1), targets)
                ctx.align = AlignProbe(targets, self.align_heads, self.align_layers, reference=not self.fast)
            if self.stage != "ceped":
                extra: dict[str, torch.Tensor] = {}
                if self.fast or distill:
                    base = m.decoder.get_decoder()
                    hidden = base(
                        input_ids=batch["input_ids"], use_cache=False
                    ).last_hidden_state  # (B, T, D)
                    alone = None  # (B, T, D) the decoder without the context, for the output mixture
                    match = None  # (B, T, K) its suffix-match inputs (mix_match)
                    copy = None  # (B, T) where each position's copy lies (mix_copy)
                    if mixed:
                        with m.use_context(None), torch.no_grad():
                            alone = base(input_ids=batch["input_ids"], use_cache=False).last_hidden_state
                        if m.cepe_config.mix_match:
                            match, copy = ctx.suffix_inputs(batch["input_ids"], 0)
                    if distill:  # CE + KL to the teacher, from one head pass (the mixture's with output_mix)
                        lm, kl = self._scored_losses(m, hidden, batch, alone, match, copy)
                    else:
                        lm = lm_loss(m, hidden, batch["labels"], self._head, self.fast, alone, match, copy)
                    if "task" in batch:
                        extra = self._task_losses(m, hidden, batch, alone, match, copy)
                else:
                    lm = m(
                        batch["input_ids"], labels=batch["labels"], cross_context=ctx, return_logits=False
                    ).loss
                loss, metrics = lm, dict(extra)
                if distill:
                    loss = self.ce_coef * lm + self.kl_coef * kl
                    metrics.update(lm=lm.detach(), kl=kl.detach())
                    if _some_taught(batch):  # the log's mean over the micro-batches the teacher taught
                        metrics["kl_taught"] = kl.detach()
                if ctx is not None and ctx.align is not None:
                    align = ctx.align.loss()
                    ctx.align = None
                    metrics.update(lm=lm.detach(), align=align.detach())
                    return loss + self.align_coef * align, metrics
                return loss, metrics
            hidden = m.decoder.get_decoder()(input_ids=batch["input_ids"]).last_hidden_state  # (B, T, D)
            logits = m.lm_logits(hidden[:, :-1])  # (B, T-1, V): position t predicts token t+1
        v = logits.shape[-1]
        flat = logits.reshape(-1, v)
        ce = F.cross_entropy(flat.float(), batch["labels"][:, 1:].reshape(-1))
        probs, idx = batch["teacher_probs"], batch["teacher_indices"]  # (B, T-1, k)
        scored = batch["labels"][:, 1:] != -100  # (B, T-1)
        if "teacher_rows" in batch:  # teacher_max_context: only the examples the teacher ran for
            scored = scored & batch["teacher_rows"][:, None]
        kl = topk_kl(
            flat,
            probs.reshape(-1, probs.shape[-1]),
            idx.reshape(-1, idx.shape[-1]),
            self.kl_form,
            self.kl_smoothing,
            mask=scored.reshape(-1),
        )
        loss = self.ce_coef * ce + self.kl_coef * kl
        metrics = {"ce": ce.detach(), "kl": kl.detach()}
        if _some_taught(batch):
            metrics["kl_taught"] = kl.detach()
        return loss, metrics

    def _run_teacher(self, m: CepeForCausalLM, batch: dict[str, torch.Tensor]) -> None:
        """Fill ``batch["teacher_probs"]`` and ``batch["teacher_indices"]`` (and ``batch["teacher_rows"]``
        where the teacher runs for some examples only) with the online teacher's top-k."""
        from .online_teacher import adapter_teacher_topk, online_teacher_topk

        device = batch["input_ids"].device
        rows = teacher_rows(batch, self.teacher_kinds, self.teacher_max_context)
        if rows is not None:
            batch["teacher_rows"] = rows
        args = (
            batch["input_ids"],
            batch["labels"],
            batch["encoder_input_ids"],
            batch["encoder_attention_mask"],
            self.top_k,
        )
        if self._teacher:
            teacher = self._teacher[0]
            if next(teacher.parameters()).device != device:
                teacher.to(device)
            batch["teacher_probs"], batch["teacher_indices"] = adapter_teacher_topk(
                teacher, *args, select=rows
            )
        else:
            batch["teacher_probs"], batch["teacher_indices"] = online_teacher_topk(
                m.decoder,
                *args,
                batch.get("context_at"),
                rows,
                getattr(m.decoder.config, "max_position_embeddings", None),
            )

    def _scored_losses(
        self,
        m: CepeForCausalLM,
        hidden: torch.Tensor,
        batch: dict,
        alone: torch.Tensor | None = None,
        match: torch.Tensor | None = None,
        copy: CopySpans | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(CE, KL(teacher ‖ student))`` at the scored positions, from one pass of the student's head over
        those rows alone (the KL over the teacher's top-k, at the rows of the examples in
        ``batch["teacher_rows"]`` where present; 0 where none is). With the output mixture (``alone`` the
        decoder's hidden states without the context ``(B, T, D)``, ``match`` ``(B, T, K)`` and ``copy``
        ``(B, T)`` where the adapter takes them) the student is the mixture: both are of its logits
        (:meth:`CepeForCausalLM.mixed_logits`), so a reader trained under fixed heads learns what they
        leave to it."""
        keep = batch["labels"][:, 1:] != -100  # (B, T-1)
        if not bool(keep.any()):  # nothing scored: 0, still connected to the graph
            zero = hidden.float().sum() * 0.0
            return zero, zero
        if alone is None:
            logits = m.lm_logits(hidden[:, :-1][keep])  # (N, V)
        else:
            logits = m.mixed_logits(
                hidden[:, :-1][keep],
                alone[:, :-1][keep],
                None if match is None else match[:, :-1][keep],
                None if copy is None else copy[:, :-1][keep],
            )  # (N, V) fp32
        ce = F.cross_entropy(logits.float(), batch["labels"][:, 1:][keep])
        taught = None  # (N,) the rows the teacher was run for
        if "teacher_rows" in batch:
            taught = batch["teacher_rows"][:, None].expand_as(keep)[keep]
        kl = topk_kl(
            logits,
            batch["teacher_probs"][keep],
            batch["teacher_indices"][keep],
            self.kl_form,
            self.kl_smoothing,
            mask=taught,
        )
        return ce, kl

    @torch.no_grad()
    def _task_losses(
        self,
        m: CepeForCausalLM,
        hidden: torch.Tensor,
        batch: dict,
        alone: torch.Tensor | None = None,
        match: torch.Tensor | None = None,
        copy: CopySpans | None = None,
    ) -> dict[str, torch.Tensor]:
        """The next-token loss of each example kind of a mixed stage (``batch["task"]``), for the log only
        (no gradient; the training loss is the mean over all kinds' scored tokens of the micro-batch, and a
        step's loss the mean of its micro-batches' losses, so ``micro_batch_size`` is part of the
        objective). Costs one more pass of the output head over the scored tokens (plus the recalled spans
        again), forward only."""
        from .config import TASK_KINDS

        out = {}
        labels, kinds = batch["labels"], batch["task"]  # (B, T), (B,)
        parts = {f"lm_{name}": (kinds == i, labels) for i, name in enumerate(TASK_KINDS)}
        if "align_targets" in batch:  # the recalled span alone: tokens whose copy is a target
            copied = torch.zeros_like(labels, dtype=torch.bool)
            copied[:, 1:] = batch["align_targets"][:, :-1] >= 0
            parts["lm_recall_span"] = (kinds == TASK_KINDS.index("recall"), labels.masked_fill(~copied, -100))
        token_nll = (
            None  # (B, T-1) with the output mixture: every scored position once, then averaged by part
        )
        if alone is not None:
            scored = labels[:, 1:] != -100
            token_nll = torch.zeros(scored.shape, dtype=torch.float32, device=labels.device)
            token_nll[scored] = mixture_token_nll(
                m, hidden.detach(), alone, labels, self._head, True, match, copy
            )
        for key, (sel, lab) in parts.items():
            if bool(sel.any()) and bool((lab[sel][:, 1:] != -100).any()):
                if token_nll is not None:
                    out[key] = token_nll[(lab[:, 1:] != -100) & sel[:, None]].mean()
                else:
                    out[key] = lm_loss(m, hidden[sel].detach(), lab[sel], self._head, True).detach()
        return out


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute activations in backward: the context encoder's layers and (for CEPE) the decoder's.

    The frozen decoder's layers are put in training mode for this (Llama-style decoders have no dropout;
    HF only checkpoints layers in training mode).
    """
    if isinstance(model, EncoderForMaskedLM):
        model.encoder.gradient_checkpointing = True
        return
    model.encoder.gradient_checkpointing = True
    enable = getattr(model.decoder, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.decoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model._train_decoder_layers = True  # read by set_train_mode


def set_train_mode(model: nn.Module) -> None:
    """``model.train()``, keeping the frozen decoder in eval mode except its layers under checkpointing."""
    model.train()
    if getattr(model, "_train_decoder_layers", False):
        from cepe.wrapping import decoder_layers

        for layer in decoder_layers(model.decoder):
            layer.train()
