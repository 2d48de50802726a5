"""Training configuration: validated dataclasses loaded from YAML or JSON, with ``key.sub=value`` overrides.

One :class:`TrainConfig` describes one stage (``mlm``, ``warmup``, ``cepe``, ``ceped``). Sizes follow the
paper's notation: n decoder tokens, K chunks of L tokens (m = K·L encoder tokens).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from cepe.config import check as _check
from cepe.configio import apply_overrides, read_config_file
from cepe.configio import build as _build
from cepe.fileio import write_json

STAGES = ("mlm", "warmup", "cepe", "ceped")
SYNTHETIC_KINDS = ("random", "distinct", "motif")
TASK_KINDS = ("lm", "copy", "recall", "qa", "icl")  # example kinds of a mixed CEPE stage (TrainConfig.tasks)
QA_SPAN_TOKENS = [3, 10]  # default length of free-form planted values (synthetic_qa.SPAN_TOKENS)
# Fields that change how fast or how safely a run goes but not its losses: left out of the fingerprint.
RUN_CONTROL_FIELDS = (
    "reference_path",
    "save_every_minutes",
    "snapshot_dir",
    "profile_steps",
    "peak_seconds",
    "stop_after",
    "keep_steps",
)


@dataclass
class DataConfig:
    """Where training windows come from.

    Attributes:
        corpus: a tokenized corpus directory written by ``cepe prepare-data --out DIR``.
        split: the corpus split to train on.
        ratio: ``(filter, cat)`` mixture ratio of the sequence builders (paper 2:1).
        filter_domains: domains eligible for *filter* windows (None = all).
        synthetic: instead of a corpus, ``"random"`` tokens, ``"distinct"`` random tokens (no token twice
            in a window: copying is unambiguous) or repeated random ``"motif"`` s (tests, smoke runs);
            needs no files.
        synthetic_vocab: token ids drawn by the synthetic source (default: the decoder's vocabulary).
        shuffle: the fraction of windows whose tokens are permuted (``true`` = all; seeded by the example):
            the decoder then cannot predict the next token from language, only by copying it from the
            encoder (copy warmup).
        seed: changes every window and every random mask.
    """

    corpus: str | None = None
    split: str = "train"
    ratio: list[int] = field(default_factory=lambda: [2, 1])
    filter_domains: list[str] | None = None
    synthetic: str | None = None
    synthetic_vocab: int | None = None
    shuffle: float = 0.0
    seed: int = 0

    def validate(self) -> None:
        _check(
            (self.corpus is None) != (self.synthetic is None),
            "data: give exactly one of data.corpus (a directory from `cepe prepare-data`) or data.synthetic "
            f"({' | '.join(SYNTHETIC_KINDS)})",
        )
        if self.synthetic is not None:
            _check(
                self.synthetic in SYNTHETIC_KINDS,
                f"data.synthetic must be one of {SYNTHETIC_KINDS}, got {self.synthetic!r}",
            )
        _check(len(self.ratio) == 2, f"data.ratio must be [filter, cat], got {self.ratio!r}")
        _check(
            0.0 <= float(self.shuffle) <= 1.0,
            f"data.shuffle must be in [0, 1] (or true/false), got {self.shuffle}",
        )


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay (paper: betas 0.9/0.999, eps 1e-8, 4 % warmup).

    Attributes:
        lr: peak learning rate.
        betas, eps, weight_decay: AdamW's.
        warmup_ratio: the share of the steps with a linear warmup to ``lr``: with ``w = ceil(warmup_ratio ×
            steps)``, step ``s < w`` runs at ``(s + 1) / w`` × ``lr`` (the first at ``lr / w``, not 0).
        min_lr_ratio: the cosine decays towards ``min_lr_ratio`` × ``lr``, which it reaches at step ``steps``
            (one past the last: the last step runs a little above it).
        max_grad_norm: gradient clipping (None or 0 = none).
        gate_lr: learning rate of the per-head cross-attention gates (``init_mode: gate``); None = ``lr``.
        lr_by_name: learning rates by parameter-name part, ``{"match_gate": 2e-2, "token_gate": 1e-3}``: a
            trainable parameter whose name contains a listed part learns at that part's rate (the first
            listed part that matches wins; ``gate_lr`` still sets the per-head gates); None = ``lr`` for all.
    """

    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    max_grad_norm: float | None = 1.0
    gate_lr: float | None = None
    lr_by_name: dict[str, float] | None = None

    def validate(self) -> None:
        _check(self.lr > 0, f"optim.lr must be positive, got {self.lr}")
        _check(
            self.gate_lr is None or self.gate_lr > 0, f"optim.gate_lr must be positive, got {self.gate_lr}"
        )
        if self.lr_by_name is not None:
            _check(
                isinstance(self.lr_by_name, dict)
                and len(self.lr_by_name) > 0
                and all(isinstance(k, str) and k for k in self.lr_by_name),
                f"optim.lr_by_name must map parameter-name parts to learning rates, got {self.lr_by_name!r}",
            )
            bad = {k: v for k, v in self.lr_by_name.items() if not (isinstance(v, (int, float)) and v > 0)}
            _check(not bad, f"optim.lr_by_name rates must be positive numbers, got {bad}")
        _check(len(self.betas) == 2, f"optim.betas must be two numbers, got {self.betas!r}")
        _check(
            self.max_grad_norm is None or self.max_grad_norm >= 0,
            f"optim.max_grad_norm must be a positive norm (or null / 0: no clipping), got {self.max_grad_norm} "
            "(a negative one would flip the sign of every gradient)",
        )
        _check(
            0.0 <= self.warmup_ratio < 1.0, f"optim.warmup_ratio must be in [0, 1), got {self.warmup_ratio}"
        )
        _check(
            0.0 <= self.min_lr_ratio <= 1.0, f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}"
        )


@dataclass
class TrainConfig:
    """One training stage.

    Model:
        output_dir: the stage's run directory (checkpoints, logs, status, and at the end its output:
            an encoder for ``mlm``, else a cepe adapter).
        decoder: the frozen decoder (``"default"``, a directory or hub id); ignored with ``tiny_decoder``.
        tiny_decoder: a dict of ``LlamaConfig`` fields: build a small random decoder in code (tests).
        decoder_dtype: ``"float32"`` or ``"bfloat16"`` weights for the frozen decoder.
        encoder: ``EncoderConfig`` fields (``vocab_size`` / ``mask_token_id`` are filled from the decoder:
            its vocabulary plus one ``[MASK]`` token). With ``init_adapter`` only ``causal`` is read: it
            switches the adapter's encoder between causal and bidirectional attention within a chunk.
        cepe: other ``CepeConfig`` fields (``num_cross_attn_layers``, ``init_mode``, ...). With
            ``init_adapter`` they are ignored, except ``null_key: true``, which adds zero "no match" keys
            to an adapter trained without them, and ``token_gate: true`` / ``match_gate: true``, which add
            per-token head strengths (zero: the adapter's function unchanged).
        init_encoder: an MLM stage output directory; the encoder starts from it (warmup).
        encoder_init: ``"random"`` (an encoder of its own, sized by ``encoder``) or ``"decoder"``: the
            encoder is a copy of the decoder's first ``encoder.num_hidden_layers`` layers (default 4) at
            the decoder's width, reading the decoder's embeddings (shared, not stored);
            ``encoder.causal`` runs it left-to-right within each chunk; ``encoder.output_size`` narrows Φ
            with a learned down-projection (initialised from the cross-attention's k/v maps, see
            :meth:`cepe.CepeForCausalLM.init_projection`). No MLM stage is needed.
        projection_fit_tokens: with ``encoder.output_size`` on an encoder built from the decoder (a new
            adapter, not ``init_adapter``): fit the down-projection to the encoder's states on this many
            tokens from the start of the training split, in chunks of the stage's chunk length
            (:meth:`cepe.CepeForCausalLM.fit_projection`); 0 = from the weights alone.
        init_adapter: a cepe adapter directory (a previous stage's output) to continue from.

    Layout:
        mlm_seq_length, mask_rate: MLM sequences (paper 512, 30 %).
        warmup_tokens, warmup_chunks: copy warmup: n tokens to both sides, the encoder as k chunks (256, 4).
        warmup_decoder_tokens: copy warmup where the decoder gets only a span of this many tokens from a
            seeded random place of the encoder's n tokens (it must find the span among the k chunks:
            retrieval, not only copying); None = the whole n (the paper's duplicate task).
        freeze_encoder: train only the cross-attention (the encoder keeps its initial weights).
        train_only: train only the parameters whose names contain one of these strings (for example
            ``[null_key]``: the "no match" keys alone; ``[cross_attn.o_proj, null_key]``); every other
            adapter weight keeps its initial value. None = all adapter weights train.
        match_gate_calibrate: at a fresh start, standardise new match gates' features (``CepeConfig.match_gate``,
            ``CepeForCausalLM.calibrate_match_gate``) on this many of the stage's first micro-batches
            (no gradient); norms an ``init_adapter`` already calibrated are kept. 0 = off.
        align_coef, align_heads, align_layers: copy warmup only: add ``align_coef`` × the mean negative log
            attention probability with which the first ``align_heads`` cross-attention heads of
            ``align_layers`` (None = all) attend, from decoder position t, to the encoder position of token
            t+1 (its copy): attention supervision that starts the copy mechanism (0 = off).
        n_decoder, chunk_length, n_chunks: CEPE / CEPED: the last n tokens to the decoder, the first K·L
            as K chunks to the encoder (paper 4096 + 16×256).
        chunk_noise, chunk_noise_whole: encoder noise per chunk (paper 0.3 and 0.1; default off for CEPED so
            that the student sees what the teacher saw).
        chunk_lengths: CEPE stages: per micro-batch, regroup the encoder's K·L tokens into chunks of a
            length drawn (seeded by step and micro-batch) from this list, each a divisor of K·L; the same
            tokens, masks and flat attention targets, cut differently, so that an adapter trained with L
            also reads the chunk lengths evaluations use (256 in the paper). None = always L.
        decoder_lengths: CEPE stage: per micro-batch, a decoder length drawn (seeded by step and micro-batch)
            from this list, each at most ``n_decoder``; the example is built from the window's last
            K·L + n tokens, so encoder and decoder stay contiguous and the answers of recall and qa
            examples come at the positions of a window of that length: one stage trains the positions
            of several decoder windows. None = always ``n_decoder``.
        context_chunks: CEPE stage: per micro-batch, an encoder chunk count drawn (seeded by step and
            micro-batch) from this list, each at most ``n_chunks``; the example is built from the window's
            last k·L + n_decoder tokens, so a micro-batch with fewer chunks costs less (unlike
            ``context_drop``, which masks chunks it still encodes) and one stage trains several context
            lengths at their own cost. With ``chunk_lengths``, each k·L must be a multiple of every chunk
            length. None = always ``n_chunks``.
        context_drop: CEPE stage: the probability that a continuation example (``lm``) keeps only its last
            ``k ~ U(1, K)`` encoder chunks, so that short contexts are trained as well as the full K·L.
        tasks: CEPE stage only: a mixed stage, ``{"lm": a, "copy": b, "recall": c, "qa": d, "icl": e}``,
            the shares of the example kinds of :func:`cepe.training.data.mixed_example` (CEPE continuation,
            span copy, cued recall, questions about facts planted in the context, in-context classification
            with demonstrations in the encoder), all in the CEPE layout; None = the paper's CEPE examples
            only.
        copy_shuffle: mixed stage: the fraction of copy examples whose encoder tokens are permuted.
        recall_cue, recall_span: mixed stage: cue tokens and ``[min, max]`` recalled tokens of a recall
            example.
        recall_foreign: mixed stage: the fraction of recall examples whose cue and span are another
            window's text planted over the encoder's (a needle the decoder's own text does not predict).
        copy_drop: mixed stage: the probability that a copy example keeps only its last ``k ~ U(1, K)``
            encoder chunks (at least the decoder's tokens) and copies from them, so that copying is trained
            at short context lengths too, not only at the full K·L.
        recall_drop: mixed stage: the probability that a recall example keeps only its last chunks, from
            one drawn uniformly at or before the cue's (the cue stays): recall at every context length.
        recall_detour: mixed stage: the probability that a recall example puts 1-3 of the decoder's own
            earlier tokens (unscored) between the cue and the span, which goes on where the cue ended.
        recall_anywhere: mixed stage: the probability that a recall example puts its cue and span at a
            decoder position drawn uniformly instead of at the decoder's end; the window's own text goes on
            after the span (the first token after it unscored): recall at every decoder position, as a
            question in a window of any length asks for it.
        qa_templates: mixed stage: how many of the fact templates of :mod:`cepe.training.synthetic_qa`
            qa examples draw from (1-12; the first 6 are those the first qa run used).
        qa_inline: mixed stage: the fraction of qa examples whose facts are planted inside the running text,
            right after a sentence's end, as a needle is (the others stand on lines of their own).
        icl_scored: mixed stage: score the labels of only the first this many complete demonstrations of an
            ``icl`` example's decoder (those with few demonstrations before them in the decoder, as the
            evaluation's query after 2 has); 0 = all.
        icl_arbitrary: mixed stage: the probability that an ``icl`` example names its classes by arbitrary
            words drawn anew (so the mapping can only be read from its demonstrations) rather than by their
            own names.
        icl_align: mixed stage, with ``align_coef``: supervise attention on the scored labels of ``icl``
            examples too: the decoder position before each label token is asked to attend to the same token
            of the label of the latest encoder demonstration of the same class (none where the encoder holds
            no demonstration of that class).
        qa_span: mixed stage: the probability that a planted fact's value is a few tokens of the encoder's
            own text (a free-form value to copy, as a needle's is) rather than a word from the fact lists.
        qa_span_tokens: mixed stage, with ``qa_span``: ``[min, max]`` tokens of such a value (``[3, 10]``,
            one short clause; longer values cross clause and sentence ends inside the answer).
        qa_compound: mixed stage: the probability that a planted fact is two facts in one sentence joined
            by ", and " (the second from the word lists), asked about the first: the answer restates the
            whole sentence, reading on past the clause that answers the question.
        qa_line_break: mixed stage: the probability that a ``qa`` answer breaks its line at a random space
            between words, as answers do in hard-wrapped windows: the break is not scored; the words after
            it are, with their attention targets on the unbroken copy in the encoder (the tokenizer may
            spell the word after a break differently).
        qa_decoys: mixed stage: the probability that every planted fact but the asked one is a decoy that
            opens with the asked fact's first two words (the same name, or the same template's words) and
            says something else: the answer's opening then stands in the encoder more than once, and the
            question alone says which copy to read on from, as a needle's opening words stand all over a
            haystack.
        qa_window_decoy: mixed stage: the probability that the decoder's own text before the question ends
            with a line opening with the answer's first one or two words and going on with words of the
            encoder's text: the window offers the answer's opening another continuation (as a haystack
            sentence that opens as a needle does can stand last in the window), and the question alone
            says to read on from the encoder's copy.

    CEPED:
        teacher_dir: where ``cepe teacher`` writes (and training reads) the top-k teacher distributions.
        teacher_decoder: the teacher (default: ``decoder``), run on concat(C, X) in its own context.
        teacher_examples_per_shard: examples per teacher shard file.
        top_k: stored teacher tokens per position (50).
        ce_coef, kl_coef: loss = ce_coef·CE + kl_coef·KL (paper 1 and 2).
        kl_form: ``"drop"`` (the released code's form and the default: the teacher's top-k probabilities
            against the student's full-softmax probabilities at those ids, neither renormalised),
            ``"renorm"`` (both renormalised over the teacher's top-k: the student's mass elsewhere is free)
            or ``"other"`` (a (k+1)-th bucket holding the leftover mass, teacher smoothed by
            ``kl_smoothing``); see :func:`cepe.training.losses.topk_kl`. The KL counts only positions whose
            label is not -100, as the cross-entropy. With ``cepe.output_mix`` (stage ``cepe``) the student
            is the output mixture: its cross-entropy and KL are of the mixed logits, so a reader trained
            under fixed heads (``train_only`` naming the reader's parts) learns what the heads leave to it.
        kl_smoothing: the smoothing ``s`` of the ``"other"`` KL form, whose teacher becomes
            ``(1 - s)·p + s/(k+1)`` (never zero).
        online_teacher: the frozen decoder itself is the teacher, run during training (no teacher pass,
            no ``teacher_dir``): it reads the example's context in its own window (the encoder tokens the
            student sees, noise-masked and padding tokens dropped, in order, before the decoder tokens;
            for ``qa`` examples after the chat template's opening), and the loss becomes ``ce_coef``·CE +
            ``kl_coef``·KL over its top ``top_k`` tokens at every scored position. Stages ``cepe``
            (mixed or not) and ``ceped``. Costs one decoder forward over K·L + n tokens per example. Where
            K·L + n exceeds the teacher's positions (``max_position_embeddings``), it reads the context's
            last tokens that fit.
        teacher_tasks: mixed stage with ``online_teacher``: the kinds (of ``tasks``) whose examples get the
            teacher's KL; the others are trained on their cross-entropy alone and the teacher is not run
            for them (a decoder that cannot copy from 8K of its own window is no teacher for recall).
            None = every kind.
        teacher_context: mixed stage with ``online_teacher`` and ``lm`` among ``teacher_tasks``: ``lm``
            examples keep only the last ``teacher_context`` tokens of their context (whole chunks; for the
            student and the teacher), so continuation is distilled at a length where the decoder reads well
            while the other kinds keep the full K·L. None = the full length. With ``context_chunks``, a
            layout whose context is already that short keeps it whole.
        teacher_adapter: with ``online_teacher``: the teacher is this CEPE adapter (a directory
            :meth:`cepe.modeling.CepeForCausalLM.from_pretrained` loads, over its own frozen copy of the
            decoder) reading the example's context through its own encoder, the context's kept tokens
            re-chunked to its ``chunk_length``, instead of the decoder reading the context in its window:
            an earlier adapter teaches what it does better (e.g. continuation from a short context)
            while the student keeps what it learned. Costs one forward of that adapter per taught example
            (its head only at the scored positions). It must have been trained over the stage's decoder:
            one of another vocabulary or shape is refused, one that records another decoder name warns.
        teacher_drop_mixture: with ``teacher_adapter``: teach with its reader alone, without its output
            mixture and copy (as ``cepe export --drop-mixture``), so that a student without the mixture
            is taught the distribution it can represent.
        teacher_max_context: with ``online_teacher``: the teacher runs only for examples whose kept
            context has at most this many tokens; longer ones train on their cross-entropy alone. None =
            no limit.

    Loop:
        steps: optimizer steps. batch_size: examples per optimizer step over all processes.
        micro_batch_size: examples per forward per process (accumulation fills the rest).
        bf16: bf16 autocast (fp32 losses): ``true``, ``false`` or ``"auto"`` (bf16 where its matmuls are
            faster than fp32 on the training device, see :mod:`cepe.compute`). gradient_checkpointing: recompute activations in backward.
        save_every, keep_checkpoints, log_every, seed, progress, num_threads: as named.

    Speed and run control (none of these changes the losses; they are not part of :meth:`fingerprint`):
        reference_path: run the plain computations (autocast casts the frozen weights every call, full
            logits for the loss) instead of the fast paths of :mod:`cepe.training.speed`.
        save_every_minutes: also checkpoint when this many minutes passed since the last checkpoint.
        snapshot_dir: at every checkpoint also write the trainable weights alone here (small, meant to be
            committed); a resumed run with no checkpoint continues the stage from this snapshot.
        profile_steps: write a per-op ``torch.profiler`` table of this many steps to ``profile.txt``.
        peak_seconds: how long the matmul peak is measured at the start (0 = not measured).
        stop_after: checkpoint and end the process after this step, the schedule still spanning ``steps``
            (a run spread over sessions, or arms compared at the same step); resume it later with a later
            ``stop_after`` or none. None = run to ``steps``.
        keep_steps: checkpoints at these steps are never rotated out (``keep_checkpoints`` counts the
            others): a later stage that starts from a step before the end finds it after the run.
    """

    stage: str
    output_dir: str
    decoder: str = "default"
    tiny_decoder: dict[str, Any] | None = None
    decoder_dtype: str = "float32"
    encoder: dict[str, Any] = field(default_factory=dict)
    cepe: dict[str, Any] = field(default_factory=dict)
    init_encoder: str | None = None
    init_adapter: str | None = None
    encoder_init: str = "random"
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    # layouts
    mlm_seq_length: int = 512
    mask_rate: float = 0.3
    warmup_tokens: int = 256
    warmup_chunks: int = 4
    warmup_decoder_tokens: int | None = None
    freeze_encoder: bool = False
    projection_fit_tokens: int = 0
    train_only: list[str] | None = None
    match_gate_calibrate: int = 0
    align_coef: float = 0.0
    align_heads: int = 3
    align_layers: list[int] | None = None
    n_decoder: int = 4096
    chunk_length: int = 256
    n_chunks: int = 16
    chunk_noise: float | None = None
    chunk_noise_whole: float = 0.1
    context_drop: float = 0.0
    chunk_lengths: list[int] | None = None
    decoder_lengths: list[int] | None = None
    context_chunks: list[int] | None = None
    tasks: dict[str, float] | None = None
    copy_shuffle: float = 0.0
    copy_drop: float = 0.0
    recall_cue: int = 8
    recall_span: list[int] = field(default_factory=lambda: [8, 32])
    recall_foreign: float = 0.0
    recall_drop: float = 0.0
    recall_detour: float = 0.0
    recall_anywhere: float = 0.0
    qa_templates: int = 6
    qa_inline: float = 0.0
    qa_span: float = 0.0
    qa_span_tokens: list[int] = field(default_factory=lambda: list(QA_SPAN_TOKENS))
    qa_compound: float = 0.0
    qa_line_break: float = 0.0
    qa_decoys: float = 0.0
    qa_window_decoy: float = 0.0
    icl_scored: int = 0
    icl_arbitrary: float = 0.5
    icl_align: bool = False
    # CEPED
    teacher_dir: str | None = None
    teacher_decoder: str | None = None
    teacher_examples_per_shard: int = 64
    top_k: int = 50
    ce_coef: float = 1.0
    kl_coef: float = 2.0
    kl_form: str = "drop"
    kl_smoothing: float = 1e-4
    online_teacher: bool = False
    teacher_tasks: list[str] | None = None
    teacher_context: int | None = None
    teacher_adapter: str | None = None
    teacher_drop_mixture: bool = False
    teacher_max_context: int | None = None
    # loop
    steps: int = 100
    batch_size: int = 8
    micro_batch_size: int = 1
    bf16: bool | str = "auto"
    gradient_checkpointing: bool = False
    save_every: int = 50
    keep_checkpoints: int = 2
    log_every: int = 1
    seed: int = 0
    progress: bool = True
    num_threads: int | None = None
    # speed and run control (not in the fingerprint)
    reference_path: bool = False
    save_every_minutes: float | None = None
    snapshot_dir: str | None = None
    profile_steps: int = 0
    peak_seconds: float = 0.5
    stop_after: int | None = None
    keep_steps: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.data, dict):
            self.data = _build(DataConfig, self.data, "data")
        if isinstance(self.optim, dict):
            self.optim = _build(OptimConfig, self.optim, "optim")
        if self.chunk_noise is None:
            self.chunk_noise = 0.0 if self.stage == "ceped" else 0.3
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field and what to change."""
        _check(self.stage in STAGES, f"stage must be one of {STAGES}, got {self.stage!r}")
        _check(bool(self.output_dir), "output_dir must be set")
        self.data.validate()
        self.optim.validate()
        for name in (
            "steps",
            "batch_size",
            "micro_batch_size",
            "save_every",
            "log_every",
            "top_k",
            "teacher_examples_per_shard",
        ):
            _check(int(getattr(self, name)) > 0, f"{name} must be positive, got {getattr(self, name)}")
        for name in (
            "mlm_seq_length",
            "warmup_tokens",
            "warmup_chunks",
            "n_decoder",
            "chunk_length",
            "n_chunks",
        ):
            _check(int(getattr(self, name)) > 0, f"{name} must be positive, got {getattr(self, name)}")
        _check(0.0 < self.mask_rate < 1.0, f"mask_rate must be in (0, 1), got {self.mask_rate}")
        _check(self.align_coef >= 0, f"align_coef must be >= 0, got {self.align_coef}")
        if self.train_only is not None:
            _check(
                self.stage != "mlm",
                "train_only selects adapter weights (encoder and cross-attention); the mlm stage trains its "
                "whole model: remove train_only",
            )
            _check(
                isinstance(self.train_only, list)
                and len(self.train_only) > 0
                and all(isinstance(x, str) and x for x in self.train_only),
                f"train_only must be a non-empty list of parameter-name parts, got {self.train_only!r}",
            )
        _check(
            self.match_gate_calibrate >= 0,
            f"match_gate_calibrate must be >= 0, got {self.match_gate_calibrate}",
        )
        _check(self.align_heads > 0, f"align_heads must be positive, got {self.align_heads}")
        if self.align_coef > 0:
            _check(
                self.stage == "warmup" or (self.stage == "cepe" and self.tasks is not None),
                "align_coef (attention supervision) needs the copy warmup stage or a mixed CEPE stage (tasks)",
            )
        _check(0.0 <= self.context_drop <= 1.0, f"context_drop must be in [0, 1], got {self.context_drop}")
        _check(
            self.context_drop == 0 or self.stage == "cepe" or self.online_teacher,
            f"context_drop needs the cepe stage or the online teacher (stage {self.stage!r}): the offline "
            "teacher read every chunk, so a student that drops some would be taught another context",
        )
        if self.tasks is not None:
            self._validate_tasks()
        if self.chunk_lengths is not None:
            total = self.n_chunks * self.chunk_length
            _check(
                self.stage in ("cepe", "ceped"),
                f"chunk_lengths regroups the encoder of the cepe and ceped stages, not {self.stage}; remove it",
            )
            _check(
                len(self.chunk_lengths) > 0
                and all(int(c) > 0 and total % int(c) == 0 for c in self.chunk_lengths),
                f"chunk_lengths must be divisors of n_chunks × chunk_length = {total}, got {self.chunk_lengths}",
            )
        if self.decoder_lengths is not None:
            self._validate_decoder_lengths()
        if self.context_chunks is not None:
            self._validate_context_chunks()
        if self.warmup_decoder_tokens is not None:
            _check(
                1 < self.warmup_decoder_tokens <= self.warmup_tokens,
                f"warmup_decoder_tokens must be in 2..warmup_tokens ({self.warmup_tokens}), got "
                f"{self.warmup_decoder_tokens}",
            )
        _check(
            self.warmup_tokens % self.warmup_chunks == 0,
            f"warmup_tokens {self.warmup_tokens} must be a multiple of warmup_chunks {self.warmup_chunks}",
        )
        _check(0.0 <= self.chunk_noise <= 1.0, f"chunk_noise must be in [0, 1], got {self.chunk_noise}")
        _check(
            0.0 <= self.chunk_noise_whole <= 1.0,
            f"chunk_noise_whole must be in [0, 1], got {self.chunk_noise_whole}",
        )
        from .losses import KL_FORMS  # here, not at the top: `cepe train --help` reads this module (no torch)

        _check(self.kl_form in KL_FORMS, f"kl_form must be one of {KL_FORMS}, got {self.kl_form!r}")
        for name in ("ce_coef", "kl_coef"):  # a negative one would maximise its loss
            _check(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        _check(
            0.0 <= self.kl_smoothing < 1.0,
            f"kl_smoothing must be in [0, 1) (the teacher's share spread evenly), got {self.kl_smoothing}",
        )
        _check(self.decoder_dtype in ("float32", "bfloat16"), "decoder_dtype must be float32 or bfloat16")
        _check(self.bf16 in (True, False, "auto"), f"bf16 must be true, false or auto, got {self.bf16!r}")
        _check(
            self.decoder_dtype == "float32" or self.bf16 is True,
            "decoder_dtype bfloat16 needs bf16 autocast (bf16: true) so that fp32 cross-attention matches it",
        )
        _check(self.keep_checkpoints >= 1, "keep_checkpoints must be at least 1")
        self.keep_steps = tuple(int(s) for s in self.keep_steps)
        _check(
            all(0 < s <= self.steps for s in self.keep_steps),
            f"keep_steps must lie in 1..steps ({self.steps}), got {list(self.keep_steps)}",
        )
        bad = [s for s in self.keep_steps if s % self.save_every and s != self.steps]
        _check(
            not bad,
            f"keep_steps {bad} are not checkpointed: each must be a multiple of save_every ({self.save_every}) "
            "or the last step",
        )
        _check(
            self.save_every_minutes is None or self.save_every_minutes > 0,
            f"save_every_minutes must be positive (or null), got {self.save_every_minutes}",
        )
        _check(self.profile_steps >= 0, f"profile_steps must be >= 0, got {self.profile_steps}")
        _check(
            self.stop_after is None or self.stop_after > 0,
            f"stop_after must be a positive step (or null), got {self.stop_after}",
        )
        _check(self.peak_seconds >= 0, f"peak_seconds must be >= 0, got {self.peak_seconds}")
        _check(
            self.batch_size % self.micro_batch_size == 0,
            f"batch_size {self.batch_size} must be a multiple of micro_batch_size {self.micro_batch_size}",
        )
        if self.stage == "ceped":
            _check(
                bool(self.teacher_dir) or self.online_teacher,
                "stage ceped needs teacher_dir (where `cepe teacher --config FILE` writes the teacher outputs) "
                "or online_teacher: true (the decoder reads the context during training)",
            )
        if self.online_teacher:
            _check(
                self.stage in ("cepe", "ceped"),
                f"online_teacher (the decoder reading the context as the teacher) needs stage cepe or ceped, "
                f"got {self.stage!r}",
            )
            _check(
                self.teacher_dir is None,
                "online_teacher computes the teacher during training; remove teacher_dir (or online_teacher)",
            )
        if self.teacher_tasks is not None:
            _check(
                self.online_teacher and self.tasks is not None,
                "teacher_tasks picks which kinds of a mixed stage get the online teacher; it needs "
                "online_teacher: true and tasks",
            )
            _check(
                isinstance(self.teacher_tasks, list) and set(self.teacher_tasks) <= set(self.tasks or {}),
                f"teacher_tasks must be a list of kinds named in tasks ({sorted(self.tasks or {})}), "
                f"got {self.teacher_tasks!r}",
            )
        if self.teacher_adapter is not None or self.teacher_max_context is not None:
            _check(
                self.online_teacher,
                "teacher_adapter and teacher_max_context choose the online teacher and where it runs; they "
                "need online_teacher: true",
            )
        _check(
            not self.teacher_drop_mixture or self.teacher_adapter is not None,
            "teacher_drop_mixture drops the output mixture of teacher_adapter; it needs teacher_adapter",
        )
        _check(
            self.teacher_max_context is None or self.teacher_max_context > 0,
            f"teacher_max_context must be a positive token count (or null), got {self.teacher_max_context}",
        )
        if self.teacher_context is not None:
            _check(
                "lm" in (self.teacher_tasks or []),
                "teacher_context shortens the context of the lm examples the online teacher runs for; it "
                "needs teacher_tasks with lm",
            )
            _check(
                0 < self.teacher_context <= self.n_chunks * self.chunk_length
                and self.teacher_context % self.chunk_length == 0,
                f"teacher_context must be a positive multiple of chunk_length ({self.chunk_length}) up to "
                f"n_chunks × chunk_length ({self.n_chunks * self.chunk_length}), got {self.teacher_context}",
            )
        if self.stage == "mlm":
            _check(self.init_adapter is None, "the mlm stage trains the encoder alone; remove init_adapter")
        for key in ("vocab_size", "mask_token_id"):
            _check(key not in self.encoder, f"encoder.{key} is filled from the decoder; remove it")
        _check(
            self.encoder_init in ("random", "decoder"),
            f"encoder_init must be 'random' or 'decoder', got {self.encoder_init!r}",
        )
        if self.encoder_init == "decoder":
            extra = sorted(set(self.encoder) - {"num_hidden_layers", "causal", "output_size"})
            _check(
                not extra,
                f"encoder_init: decoder takes the decoder's layer shape; only encoder.num_hidden_layers, "
                f"encoder.causal and encoder.output_size may be set, got {extra}",
            )
            _check(
                self.init_encoder is None and self.stage != "mlm",
                "encoder_init: decoder needs no MLM stage: remove init_encoder (and run warmup/cepe directly)",
            )
        if self.cepe.get("output_mix"):
            _check(
                self.stage in ("warmup", "cepe"),
                "cepe.output_mix trains on the mixture's next-token loss (and with online_teacher or "
                "teacher_dir its KL to the teacher); stage ceped scores the reader alone: use stage cepe "
                "with a teacher, or remove output_mix",
            )
        if self.projection_fit_tokens:
            _check(
                int(self.projection_fit_tokens) > 0,
                f"projection_fit_tokens must be a number of tokens >= 0, got {self.projection_fit_tokens}",
            )
            _check(
                self.encoder_init == "decoder"
                and self.encoder.get("output_size")
                and self.init_adapter is None,
                "projection_fit_tokens fits a new adapter's down-projection: it needs encoder_init: decoder, "
                "encoder.output_size and no init_adapter",
            )
            _check(
                self.data.corpus is not None,
                "projection_fit_tokens reads the training split: it needs data.corpus (not synthetic data)",
            )

    def _validate_tasks(self) -> None:
        _check(self.stage == "cepe", f"tasks (a mixed stage) needs stage cepe, got {self.stage!r}")
        _check(
            isinstance(self.tasks, dict) and set(self.tasks) <= set(TASK_KINDS),
            f"tasks must map some of {TASK_KINDS} to shares, got {self.tasks!r}",
        )
        shares = [float(v) for v in self.tasks.values()]
        _check(
            all(v >= 0 for v in shares) and sum(shares) > 0,
            f"task shares must be >= 0 and not all zero, got {self.tasks!r}",
        )
        _check(0.0 <= self.copy_shuffle <= 1.0, f"copy_shuffle must be in [0, 1], got {self.copy_shuffle}")
        _check(
            len(self.recall_span) == 2,
            f"recall_span must be [min, max] (two token counts), got {self.recall_span}",
        )
        lo, hi = (int(x) for x in self.recall_span)
        _check(1 <= lo <= hi, f"recall_span must be [min, max] with 1 <= min <= max, got {self.recall_span}")
        _check(self.recall_cue >= 1, f"recall_cue must be >= 1, got {self.recall_cue}")
        _check(
            0.0 <= self.recall_foreign <= 1.0, f"recall_foreign must be in [0, 1], got {self.recall_foreign}"
        )
        _check(0.0 <= self.recall_drop <= 1.0, f"recall_drop must be in [0, 1], got {self.recall_drop}")
        _check(0.0 <= self.copy_drop <= 1.0, f"copy_drop must be in [0, 1], got {self.copy_drop}")
        _check(0.0 <= self.recall_detour <= 1.0, f"recall_detour must be in [0, 1], got {self.recall_detour}")
        _check(
            0.0 <= self.recall_anywhere <= 1.0,
            f"recall_anywhere must be in [0, 1], got {self.recall_anywhere}",
        )
        _check(1 <= self.qa_templates <= 12, f"qa_templates must be in 1..12, got {self.qa_templates}")
        _check(0.0 <= self.qa_inline <= 1.0, f"qa_inline must be in [0, 1], got {self.qa_inline}")
        _check(0.0 <= self.qa_span <= 1.0, f"qa_span must be in [0, 1], got {self.qa_span}")
        _check(0.0 <= self.qa_compound <= 1.0, f"qa_compound must be in [0, 1], got {self.qa_compound}")
        _check(0.0 <= self.qa_line_break <= 1.0, f"qa_line_break must be in [0, 1], got {self.qa_line_break}")
        _check(0.0 <= self.qa_decoys <= 1.0, f"qa_decoys must be in [0, 1], got {self.qa_decoys}")
        _check(
            0.0 <= self.qa_window_decoy <= 1.0,
            f"qa_window_decoy must be in [0, 1], got {self.qa_window_decoy}",
        )
        _check(
            len(self.qa_span_tokens) == 2 and 1 <= int(self.qa_span_tokens[0]) <= int(self.qa_span_tokens[1]),
            f"qa_span_tokens must be [min, max] with 1 <= min <= max, got {self.qa_span_tokens}",
        )
        _check(self.icl_scored >= 0, f"icl_scored must be >= 0 (0 = every label), got {self.icl_scored}")
        _check(0.0 <= self.icl_arbitrary <= 1.0, f"icl_arbitrary must be in [0, 1], got {self.icl_arbitrary}")
        _check(
            not self.icl_align or self.align_coef > 0,
            "icl_align supervises attention: it needs align_coef > 0 (set align_coef, or drop icl_align)",
        )
        room = min(self.n_decoder, self.n_chunks * self.chunk_length)
        _check(
            self.recall_cue + hi <= room,
            f"recall_cue + recall_span max = {self.recall_cue + hi} must fit in the decoder and the encoder "
            f"({room} tokens); shorten them",
        )

    def _validate_decoder_lengths(self) -> None:
        lengths = self._check_drawn_list("decoder_lengths", "n_decoder", "decoder")
        self._check_layouts(
            "decoder_lengths",
            [(f"{n} decoder tokens", {"n_decoder": n}) for n in sorted(set(lengths)) if n != self.n_decoder],
        )

    def _validate_context_chunks(self) -> None:
        counts = self._check_drawn_list("context_chunks", "n_chunks", "encoder")
        decoder = sorted(set(self.decoder_lengths or [self.n_decoder]))  # drawn independently
        self._check_layouts(
            "context_chunks",
            [
                (f"{k} chunks and {n} decoder tokens", {"n_decoder": n, "n_chunks": k})
                for k in sorted(set(counts))
                if k != self.n_chunks
                for n in decoder
            ],
        )

    def _check_drawn_list(self, name: str, limit_name: str, varies: str) -> list[int]:
        """A list drawn from per micro-batch (``decoder_lengths``, ``context_chunks``): the cepe stage only,
        integers from 1 to the field ``limit_name`` it varies. Returns the list."""
        values, limit = getattr(self, name), getattr(self, limit_name)
        _check(
            self.stage == "cepe", f"{name} varies the {varies} of the cepe stage, not {self.stage}; remove it"
        )
        _check(
            isinstance(values, list)
            and len(values) > 0
            and all(isinstance(v, int) and 1 <= v <= limit for v in values),
            f"{name} must be a non-empty list of integers from 1 to {limit_name} = {limit}, got {values!r}",
        )
        return values

    def _check_layouts(self, name: str, layouts: list[tuple[str, dict[str, int]]]) -> None:
        """Every ``(label, at_layout arguments)`` a drawn list can give builds a valid config; else the
        error of the first that does not, prefixed with the list's name and the label."""
        for label, kwargs in layouts:
            try:
                self.at_layout(**kwargs)
            except ValueError as e:
                raise ValueError(f"{name}: with {label}, {e}") from None

    def at_layout(self, n_decoder: int | None = None, n_chunks: int | None = None) -> TrainConfig:
        """This config with ``n_decoder`` decoder tokens (one of ``decoder_lengths``) and ``n_chunks``
        encoder chunks (one of ``context_chunks``), None keeping its own: the layout of one micro-batch's
        examples, validated as a config of its own (a layout it cannot build raises ValueError). A layout
        whose whole context is no longer than ``teacher_context`` has nothing to cut: it keeps it all."""
        k = self.n_chunks if n_chunks is None else n_chunks
        tc = self.teacher_context
        return dataclasses.replace(
            self,
            n_decoder=self.n_decoder if n_decoder is None else n_decoder,
            n_chunks=k,
            decoder_lengths=None,
            context_chunks=None,
            teacher_context=None if tc is not None and tc >= k * self.chunk_length else tc,
        )

    # ------------------------------------------------------------------ derived sizes
    @property
    def window_length(self) -> int:
        """Tokens per training window: T of the stage's layout."""
        if self.stage == "mlm":
            return self.mlm_seq_length
        if self.stage == "warmup":
            return self.warmup_tokens
        return self.n_chunks * self.chunk_length + self.n_decoder

    @property
    def stop_step(self) -> int:
        """The step this process ends after: ``stop_after`` when it comes before ``steps``."""
        return self.steps if self.stop_after is None else min(self.steps, self.stop_after)

    @property
    def stage_chunk_length(self) -> int:
        """L, encoder tokens per chunk in this stage."""
        return self.warmup_tokens // self.warmup_chunks if self.stage == "warmup" else self.chunk_length

    def grad_accum(self, world_size: int) -> int:
        """Micro-batches per optimizer step on each of ``world_size`` processes."""
        per = self.micro_batch_size * world_size
        _check(
            self.batch_size % per == 0,
            f"batch_size {self.batch_size} is not a multiple of micro_batch_size × processes = "
            f"{self.micro_batch_size} × {world_size}; change batch_size or micro_batch_size",
        )
        return self.batch_size // per

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """A hash of the fields that decide the computed losses: every field but ``output_dir``, ``progress``,
        ``save_every``, ``keep_checkpoints``, ``log_every``, ``num_threads`` and :data:`RUN_CONTROL_FIELDS`
        (fields added later are left out at their defaults). The paths it holds (``decoder``,
        ``init_adapter``, ``data.corpus``, ...) and ``steps`` (the schedule spans them) count; so do a few
        fields that do not change the losses (``gradient_checkpointing``, ``teacher_examples_per_shard``),
        kept so that the fingerprints of recorded runs stay the same."""
        d = self.to_dict()
        for key in ("output_dir", "progress", "save_every", "keep_checkpoints", "log_every", "num_threads"):
            d.pop(key, None)
        # fields added later are left out at their defaults, so older runs keep their fingerprint
        if d.get("encoder_init") == "random":
            d.pop("encoder_init")
        if not d["data"].get("shuffle"):
            d["data"].pop("shuffle", None)
        for key in (
            "warmup_decoder_tokens",
            "freeze_encoder",
            "train_only",
            "match_gate_calibrate",
            "align_coef",
            "projection_fit_tokens",
        ):
            if not d.get(key):
                d.pop(key, None)
        if d.get("tasks") is None:
            for key in ("tasks", "copy_shuffle", "recall_cue", "recall_span"):
                d.pop(key, None)
        if not d.get("online_teacher"):
            d.pop("online_teacher", None)
        for key in ("teacher_tasks", "teacher_context", "teacher_adapter", "teacher_max_context"):
            if d.get(key) is None:
                d.pop(key, None)
        if not d.get("teacher_drop_mixture"):
            d.pop("teacher_drop_mixture", None)
        if d.get("qa_templates") == 6:
            d.pop("qa_templates")
        if list(d.get("qa_span_tokens") or []) == QA_SPAN_TOKENS:
            d.pop("qa_span_tokens", None)
        for key in (
            "qa_inline",
            "qa_span",
            "qa_compound",
            "qa_line_break",
            "qa_decoys",
            "qa_window_decoy",
            "context_drop",
            "icl_scored",
            "chunk_lengths",
            "decoder_lengths",
            "context_chunks",
            "recall_foreign",
            "recall_drop",
            "recall_detour",
            "recall_anywhere",
            "copy_drop",
        ):
            if not d.get(key):
                d.pop(key, None)
        if d.get("icl_arbitrary") == 0.5:
            d.pop("icl_arbitrary")
        if not d.get("icl_align"):
            d.pop("icl_align", None)
        if "align_coef" not in d:
            d.pop("align_heads", None)
            d.pop("align_layers", None)
        for key in ("gate_lr", "lr_by_name"):
            if d["optim"].get(key) is None:
                d["optim"].pop(key, None)
        for key in RUN_CONTROL_FIELDS:
            d.pop(key, None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json(path, self.to_dict(), indent=2, sort_keys=True)


def load_config(
    path: str | os.PathLike[str] | dict[str, Any],
    overrides: list[str] | None = None,
    stage: str | None = None,
) -> TrainConfig:
    """Load and validate a stage config.

    Args:
        path: a YAML/JSON file, or an already read mapping.
        overrides: ``key.sub=value`` strings applied before validation.
        stage: the stage the caller runs; must agree with the file's ``stage`` (filled in if absent).

    Raises:
        ValueError: unknown keys, bad values or a stage mismatch (the message names the field).
    """
    source = None if isinstance(path, dict) else path
    data = read_config_file(path) if source is not None else dict(path)
    data = json.loads(json.dumps(data))  # plain JSON values (as the fingerprint sees them)
    data = apply_overrides(data, list(overrides or []))
    if stage is not None:
        if data.get("stage", stage) != stage:
            raise ValueError(
                f"the config is for stage {data['stage']!r} but stage {stage!r} was requested; "
                "pass the matching --stage or config file"
            )
        data["stage"] = stage
    try:
        return _build(TrainConfig, data, "config")
    except ValueError as err:
        raise ValueError(f"{source}: {err}" if source is not None else str(err)) from err
