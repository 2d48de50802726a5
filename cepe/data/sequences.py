"""The paper's training sequences (§2.2) and the example layouts of each training stage (Appendix A).

Shape legend: T window length, B batch, K chunks, L chunk length, n decoder tokens, m = K·L encoder tokens.

Two builders cut fixed-length windows of T tokens from a :class:`~cepe.data.tokenized.TokenizedCorpus`:

- *filter*: only documents with at least T tokens; a window lies inside one document. Every valid
  window of every eligible document is equally likely (documents are weighted by ``length - T + 1``).
- *cat*: the split's documents concatenated with EOS between them; non-overlapping windows of T are cut
  from that stream, visited in a fresh random order (and a fresh random offset) every epoch.

:class:`SequenceMixture` interleaves them by an integer ratio (2:1 filter:cat by default). Example ``i``
is a pure function of ``(seed, i)``: blocks of ``f + c`` consecutive examples hold exactly ``f`` filter
and ``c`` cat windows in a per-block random order, so a resumed run (or another rank) computes exactly
the same windows. :class:`ResumableSampler` feeds indices to a ``DataLoader`` and saves its position.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from cepe.chunking import chunk_ids
from cepe.data.tokenized import TokenizedCorpus

_FILTER, _CAT, _BLOCK = 1, 2, 3  # rng stream tags


def _rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), *map(int, keys)])


class SequenceMixture(Dataset):
    """Fixed-length token windows mixing the *filter* and *cat* builders.

    Args:
        corpus: a :class:`TokenizedCorpus` or its directory.
        split: which split to read (``"train"``, ``"test"``, ``"retrieval"``).
        seq_length: T, tokens per window (8192 in the paper; 512 for encoder MLM pre-training).
        ratio: ``(filter, cat)`` non-negative integers, not both zero; ``(1, 0)`` = filter only.
        seed: changes every sampled window.
        filter_domains: domains eligible for *filter* (None = all; the paper keeps ArXiv and Books).
        num_examples: ``len()`` of the dataset; default one pass, ``stream_length(split) // T``.
            Indices beyond it are valid too (the mixture is unbounded).

    ``ds[i]`` is a ``torch.long`` tensor ``(T,)``; ``ds.describe(i)`` says where it came from.

    Raises:
        ValueError: bad ratio/length, or no window can be built (e.g. no document has T tokens while
            the filter share is non-zero); the message says which and what to change.
    """

    def __init__(
        self,
        corpus: TokenizedCorpus | str | os.PathLike[str],
        split: str = "train",
        seq_length: int = 8192,
        ratio: tuple[int, int] = (2, 1),
        seed: int = 0,
        filter_domains: Sequence[str] | None = None,
        num_examples: int | None = None,
    ) -> None:
        self.corpus = corpus if isinstance(corpus, TokenizedCorpus) else TokenizedCorpus(corpus)
        if seq_length <= 0:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        if num_examples is not None and num_examples < 0:
            raise ValueError(
                f"num_examples (the dataset's len) must be 0 or more, got {num_examples}; "
                "give None for one pass over the split"
            )
        if len(ratio) != 2 or any(int(r) != r or r < 0 for r in ratio) or sum(ratio) == 0:
            raise ValueError(
                f"ratio must be two non-negative integers (filter, cat), not both zero; got {ratio!r}"
            )
        self.split = split
        self.seq_length = int(seq_length)
        self.n_filter, self.n_cat = int(ratio[0]), int(ratio[1])
        self.seed = int(seed)
        table = self.corpus.documents(split)
        keep = table.length >= self.seq_length
        if filter_domains is not None:
            allowed = set(filter_domains)
            keep &= np.asarray([d in allowed for d in table.domains], dtype=bool)
        self._filter_docs = np.flatnonzero(keep)
        # cumulative count of valid window starts over the eligible documents
        self._filter_cum = np.cumsum(table.length[self._filter_docs] - self.seq_length + 1)
        if self.n_filter and not len(self._filter_docs):
            where = f" in domains {sorted(filter_domains)}" if filter_domains is not None else ""
            longest = int(table.length.max()) if len(table) else 0
            raise ValueError(
                f"no document of split {split!r}{where} has at least {self.seq_length} tokens (longest: "
                f"{longest}); lower seq_length, add long documents, or use ratio=(0, 1) (cat only)"
            )
        self._stream = self.corpus.stream_length(split)
        self._cat_windows = self._stream // self.seq_length
        if self.n_cat and not self._cat_windows:
            raise ValueError(
                f"split {split!r} holds only {self._stream} tokens, fewer than one window of "
                f"{self.seq_length}; lower seq_length or add documents"
            )
        self.num_examples = (
            int(num_examples) if num_examples is not None else max(1, self._stream // seq_length)
        )
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None
        self._perm_offset = 0

    def __len__(self) -> int:
        return self.num_examples

    def source(self, i: int) -> tuple[str, int]:
        """``("filter" | "cat", index within that builder)`` of example ``i``."""
        if i < 0:
            raise IndexError(f"example index must be non-negative, got {i}")
        period = self.n_filter + self.n_cat
        if not self.n_cat:
            return "filter", i
        if not self.n_filter:
            return "cat", i
        block, slot = divmod(i, period)
        order = _rng(self.seed, _BLOCK, block).permutation(period)
        kind = int(order[slot])  # values < n_filter are filter slots
        if kind < self.n_filter:
            return "filter", block * self.n_filter + kind
        return "cat", block * self.n_cat + (kind - self.n_filter)

    def _filter_location(self, j: int) -> tuple[int, int]:
        r = int(_rng(self.seed, _FILTER, j).integers(int(self._filter_cum[-1])))
        k = int(np.searchsorted(self._filter_cum, r, side="right"))
        before = int(self._filter_cum[k - 1]) if k else 0
        return int(self._filter_docs[k]), r - before

    def _cat_start(self, j: int) -> int:
        epoch, w = divmod(j, self._cat_windows)
        if self._perm_epoch != epoch:
            rng = _rng(self.seed, _CAT, epoch)
            self._perm = rng.permutation(self._cat_windows)
            slack = self._stream - self._cat_windows * self.seq_length
            self._perm_offset = int(rng.integers(slack + 1))
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm_offset + int(self._perm[w]) * self.seq_length

    def describe(self, i: int) -> dict[str, Any]:
        """Where example ``i`` comes from: ``{"source", "doc_id", "start"}`` (filter: start within the
        document; cat: start within the split's EOS-joined stream, ``doc_id`` None)."""
        kind, j = self.source(i)
        if kind == "filter":
            doc, start = self._filter_location(j)
            return {"source": kind, "doc_id": self.corpus.documents(self.split).ids[doc], "start": start}
        return {"source": kind, "doc_id": None, "start": self._cat_start(j)}

    def window(self, i: int) -> np.ndarray:
        """Example ``i`` as an int64 numpy array ``(T,)``."""
        kind, j = self.source(i)
        if kind == "filter":
            doc, start = self._filter_location(j)
            tokens = self.corpus.doc_tokens(self.split, doc)[start : start + self.seq_length]
            return np.asarray(tokens, dtype=np.int64)
        return self.corpus.stream_slice(self.split, self._cat_start(j), self.seq_length)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.window(int(i)))

    def iter_windows(self, start: int = 0, stop: int | None = None) -> Iterator[torch.Tensor]:
        """Windows ``start, start + 1, ...`` (up to ``stop``; unbounded if None), each ``(T,)`` int64."""
        i = start
        while stop is None or i < stop:
            yield self[i]
            i += 1


class ResumableSampler(Sampler[int]):
    """Example indices for one rank, with a saveable position (examples handed out so far).

    Rank ``r`` of ``world_size`` gets global indices ``r, r + W, r + 2W, ...`` (offset by the
    position), so all ranks together see ``0, 1, 2, ...`` exactly once. ``len(sampler)`` is the number
    of indices left if ``num_examples`` (per rank) is given; without it the sampler never stops.

    A ``DataLoader`` pulls indices ahead of the training loop (prefetching); to resume exactly, save
    ``{"position": examples the loop has consumed}`` (e.g. ``step * per_rank_batch``) rather than
    ``state_dict()`` taken while a loader is running.
    """

    def __init__(
        self, num_examples: int | None = None, rank: int = 0, world_size: int = 1, position: int = 0
    ) -> None:
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.num_examples = num_examples
        self.rank, self.world_size = rank, world_size
        self.position = int(position)

    def __iter__(self) -> Iterator[int]:
        while self.num_examples is None or self.position < self.num_examples:
            index = self.position * self.world_size + self.rank
            self.position += 1
            yield index

    def __len__(self) -> int:
        if self.num_examples is None:
            raise TypeError("an unbounded ResumableSampler has no length; pass num_examples")
        return max(0, self.num_examples - self.position)

    def state_dict(self) -> dict[str, int]:
        """``{"position": indices handed out}``."""
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved ``{"position": ...}``."""
        self.position = int(state["position"])


# ------------------------------------------------------------------------------------ example layouts


def _as_long(window: Any) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(window) if not isinstance(window, torch.Tensor) else window)
    if t.dim() not in (1, 2):
        raise ValueError(f"window must be (T,) or (B, T), got shape {tuple(t.shape)}")
    return t.long()


def split_for_cepe(
    window: torch.Tensor | np.ndarray | Sequence[int], n_decoder: int, chunk_length: int, n_chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a window into the CEPE training layout (paper: T = 8192 = 16·256 + 4096).

    The first ``m = n_chunks * chunk_length`` tokens become the encoder chunks, the last ``n_decoder``
    tokens the decoder input (labels = decoder ids; the model shifts them).

    Args:
        window: ``(T,)`` or ``(B, T)`` token ids with ``T = m + n_decoder``.
        n_decoder: n, decoder tokens.
        chunk_length: L, tokens per encoder chunk.
        n_chunks: K, encoder chunks.

    Returns:
        ``(encoder_ids, decoder_ids)``: ``(K, L)`` and ``(n,)``, or ``(B, K, L)`` and ``(B, n)``; long.

    Raises:
        ValueError: non-positive sizes or ``T != K·L + n``.
    """
    if min(n_decoder, chunk_length, n_chunks) <= 0:
        raise ValueError(
            f"n_decoder, chunk_length and n_chunks must be positive, got {n_decoder}, {chunk_length}, {n_chunks}"
        )
    t = _as_long(window)
    m = n_chunks * chunk_length
    if t.shape[-1] != m + n_decoder:
        raise ValueError(
            f"window has {t.shape[-1]} tokens but n_chunks*chunk_length + n_decoder = "
            f"{n_chunks}*{chunk_length} + {n_decoder} = {m + n_decoder}; build windows of that length"
        )
    if t.dim() == 1:
        enc, _ = chunk_ids(t[:m], chunk_length)
        return enc, t[m:].clone()
    return t[:, :m].reshape(t.shape[0], n_chunks, chunk_length).clone(), t[:, m:].clone()


def split_for_warmup(
    window: torch.Tensor | np.ndarray | Sequence[int], n: int = 256, k: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy-warmup layout (Appendix A): encoder and decoder see the same ``n`` tokens, the encoder as
    ``k`` chunks of ``n / k`` (paper: n = 256, k = 4).

    Args:
        window: ``(T,)`` or ``(B, T)`` with ``T >= n``; the first ``n`` tokens are used.

    Returns:
        ``(encoder_ids, decoder_ids)``: ``(k, n/k)`` and ``(n,)`` (or batched ``(B, k, n/k)``, ``(B, n)``).

    Raises:
        ValueError: ``n`` not divisible by ``k`` or the window shorter than ``n``.
    """
    if n <= 0 or k <= 0 or n % k:
        raise ValueError(f"n must be a positive multiple of k, got n={n}, k={k}")
    t = _as_long(window)
    if t.shape[-1] < n:
        raise ValueError(f"window has {t.shape[-1]} tokens, warmup needs n={n}")
    dec = t[..., :n].clone()
    return dec.reshape(*dec.shape[:-1], k, n // k).clone(), dec


def cepe_example(
    window: torch.Tensor | np.ndarray | Sequence[int], n_decoder: int, chunk_length: int, n_chunks: int
) -> dict[str, torch.Tensor]:
    """A ready model input for one window (see :func:`split_for_cepe`).

    Returns:
        ``{"input_ids": (n,), "labels": (n,), "encoder_input_ids": (K, L),
        "encoder_attention_mask": (K, L) bool}`` (batched shapes gain a leading B).
    """
    enc, dec = split_for_cepe(window, n_decoder, chunk_length, n_chunks)
    return {
        "input_ids": dec,
        "labels": dec.clone(),
        "encoder_input_ids": enc,
        "encoder_attention_mask": torch.ones_like(enc, dtype=torch.bool),
    }


def mask_encoder_chunks(
    mask: torch.Tensor,
    p_mask: float = 0.3,
    p_whole: float = 0.1,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Encoder-input noise of Appendix A: each chunk is masked with probability ``p_mask``; a masked
    chunk loses all its tokens with probability ``p_whole``, else a suffix of ``t ~ U(1, |C| - 1)`` tokens
    (as the released code: a partly masked chunk keeps at least one token; a one-token chunk is left
    whole).

    Args:
        mask: ``(K, L)`` or ``(B, K, L)`` bool, True on real tokens (right-padded chunks).
        generator: for reproducible noise.

    Returns:
        A new mask of the same shape (input unchanged).
    """
    m = mask.bool().clone()
    flat = m.view(-1, m.shape[-1])
    n = flat.shape[0]
    lengths = flat.sum(-1)
    chosen = torch.rand(n, generator=generator) < p_mask
    whole = torch.rand(n, generator=generator) < p_whole
    u = torch.rand(n, generator=generator)
    partial = ((u * (lengths - 1)).long() + 1).clamp(max=(lengths - 1).clamp_min(0))  # 1..|C|-1
    drop = torch.where(whole, lengths, partial)
    keep = torch.where(chosen, lengths - drop, lengths)
    positions = torch.arange(m.shape[-1]).expand_as(flat)
    flat &= positions < keep[:, None]
    return m


def mlm_example(
    window: torch.Tensor | np.ndarray | Sequence[int],
    mask_token_id: int,
    mask_rate: float = 0.3,
    generator: torch.Generator | None = None,
    special_ids: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked-LM example for encoder pre-training (Appendix A: 512-token sequences, 30 % masking,
    masked tokens always replaced by the mask token). Use ``SequenceMixture(..., seq_length=512)``.

    Args:
        window: ``(T,)`` or ``(B, T)`` token ids.
        mask_token_id: id written at masked positions.
        mask_rate: fraction of positions masked (``special_ids`` are never masked).

    Returns:
        ``(input_ids, labels)``, same shape as ``window``; labels are -100 except at masked positions.
    """
    if not 0.0 < mask_rate < 1.0:
        raise ValueError(f"mask_rate must be in (0, 1), got {mask_rate}")
    ids = _as_long(window)
    chosen = torch.rand(ids.shape, generator=generator) < mask_rate
    for s in special_ids:
        chosen &= ids != s
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    inputs = torch.where(chosen, torch.full_like(ids, mask_token_id), ids)
    return inputs, labels
