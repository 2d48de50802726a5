"""Training examples of each stage as pure functions of ``(config, example index)``.

Every random choice (the window, the MLM mask, the chunk noise) is seeded by the example index, so a
resumed run, or another process, builds exactly the same examples.

Shape legend: B batch, K chunks, L chunk length, T window tokens, n decoder tokens.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import TASK_KINDS, TrainConfig

_MLM_TAG, _NOISE_TAG, _SYNTH_TAG, _SHUFFLE_TAG, _SPAN_TAG, _TASK_TAG = 11, 13, 17, 19, 23, 29
_DROP_TAG, _ICL_TAG, _REGROUP_TAG, _FOREIGN_TAG, _RECALL_DROP_TAG, _DETOUR_TAG = 31, 37, 41, 43, 47, 53
_COPY_DROP_TAG, _ANYWHERE_TAG, _DECODER_LENGTH_TAG, _CONTEXT_CHUNKS_TAG = 59, 61, 67, 71
FOREIGN_OFFSET = 10_000_019
"""A ``recall_foreign`` example ``i`` takes its planted text from window ``i + FOREIGN_OFFSET`` of the source."""


def example_generator(seed: int, tag: int, index: int) -> torch.Generator:
    """A torch generator seeded by ``(seed, tag, index)`` (independent streams per use and example)."""
    mixed = np.random.SeedSequence([int(seed), int(tag), int(index)]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(mixed[0]) << 31 ^ int(mixed[1]))


class SyntheticWindows:
    """Token windows that need no files: ``"random"`` uniform tokens, ``"distinct"`` uniform tokens without
    repeats (a random permutation's prefix; needs ``seq_length <= vocab_size``), or a ``"motif"`` of 3-12
    Zipf-distributed tokens repeated (frequencies learnable at once, the rest predictable from context)."""

    def __init__(self, kind: str, vocab_size: int, seq_length: int, seed: int = 0) -> None:
        self.kind, self.vocab_size, self.seq_length, self.seed = kind, int(vocab_size), int(seq_length), seed

    def __getitem__(self, i: int) -> torch.Tensor:
        g = example_generator(self.seed, _SYNTH_TAG, i)
        if self.kind == "random":
            return torch.randint(0, self.vocab_size, (self.seq_length,), generator=g)
        if self.kind == "distinct":
            if self.seq_length > self.vocab_size:
                raise ValueError(
                    f"synthetic 'distinct' windows of {self.seq_length} tokens need at least that many token ids, "
                    f"got a vocabulary of {self.vocab_size}; shorten the window or use 'random'"
                )
            return torch.randperm(self.vocab_size, generator=g)[: self.seq_length]
        period = int(torch.randint(3, 13, (1,), generator=g))
        zipf = 1.0 / torch.arange(1, self.vocab_size + 1, dtype=torch.float64)
        motif = torch.multinomial(zipf, period, replacement=True, generator=g)
        reps = -(-self.seq_length // period)
        return motif.repeat(reps)[: self.seq_length].clone()


def corpus_digest(cfg: TrainConfig) -> str | None:
    """SHA-256 (first 16 hex digits) of the training corpus: its ``index.json`` (documents, lengths,
    tokenizer) and each token shard's size and bytes (the first and last MiB of a larger shard), so that a
    corpus prepared again into the same directory reads as another; None for synthetic data."""
    if cfg.data.synthetic is not None or not cfg.data.corpus:
        return None
    import hashlib

    from cepe.data.tokenized import INDEX_FILE

    root = Path(cfg.data.corpus)
    if not (root / INDEX_FILE).is_file():
        return None  # TokenizedCorpus says what is wrong with the directory
    h = hashlib.sha256((root / INDEX_FILE).read_bytes())
    part = 1 << 20
    for shard in sorted(root.glob("*.npy")):
        size = shard.stat().st_size
        h.update(f"{shard.name}|{size}|".encode())
        with open(shard, "rb") as f:
            h.update(f.read(part))
            if size > 2 * part:
                f.seek(size - part)
            h.update(f.read(part))
    return h.hexdigest()[:16]


def window_source(cfg: TrainConfig, vocab_size: int) -> Any:
    """The indexable source of ``(T,)`` windows for ``cfg`` (``src[i]``, any ``i >= 0``).

    Args:
        vocab_size: the decoder's vocabulary (bounds synthetic tokens; checked against the corpus).
    """
    d = cfg.data
    if d.synthetic is not None:
        if d.synthetic_vocab and int(d.synthetic_vocab) > vocab_size:
            raise ValueError(
                f"data.synthetic_vocab is {d.synthetic_vocab} but the decoder has a {vocab_size}-token "
                f"vocabulary: give at most {vocab_size} (or none: the decoder's)"
            )
        return SyntheticWindows(d.synthetic, d.synthetic_vocab or vocab_size, cfg.window_length, d.seed)
    from cepe.data.sequences import SequenceMixture
    from cepe.data.tokenized import TokenizedCorpus

    corpus = TokenizedCorpus(d.corpus)
    if corpus.vocab_size > vocab_size:
        raise ValueError(
            f"corpus {d.corpus} was tokenized with a {corpus.vocab_size}-token vocabulary but the decoder has "
            f"{vocab_size}; prepare the data with the decoder's tokenizer (cepe prepare-data --tokenizer)"
        )
    return SequenceMixture(
        corpus,
        d.split,
        seq_length=cfg.window_length,
        ratio=(int(d.ratio[0]), int(d.ratio[1])),
        seed=d.seed,
        filter_domains=d.filter_domains,
    )


def chunk_noise_mask(
    mask: torch.Tensor, p_mask: float, p_whole: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Chunk-masking noise (Appendix A) on a ``(K, L)`` or ``(B, K, L)`` bool mask; see
    :func:`cepe.data.sequences.mask_encoder_chunks`. Masked tokens leave the encoder attention mask."""
    from cepe.data.sequences import mask_encoder_chunks

    return mask_encoder_chunks(mask, p_mask=p_mask, p_whole=p_whole, generator=generator)


@functools.lru_cache(maxsize=8)
def _special_ids(decoder: str, tiny: str | None) -> tuple[int, ...]:
    if tiny is not None:
        from transformers import LlamaConfig

        config = LlamaConfig(**{k: v for k, v in json.loads(tiny).items() if k != "seed"})
    else:
        from transformers import AutoConfig

        from cepe.assets import resolve_decoder

        config = AutoConfig.from_pretrained(resolve_decoder(decoder))
    ids: set[int] = set()
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, name, None)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and int(v) >= 0:
                ids.add(int(v))
    return tuple(sorted(ids))


def special_token_ids(cfg: TrainConfig) -> tuple[int, ...]:
    """The decoder's special token ids (BOS, EOS, padding, from its config): masked-LM pre-training never
    masks them (as the released code). Read once per decoder, without loading weights."""
    tiny = json.dumps(cfg.tiny_decoder, sort_keys=True) if cfg.tiny_decoder is not None else None
    return _special_ids(cfg.decoder, tiny)


def context_drop_mask(mask: torch.Tensor, p: float, generator: torch.Generator) -> torch.Tensor:
    """With probability ``p``, keep only the last ``k ~ U(1, K)`` of the ``(K, L)`` mask's chunks (the
    earlier ones leave the encoder attention mask): the example then has a shorter context, as a short
    document gives, with the same shapes."""
    if float(torch.rand((), generator=generator)) >= p:
        return mask
    k = int(torch.randint(1, mask.shape[0] + 1, (1,), generator=generator))
    return _drop_first_chunks(mask, mask.shape[0] - k)


def _drop_first_chunks(mask: torch.Tensor, d: int) -> torch.Tensor:
    """``mask`` ``(K, L)`` with its first ``d`` chunks out of the encoder attention mask."""
    out = mask.clone()
    out[:d] = False
    return out


def shuffled_window(cfg: TrainConfig, window: Any, index: int) -> Any:
    """Window ``index`` as the example reads it: its tokens permuted for a ``data.shuffle`` fraction of the
    windows (seeded by the example), else as it is. The offline CEPED teacher reads the same tokens."""
    if not cfg.data.shuffle:
        return window
    g = example_generator(cfg.data.seed, _SHUFFLE_TAG, index)
    frac = float(cfg.data.shuffle)
    if frac >= 1.0 or float(torch.rand((), generator=g)) < frac:
        window = torch.as_tensor(window)
        window = window[torch.randperm(window.shape[-1], generator=g)]
    return window


def build_example(
    cfg: TrainConfig,
    window: torch.Tensor,
    index: int,
    mask_token_id: int | None,
    special_ids: tuple[int, ...] | None = None,
    foreign: torch.Tensor | None = None,
) -> dict:
    """The model inputs of global example ``index`` for ``cfg.stage`` from its window ``(T,)``.

    ``special_ids``: token ids the MLM stage never masks (default :func:`special_token_ids`).
    ``foreign``: window ``index + FOREIGN_OFFSET`` of the source, for a mixed stage's ``recall_foreign``
    (:func:`needs_foreign`); unused otherwise.

    Returns:
        mlm: ``{"input_ids": (T,), "labels": (T,)}``;
        warmup / cepe / ceped: ``{"input_ids": (n,), "labels": (n,), "encoder_input_ids": (K, L),
        "encoder_attention_mask": (K, L) bool}`` plus ``"index"``.
    """
    from cepe.data.sequences import mlm_example, split_for_cepe, split_for_warmup

    seed = cfg.data.seed
    if cfg.tasks is not None and cfg.stage == "cepe":
        return mixed_example(cfg, torch.as_tensor(window), index, foreign)
    window = shuffled_window(cfg, window, index)
    if cfg.stage == "mlm":
        if mask_token_id is None:
            raise ValueError("the mlm stage needs a mask token id")
        if special_ids is None:
            special_ids = special_token_ids(cfg)
        ids, labels = mlm_example(
            window,
            mask_token_id,
            cfg.mask_rate,
            generator=example_generator(seed, _MLM_TAG, index),
            special_ids=special_ids,
        )
        return {"input_ids": ids, "labels": labels, "index": torch.tensor(index)}
    if cfg.stage == "warmup":
        enc, dec = split_for_warmup(window, cfg.warmup_tokens, cfg.warmup_chunks)
        mask = torch.ones_like(enc, dtype=torch.bool)
        span = cfg.warmup_decoder_tokens
        start = 0
        if span is not None and span < dec.shape[-1]:
            g = example_generator(seed, _SPAN_TAG, index)
            start = int(torch.randint(0, dec.shape[-1] - span + 1, (1,), generator=g))
            dec = dec[start : start + span].clone()
        if cfg.align_coef > 0:  # decoder position t reads the copy of token t+1 at encoder position start+t+1
            align = torch.arange(start + 1, start + 1 + dec.shape[-1])
            align[-1] = -1
            extra = {"align_targets": align}
    else:
        enc, dec = split_for_cepe(window, cfg.n_decoder, cfg.chunk_length, cfg.n_chunks)
        mask = torch.ones_like(enc, dtype=torch.bool)
        if cfg.chunk_noise > 0:
            g = example_generator(seed, _NOISE_TAG, index)
            mask = chunk_noise_mask(mask, cfg.chunk_noise, cfg.chunk_noise_whole, g)
        if cfg.context_drop > 0:  # no draw at 0: older runs unchanged
            mask = context_drop_mask(mask, cfg.context_drop, example_generator(seed, _DROP_TAG, index))
    out = {
        "input_ids": dec,
        "labels": dec.clone(),
        "encoder_input_ids": enc,
        "encoder_attention_mask": mask,
        "index": torch.tensor(index),
        **(extra if cfg.stage == "warmup" and cfg.align_coef > 0 else {}),
    }
    if cfg.online_teacher:
        out["context_at"] = torch.tensor(0)
    return out


def example_task(cfg: TrainConfig, index: int) -> str:
    """The kind of example ``index`` of a mixed CEPE stage (``cfg.tasks``): drawn by its seeded share."""
    assert cfg.tasks is not None
    names = [k for k in TASK_KINDS if cfg.tasks.get(k, 0) > 0]
    weights = torch.tensor([float(cfg.tasks[k]) for k in names], dtype=torch.float64)
    g = example_generator(cfg.data.seed, _TASK_TAG, index)
    return names[int(torch.multinomial(weights / weights.sum(), 1, generator=g))]


def needs_foreign(cfg: TrainConfig, index: int) -> bool:
    """Whether example ``index`` is a recall example that may plant another window's text
    (``recall_foreign``): the caller then passes window ``index + FOREIGN_OFFSET`` to :func:`build_example`."""
    return bool(cfg.recall_foreign) and cfg.tasks is not None and example_task(cfg, index) == "recall"


def recall_drop_mask(mask: torch.Tensor, start: int, p: float, generator: torch.Generator) -> torch.Tensor:
    """With probability ``p``, drop the first ``d ~ U(0, c)`` of the ``(K, L)`` mask's chunks, ``c`` the
    chunk holding flat encoder position ``start`` (a recall example's cue): the cue stays in the context,
    which then holds ``K - d`` chunks, so that recall is trained at every context length up to K·L and
    not only at the full one (an evaluation's 2K haystack has fewer chunks than a training example's 8K)."""
    if float(torch.rand((), generator=generator)) >= p:
        return mask
    return _drop_first_chunks(
        mask, int(torch.randint(0, start // mask.shape[1] + 1, (1,), generator=generator))
    )


def mixed_example(
    cfg: TrainConfig, window: torch.Tensor, index: int, foreign: torch.Tensor | None = None
) -> dict:
    """Example ``index`` of the mixed CEPE stage: every kind has the CEPE layout (the window's first K·L
    tokens as K chunks of L in the encoder, n tokens in the decoder), so kinds batch together.

    - ``lm``: the paper's CEPE example: the decoder continues the window, the encoder holds the previous
      K·L tokens with chunk noise. No attention targets.
    - ``copy``: the decoder gets n tokens copied from a seeded place of the encoder's K·L (retrieval among
      K chunks, then copying); with ``copy_shuffle`` those K·L tokens are permuted first (only copying can
      predict them); with ``copy_drop`` that share keeps only the last ``k ~ U(1, K)`` chunks (at least
      the decoder's n tokens) and copies from them: copying from short contexts too.
    - ``recall``: the decoder continues the window for ``n - c - s`` tokens, then a cue of c tokens copied
      from a seeded place of the encoder, then the s tokens that follow the cue there
      (``recall_cue``, ``recall_span``): it must notice the cue, find it among the chunks and read on. The
      cue is not a loss target (it cannot be predicted); the span is. With ``recall_foreign`` that share
      of recall examples takes cue and span from ``foreign`` (another window, usually another document
      or domain) and plants them over the encoder's text at that place first, as a needle is planted:
      text the decoder's own continuation does not predict, so only reading it can.
      With ``recall_detour`` that share of recall examples puts 1-3 of the decoder's own earlier tokens
      (unscored) between the cue and its span, which then goes on where the cue ended: recall that
      survives a detour, as an answer that restates a question and adds a word of its own must.
      With ``recall_anywhere`` that share of recall examples puts cue and span at a decoder position
      drawn uniformly, not at the end; the window's own text goes on after the span, its first token
      unscored (the seam).
    - ``qa``: facts planted in the encoder's text, a question about one at the end of the decoder, the
      answer scored (:mod:`cepe.training.synthetic_qa`).
    - ``icl``: in-context classification, demonstrations one per chunk in the encoder and more in the
      decoder, the decoder's labels scored (:mod:`cepe.training.synthetic_icl`); the window is not used.
      With ``icl_align`` its label tokens carry attention targets: the same class's latest label in the
      encoder.

    ``task``: the kind's index in ``TASK_KINDS`` (the trainer logs the loss of each kind).
    ``context_at`` (with ``online_teacher``): the decoder position before which the teacher reads the
    context (0; for ``qa`` the length of the chat template's opening, so the context is in the user turn).
    ``align_targets`` ``(n,)``: for copied tokens, the flat encoder position of the token each decoder
    position predicts (-1 elsewhere); used when ``align_coef > 0``.
    """
    from cepe.data.sequences import split_for_cepe

    kind = example_task(cfg, index)
    seed = cfg.data.seed
    enc, dec = split_for_cepe(window, cfg.n_decoder, cfg.chunk_length, cfg.n_chunks)
    m, n = enc.numel(), dec.shape[-1]
    mask = torch.ones_like(enc, dtype=torch.bool)
    align = torch.full((n,), -1, dtype=torch.long)
    labels = dec.clone()
    g = example_generator(seed, _SPAN_TAG, index)
    tiny = None if cfg.tiny_decoder is None else int(cfg.tiny_decoder.get("vocab_size", 0))
    if kind == "lm":
        if cfg.chunk_noise > 0:
            mask = chunk_noise_mask(
                mask, cfg.chunk_noise, cfg.chunk_noise_whole, example_generator(seed, _NOISE_TAG, index)
            )
        if cfg.context_drop > 0:
            mask = context_drop_mask(mask, cfg.context_drop, example_generator(seed, _DROP_TAG, index))
        if cfg.teacher_context is not None:  # the teacher's examples at its own, shorter length
            mask = _drop_first_chunks(mask, mask.shape[0] - cfg.teacher_context // mask.shape[1])
    elif kind == "copy":
        flat = enc.reshape(-1)
        if cfg.copy_shuffle and float(torch.rand((), generator=g)) < cfg.copy_shuffle:
            flat = flat[torch.randperm(m, generator=g)]
            enc = flat.reshape(enc.shape)
        span = min(n, m)
        lo = 0  # with copy_drop, the copied span lies in the kept chunks
        if cfg.copy_drop > 0:  # no draw at 0: older runs unchanged
            chunks, length = mask.shape
            gd = example_generator(seed, _COPY_DROP_TAG, index)
            if float(torch.rand((), generator=gd)) < cfg.copy_drop:
                kept = int(torch.randint(1, chunks + 1, (1,), generator=gd))
                d = min(chunks - kept, (m - span) // length)
                mask = _drop_first_chunks(mask, d)
                lo = d * length
        start = int(torch.randint(lo, m - span + 1, (1,), generator=g))
        dec = dec.clone()
        dec[:span] = flat[start : start + span]
        labels = dec.clone()
        if span < n:  # a decoder longer than the encoder: the rest is not a target
            labels[span:] = -100
        align[: span - 1] = torch.arange(start + 1, start + span)
    elif kind == "qa":
        import random

        from .synthetic_qa import qa_example

        r = random.Random(int(example_generator(seed, _TASK_TAG, index).initial_seed()))
        inline = bool(cfg.qa_inline) and r.random() < cfg.qa_inline  # no draw at 0: older runs unchanged
        enc, dec, labels, align = qa_example(
            enc,
            dec,
            r,
            cfg.decoder,
            tiny,
            templates=cfg.qa_templates,
            inline=inline,
            span=cfg.qa_span,
            span_tokens=tuple(cfg.qa_span_tokens),
            compound=cfg.qa_compound,
            line_break=cfg.qa_line_break,
            decoys=cfg.qa_decoys,
            window_decoy=cfg.qa_window_decoy,
        )
    elif kind == "icl":
        import random

        from .synthetic_icl import corpus_families, icl_example, synthetic_families
        from .synthetic_qa import text_tokenizer

        tok = text_tokenizer(cfg.decoder, tiny)
        if cfg.data.synthetic is not None:
            fams = synthetic_families(tiny or len(tok), seed)
        else:
            fams = corpus_families(str(cfg.data.corpus), cfg.data.split)
        r = random.Random(int(example_generator(seed, _ICL_TAG, index).initial_seed()))
        enc, mask, dec, labels, icl_align = icl_example(
            fams, enc.shape[0], enc.shape[1], n, r, tok, scored=cfg.icl_scored, arbitrary=cfg.icl_arbitrary
        )
        if cfg.icl_align:
            align = icl_align
    else:  # recall
        cue = int(cfg.recall_cue)
        lo, hi = int(cfg.recall_span[0]), int(cfg.recall_span[1])
        span = int(torch.randint(lo, hi + 1, (1,), generator=g))
        total = cue + span
        start = int(torch.randint(0, m - total + 1, (1,), generator=g))
        at = n - total
        if cfg.recall_anywhere:  # its own stream, as recall_foreign's
            ga = example_generator(seed, _ANYWHERE_TAG, index)
            if float(torch.rand((), generator=ga)) < cfg.recall_anywhere:
                at = int(torch.randint(0, n - total + 1, (1,), generator=ga))
        end = at + total  # n unless recall_anywhere moved it
        if cfg.recall_foreign:  # its own stream: the other draws stay those of a run without it
            gf = example_generator(seed, _FOREIGN_TAG, index)
            if float(torch.rand((), generator=gf)) < cfg.recall_foreign:
                if foreign is None:
                    raise ValueError("recall_foreign: pass the foreign window (see needs_foreign)")
                src = torch.as_tensor(foreign).reshape(-1)
                at_f = int(torch.randint(0, src.numel() - total + 1, (1,), generator=gf))
                flat = enc.reshape(-1).clone()
                flat[start : start + total] = src[at_f : at_f + total]
                enc = flat.view(enc.shape)
        if cfg.recall_drop:  # its own stream, as recall_foreign's
            mask = recall_drop_mask(
                mask, start, cfg.recall_drop, example_generator(seed, _RECALL_DROP_TAG, index)
            )
        flat = enc.reshape(-1)
        dec = dec.clone()
        dec[at:end] = flat[start : start + total]
        labels = dec.clone()
        labels[at : at + cue] = -100
        align[at : end - 1] = torch.arange(start + 1, start + total)
        gd = example_generator(seed, _DETOUR_TAG, index) if cfg.recall_detour else None
        if gd is not None and float(torch.rand((), generator=gd)) < cfg.recall_detour and span > 1:
            d = min(int(torch.randint(1, 4, (1,), generator=gd)), span - 1, at)
            if d > 0:  # d of the decoder's own earlier tokens between cue and span, then the span goes on
                own = int(torch.randint(0, at - d + 1, (1,), generator=gd))
                dec[at + cue : at + cue + d] = dec[own : own + d].clone()
                dec[at + cue + d : end] = flat[start + cue : start + total - d]
                labels = dec.clone()
                labels[at : at + cue + d] = -100
                align[at + cue - 1 : end - 1] = -1
                align[at + cue + d - 1 : end - 1] = torch.arange(start + cue, start + total - d)
        if end < n:  # the seam back to the window's own text is not a target
            labels[end] = -100
    out = {
        "input_ids": dec,
        "labels": labels,
        "encoder_input_ids": enc,
        "encoder_attention_mask": mask,
        "index": torch.tensor(index),
        "task": torch.tensor(TASK_KINDS.index(kind)),
    }
    if cfg.align_coef > 0:
        out["align_targets"] = align
    if cfg.online_teacher:  # where the teacher reads the context: after the chat template's opening (qa)
        at = 0
        if kind == "qa":
            from .synthetic_qa import chat_prefix_length

            at = chat_prefix_length(cfg.decoder, tiny)
        out["context_at"] = torch.tensor(at)
    return out


def collate(examples: list[dict]) -> dict[str, torch.Tensor]:
    """Stack examples of equal shapes into a batch (leading B)."""
    return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}


def _step_draw(values: list[int] | None, seed: int, tag: int, step: int, micro: int) -> int | None:
    """One of ``values`` for micro-batch ``micro`` of optimizer step ``step``, seeded by both (a resumed
    run draws what the uninterrupted one did); None without ``values``."""
    if not values:
        return None
    g = example_generator(seed, tag, step * 1_000_003 + micro)
    return int(values[int(torch.randint(len(values), (1,), generator=g))])


def step_chunk_length(cfg: TrainConfig, step: int, micro: int) -> int | None:
    """The chunk length of micro-batch ``micro`` of optimizer step ``step`` (``cfg.chunk_lengths``); None
    without it."""
    return _step_draw(cfg.chunk_lengths, cfg.data.seed, _REGROUP_TAG, step, micro)


def step_decoder_length(cfg: TrainConfig, step: int, micro: int) -> int | None:
    """The decoder length of micro-batch ``micro`` of optimizer step ``step`` (``cfg.decoder_lengths``);
    None without it."""
    return _step_draw(cfg.decoder_lengths, cfg.data.seed, _DECODER_LENGTH_TAG, step, micro)


def step_context_chunks(cfg: TrainConfig, step: int, micro: int) -> int | None:
    """The encoder chunk count of micro-batch ``micro`` of optimizer step ``step`` (``cfg.context_chunks``);
    None without it."""
    return _step_draw(cfg.context_chunks, cfg.data.seed, _CONTEXT_CHUNKS_TAG, step, micro)


def step_layout(cfg: TrainConfig, step: int, micro: int) -> tuple[int | None, int | None]:
    """``(n_decoder, n_chunks)`` of micro-batch ``micro`` of optimizer step ``step``: its drawn decoder length
    and encoder chunk count (None: the config's own), the arguments of :func:`at_layout`."""
    return step_decoder_length(cfg, step, micro), step_context_chunks(cfg, step, micro)


def at_layout(
    cfg: TrainConfig, window: Any, n_decoder: int | None = None, n_chunks: int | None = None
) -> tuple[TrainConfig, Any]:
    """``(config, window)`` of an example with ``n_decoder`` decoder tokens (``decoder_lengths``) and
    ``n_chunks`` encoder chunks (``context_chunks``): the config's layout at both and the window's last
    k·L + n tokens (``(T,)`` → ``(k·L + n,)``), so that encoder and decoder stay contiguous. Each None or
    the config's own: kept; both kept: config and window as they are."""
    n = cfg.n_decoder if n_decoder is None else n_decoder
    k = cfg.n_chunks if n_chunks is None else n_chunks
    if n == cfg.n_decoder and k == cfg.n_chunks:
        return cfg, window
    return cfg.at_layout(n_decoder=n, n_chunks=k), torch.as_tensor(window)[-(k * cfg.chunk_length + n) :]


def regroup_chunks(batch: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
    """``batch`` with its encoder cut into chunks of ``length`` tokens: ``encoder_input_ids`` and
    ``encoder_attention_mask`` ``(B, K, L)`` become ``(B, K·L / length, length)``, the same tokens in the
    same order. Attention targets are flat encoder positions, so they stay valid."""
    ids = batch["encoder_input_ids"]
    b, k, n = ids.shape
    if (k * n) % length:
        raise ValueError(f"chunks of {length} tokens do not tile the encoder's {k} × {n} tokens")
    out = dict(batch)
    for key in ("encoder_input_ids", "encoder_attention_mask"):
        out[key] = batch[key].reshape(b, k * n // length, length)
    return out


def example_indices(
    step: int, batch_size: int, micro: int, micro_batch: int, rank: int, world: int
) -> list[int]:
    """Global example indices of micro-batch ``micro`` of optimizer step ``step`` on process ``rank``.

    Step ``s`` consumes examples ``[s·batch_size, (s+1)·batch_size)``, dealt out micro-batch by micro-batch
    and process by process, so the examples do not depend on how a run was interrupted.
    """
    start = step * batch_size + (micro * world + rank) * micro_batch
    return list(range(start, start + micro_batch))
