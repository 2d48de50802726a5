"""Tokenized corpora on disk: bounded ``.npy`` token shards plus a JSON index, read memory-mapped.

Layout of a tokenized directory::

    index.json             format, dtype, eos_id, vocab size, tokenizer, and per split: the shard files
                           and a column table of documents (id, domain, shard, offset, length)
    train-00000.npy ...    1-D token arrays (uint16 when the vocabulary fits, else uint32)
    test-00000.npy ...
    retrieval-00000.npy ...

Every document is stored as its tokens followed by one EOS token; ``length`` counts the document's
tokens without that EOS. Reading a document is a slice ``[offset, offset + length)`` of its shard; the
whole shard sequence of a split is the "concatenated with EOS" stream that the *cat* sequence builder
cuts windows from. A document never straddles two shards; a shard is closed once it holds at least
``shard_tokens`` tokens (a single longer document makes one oversized shard).

Shards and the index are written to temporary files and renamed into place (``os.replace``); the index
is written last, so a directory without ``index.json`` is an unfinished build. Nothing is held in memory
beyond one shard being filled, and reading maps shards lazily, so corpora larger than RAM work.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cepe.fileio import atomic_path, write_json

FORMAT = "cepe-tokens/1"
INDEX_FILE = "index.json"
DEFAULT_SHARD_TOKENS = 1 << 25  # 32M tokens: 64 MB as uint16, 128 MB as uint32


def atomic_write_json(path: Path, obj: Any) -> None:
    """Atomically write ``obj`` as JSON (indent 1, UTF-8): the corpus files' format."""
    write_json(path, obj, indent=1, ensure_ascii=False)


def _atomic_save_npy(path: Path, array: np.ndarray) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding every id of a ``vocab_size`` vocabulary (uint16 or uint32)."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size <= np.iinfo(np.uint16).max + 1:
        return np.dtype(np.uint16)
    if vocab_size <= np.iinfo(np.uint32).max + 1:
        return np.dtype(np.uint32)
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32")


class _SplitBuffer:
    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.size = 0
        self.shards: list[dict[str, Any]] = []
        self.docs: dict[str, list] = {"id": [], "domain": [], "shard": [], "offset": [], "length": []}


class ShardWriter:
    """Write tokenized documents into per-split shards; call :meth:`close` to write the index.

    Args:
        out_dir: output directory (created; an existing ``index.json`` there is replaced on close).
        eos_id: token appended after every document.
        vocab_size: tokenizer vocabulary size (picks the dtype and validates ids).
        shard_tokens: close a shard once it holds at least this many tokens.
        metadata: extra JSON-serialisable information stored in the index (e.g. the tokenizer name).

    Example::

        with ShardWriter(out, eos_id=tok.eos_token_id, vocab_size=len(tok)) as w:
            w.add("train", "doc-1", "books", ids)
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        eos_id: int,
        vocab_size: int,
        shard_tokens: int = DEFAULT_SHARD_TOKENS,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        if shard_tokens <= 0:
            raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
        if not 0 <= eos_id < vocab_size:
            raise ValueError(f"eos_id {eos_id} is outside the vocabulary [0, {vocab_size})")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.eos_id = int(eos_id)
        self.vocab_size = int(vocab_size)
        self.dtype = token_dtype(vocab_size)
        self.shard_tokens = int(shard_tokens)
        self.metadata = dict(metadata or {})
        self._splits: dict[str, _SplitBuffer] = {}
        self._closed = False

    def add(self, split: str, doc_id: str, domain: str, tokens: Iterable[int] | np.ndarray) -> None:
        """Append one document's tokens ``(N,)`` (EOS is appended here) to ``split``.

        Raises:
            ValueError: the writer is closed, the split name is not a plain word, or an id is out of range.
        """
        if self._closed:
            raise ValueError("ShardWriter is closed")
        if not split or not split.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"split name must be alphanumeric ('-' and '_' allowed), got {split!r}")
        arr = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens), dtype=np.int64).ravel()
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(
                f"document {doc_id!r}: token ids must lie in [0, {self.vocab_size}), "
                f"got range [{arr.min()}, {arr.max()}]; wrong tokenizer or vocab_size?"
            )
        buf = self._splits.setdefault(split, _SplitBuffer())
        buf.docs["id"].append(str(doc_id))
        buf.docs["domain"].append(str(domain))
        buf.docs["shard"].append(len(buf.shards))
        buf.docs["offset"].append(buf.size)
        buf.docs["length"].append(int(arr.size))
        buf.parts.append(arr.astype(self.dtype))
        buf.parts.append(np.array([self.eos_id], dtype=self.dtype))
        buf.size += int(arr.size) + 1
        if buf.size >= self.shard_tokens:
            self._flush(split, buf)

    def _flush(self, split: str, buf: _SplitBuffer) -> None:
        if not buf.size:
            return
        name = f"{split}-{len(buf.shards):05d}.npy"
        _atomic_save_npy(self.out_dir / name, np.concatenate(buf.parts))
        buf.shards.append({"file": name, "tokens": buf.size})
        buf.parts, buf.size = [], 0

    def close(self) -> Path:
        """Flush open shards and write ``index.json``; returns the output directory."""
        if self._closed:
            return self.out_dir
        for split, buf in self._splits.items():
            self._flush(split, buf)
        index = {
            "format": FORMAT,
            "dtype": self.dtype.name,
            "eos_id": self.eos_id,
            "vocab_size": self.vocab_size,
            "eos_appended": True,
            "metadata": self.metadata,
            "splits": {s: {"shards": b.shards, "documents": b.docs} for s, b in sorted(self._splits.items())},
        }
        atomic_write_json(self.out_dir / INDEX_FILE, index)
        self._closed = True
        return self.out_dir

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()


def tokenize_documents(
    docs: Iterable[dict[str, Any]],
    tokenizer: Any,
    batch_docs: int = 64,
    batch_chars: int = 4_000_000,
) -> Iterator[tuple[dict[str, Any], np.ndarray]]:
    """Tokenize documents in batches with a Hugging Face (fast) tokenizer, without special tokens.

    Yields:
        ``(doc, ids)`` with ``ids`` an int64 array ``(N,)``, in input order.
    """
    batch: list[dict[str, Any]] = []
    chars = 0

    def run(batch: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], np.ndarray]]:
        enc = tokenizer(
            [d["text"] for d in batch], add_special_tokens=False, return_attention_mask=False, verbose=False
        )
        for d, ids in zip(batch, enc["input_ids"], strict=True):
            yield d, np.asarray(ids, dtype=np.int64)

    for doc in docs:
        batch.append(doc)
        chars += len(doc["text"])
        if len(batch) >= batch_docs or chars >= batch_chars:
            yield from run(batch)
            batch, chars = [], 0
    if batch:
        yield from run(batch)


@dataclass(frozen=True)
class DocumentTable:
    """Documents of one split. Arrays are ``(D,)`` for D documents."""

    ids: list[str]
    domains: list[str]
    shard: np.ndarray  # int64, shard number
    offset: np.ndarray  # int64, start within the shard
    length: np.ndarray  # int64, tokens without the trailing EOS

    def __len__(self) -> int:
        return len(self.ids)


class TokenizedCorpus:
    """Read access to a directory written by :class:`ShardWriter` (shards memory-mapped lazily).

    Safe to pickle (e.g. into ``DataLoader`` workers): mappings are reopened in each process.

    Raises:
        ValueError: the directory has no ``index.json`` (unfinished or wrong directory) or another format.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        index_path = self.path / INDEX_FILE
        if not index_path.is_file():
            raise ValueError(
                f"{self.path} is not a tokenized corpus: no {INDEX_FILE} (an interrupted build, or run "
                "`cepe prepare-data --out DIR` first)"
            )
        self.index = json.loads(index_path.read_text(encoding="utf-8"))
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{index_path}: format {self.index.get('format')!r}, expected {FORMAT!r}")
        self.dtype = np.dtype(self.index["dtype"])
        self.eos_id = int(self.index["eos_id"])
        self.vocab_size = int(self.index["vocab_size"])
        self.metadata: dict[str, Any] = self.index.get("metadata", {})
        self._tables: dict[str, DocumentTable] = {}
        self._maps: dict[tuple[str, int], np.ndarray] = {}
        self._starts: dict[str, np.ndarray] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = {}
        return state

    @property
    def splits(self) -> tuple[str, ...]:
        """Names of the splits present."""
        return tuple(self.index["splits"])

    def _split(self, split: str) -> dict[str, Any]:
        if split not in self.index["splits"]:
            raise ValueError(f"split {split!r} not in {self.path} (available: {', '.join(self.splits)})")
        return self.index["splits"][split]

    def documents(self, split: str) -> DocumentTable:
        """The document table of ``split``."""
        if split not in self._tables:
            d = self._split(split)["documents"]
            self._tables[split] = DocumentTable(
                ids=list(d["id"]),
                domains=list(d["domain"]),
                shard=np.asarray(d["shard"], dtype=np.int64),
                offset=np.asarray(d["offset"], dtype=np.int64),
                length=np.asarray(d["length"], dtype=np.int64),
            )
        return self._tables[split]

    def shard(self, split: str, number: int) -> np.ndarray:
        """Memory-mapped shard ``number`` of ``split``: ``(N_shard,)`` tokens."""
        key = (split, number)
        if key not in self._maps:
            name = self._split(split)["shards"][number]["file"]
            self._maps[key] = np.load(self.path / name, mmap_mode="r")
        return self._maps[key]

    def shard_sizes(self, split: str) -> np.ndarray:
        """Tokens per shard (EOS included), ``(num_shards,)``."""
        return np.asarray([s["tokens"] for s in self._split(split)["shards"]], dtype=np.int64)

    def stream_length(self, split: str) -> int:
        """Length of the concatenated ``doc EOS doc EOS ...`` stream of ``split``."""
        return int(self.shard_sizes(split).sum())

    def num_tokens(self, split: str) -> int:
        """Document tokens in ``split`` (EOS separators not counted)."""
        return int(self.documents(split).length.sum())

    def doc_tokens(self, split: str, i: int) -> np.ndarray:
        """Tokens of document ``i`` of ``split`` as a read-only memory-mapped view ``(length,)``."""
        t = self.documents(split)
        start = int(t.offset[i])
        return self.shard(split, int(t.shard[i]))[start : start + int(t.length[i])]

    def stream_slice(self, split: str, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the split's EOS-joined stream as int64 ``(length,)``."""
        total = self.stream_length(split)
        if start < 0 or length < 0 or start + length > total:
            raise ValueError(
                f"stream slice [{start}, {start + length}) outside [0, {total}) of split {split!r}"
            )
        if split not in self._starts:
            self._starts[split] = np.concatenate([[0], np.cumsum(self.shard_sizes(split))])
        starts = self._starts[split]
        out = np.empty(length, dtype=np.int64)
        pos, filled = start, 0
        while filled < length:
            j = int(np.searchsorted(starts, pos, side="right")) - 1
            local = pos - int(starts[j])
            take = min(length - filled, int(starts[j + 1]) - pos)
            out[filled : filled + take] = self.shard(split, j)[local : local + take]
            filled += take
            pos += take
        return out

    def iter_documents(self, split: str) -> Iterator[tuple[str, str, np.ndarray]]:
        """Yield ``(id, domain, tokens)`` for each document of ``split`` in stored order."""
        t = self.documents(split)
        for i in range(len(t)):
            yield t.ids[i], t.domains[i], self.doc_tokens(split, i)
