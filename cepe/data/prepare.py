"""``prepare_data``: corpora -> deterministic splits -> tokenized shards + ``summary.json``.

The result directory is what :class:`~cepe.data.tokenized.TokenizedCorpus` and
:class:`~cepe.data.sequences.SequenceMixture` read. It is built in a temporary sibling directory and
swapped into place at the end, so an interrupted run never leaves a half-written dataset at ``out_dir``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cepe.data.corpora import BUNDLED, Document, load_corpus
from cepe.data.formats import read_path
from cepe.data.split import SPLITS, SplitFractions, assign_split
from cepe.data.tokenized import (
    DEFAULT_SHARD_TOKENS,
    INDEX_FILE,
    ShardWriter,
    atomic_write_json,
    tokenize_documents,
)
from cepe.fileio import umask

SUMMARY_FILE = "summary.json"
LONG_THRESHOLDS = (4096, 8192, 32768)
"""Document lengths (tokens) counted separately in ``summary.json`` (``docs_ge_4096`` ...)."""


def load_tokenizer(tokenizer: str | os.PathLike[str] | Any = "default") -> Any:
    """A Hugging Face tokenizer: ``"default"`` (the packaged decoder's), a local directory or hub id, or
    an already loaded tokenizer object (returned as is)."""
    if not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    from transformers import AutoTokenizer

    from cepe.assets import resolve_decoder

    return AutoTokenizer.from_pretrained(resolve_decoder(tokenizer))


def _check_sources(corpora: Sequence[str]) -> None:
    if not corpora:
        raise ValueError(f"no corpora given; name bundled corpora ({', '.join(BUNDLED)}) or local files")
    for src in corpora:
        if src not in BUNDLED and not Path(src).exists():
            raise ValueError(
                f"unknown corpus {src!r}: neither a bundled corpus ({', '.join(BUNDLED)}) nor an existing "
                "file or directory"
            )


def _documents(src: str, download: bool, text_field: str, max_docs: int | None) -> Iterator[Document]:
    docs = load_corpus(src, download=download) if src in BUNDLED else read_path(src, text_field=text_field)
    for n, doc in enumerate(docs):
        if max_docs is not None and n >= max_docs:
            return
        yield doc


def _new_stats() -> dict[str, int]:
    return {"docs": 0, "tokens": 0, **{f"docs_ge_{t}": 0 for t in LONG_THRESHOLDS}}


def _prepare_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / INDEX_FILE).exists():
        raise ValueError(
            f"output directory {out} is not empty and holds no cepe {INDEX_FILE}; choose a new or empty "
            "directory (it is replaced as a whole)"
        )


@dataclass
class PrepareDataConfig:
    """The arguments of :func:`prepare_data`, which are the flags of ``cepe prepare-data``.

    Attributes:
        out_dir: output directory; replaced as a whole if it already holds a cepe dataset.
        corpora: bundled corpus names (``austen``, ``acl``, ``stdlib``, ``linux-docs``, ``linux-code``,
            ``bbc``, ``essays``) and/or local files or directories (text, JSONL, parquet; see
            :func:`cepe.data.formats.read_path`).
        tokenizer: ``default`` (SmolLM2-135M-Instruct) or a directory / hub id (:func:`prepare_data` also
            takes a loaded tokenizer).
        seed: split seed (see :func:`cepe.data.split.assign_split`).
        test_fraction / retrieval_fraction: document fractions of the held-out splits.
        max_docs: read at most this many documents per corpus (quick runs; default: all).
        shard_tokens: tokens per shard file.
        text_field: text field of JSONL / parquet records.
        download: allow fetching Debian packages (Austen 1.6 MB, Linux 139 MB) into the cache.
        dedupe: skip documents whose exact text was already seen (so copies cannot leak across splits).
        progress: show a progress bar.
    """

    out_dir: str
    corpora: list[str] = field(default_factory=list)
    tokenizer: str = "default"
    seed: int = 0
    test_fraction: float = 0.05
    retrieval_fraction: float = 0.05
    max_docs: int | None = None
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    text_field: str = "text"
    download: bool = True
    dedupe: bool = True
    progress: bool = True

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`prepare_data`: ``prepare_data(**cfg.kwargs())``."""
        return asdict(self)


def prepare_data(
    corpora: Sequence[str],
    out_dir: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | Any = "default",
    seed: int = 0,
    test_fraction: float = 0.05,
    retrieval_fraction: float = 0.05,
    max_docs: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    text_field: str = "text",
    download: bool = True,
    dedupe: bool = True,
    progress: bool = True,
) -> Path:
    """Tokenize corpora into train / test / retrieval shards under ``out_dir``.

    The arguments are the fields of :class:`PrepareDataConfig` (documented there, with the same defaults);
    ``tokenizer`` may also be a loaded tokenizer object.

    Returns:
        ``out_dir``, holding the shards, ``index.json`` and ``summary.json`` (documents, tokens and
        documents with at least 4K / 8K / 32K tokens per domain and split).

    Raises:
        ValueError: unknown corpus name, bad fractions, a non-empty foreign ``out_dir``, duplicate ids,
            a tokenizer without EOS.
        CorpusUnavailableError: a bundled corpus is not installed and cannot be downloaded.
    """
    _check_sources(corpora)
    if max_docs is not None and max_docs <= 0:
        raise ValueError(f"max_docs must be positive, got {max_docs}")
    fractions = SplitFractions(test=test_fraction, retrieval=retrieval_fraction)
    out = Path(out_dir)
    _prepare_out_dir(out)
    tok, tok_name = _tokenizer_with_eos(tokenizer)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    os.chmod(tmp, 0o777 & ~umask())
    try:
        writer = ShardWriter(
            tmp,
            eos_id=int(tok.eos_token_id),
            vocab_size=len(tok),
            shard_tokens=shard_tokens,
            metadata={"tokenizer": str(tok_name), "seed": seed, "fractions": fractions.as_dict()},
        )
        tally = _Tally(dedupe)
        bar = _progress_bar(progress)
        for src in corpora:
            bar.set_postfix_str(src)
            docs = _documents(src, download, text_field, max_docs)
            for doc, ids in tokenize_documents(filter(tally.is_new_text, docs), tok):
                if tally.accept(doc, len(ids), src):
                    split = assign_split(doc["id"], seed, fractions)
                    writer.add(split, doc["id"], doc["domain"], ids)
                    tally.count(doc["domain"], split, len(ids))
                    bar.update(1)
        bar.close()
        writer.close()
        summary = {
            "corpora": list(corpora),
            "tokenizer": str(tok_name),
            "eos_id": int(tok.eos_token_id),
            "seed": seed,
            "fractions": fractions.as_dict(),
            "max_docs": max_docs,
            "skipped_duplicates": tally.duplicates,
            "skipped_empty": tally.empty,
            "splits": tally.totals(),
            "domains": tally.domains,
        }
        atomic_write_json(tmp / SUMMARY_FILE, summary)
        _swap_into_place(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _tokenizer_with_eos(tokenizer: str | os.PathLike[str] | Any) -> tuple[Any, Any]:
    """``(loaded tokenizer, the name recorded in the dataset)``; refuses a tokenizer without EOS."""
    tok = load_tokenizer(tokenizer)
    if getattr(tok, "eos_token_id", None) is None:
        raise ValueError("the tokenizer has no eos_token_id; documents are separated by EOS, set one first")
    return tok, tokenizer if isinstance(tokenizer, (str, os.PathLike)) else getattr(tok, "name_or_path", "")


def _progress_bar(progress: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(desc="prepare-data", unit="doc", disable=not progress)


@dataclass
class _Tally:
    """What :func:`prepare_data` has written: statistics per domain and split (``summary.json``), the
    document ids and (with ``dedupe``) text digests seen, and the documents skipped."""

    dedupe: bool
    domains: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    seen_ids: set[str] = field(default_factory=set)
    seen_text: set[bytes] = field(default_factory=set)
    duplicates: int = 0
    empty: int = 0

    def is_new_text(self, doc: Document) -> bool:
        """False for a document whose exact text was seen before (counted as a duplicate)."""
        if not self.dedupe:
            return True
        key = hashlib.blake2b(doc["text"].encode("utf-8", "surrogatepass"), digest_size=16).digest()
        if key in self.seen_text:
            self.duplicates += 1
            return False
        self.seen_text.add(key)
        return True

    def accept(self, doc: Document, n_tokens: int, src: str) -> bool:
        """False for a document without tokens (counted as empty); ``ValueError`` for an id seen before."""
        if not n_tokens:
            self.empty += 1
            return False
        if doc["id"] in self.seen_ids:
            raise ValueError(
                f"duplicate document id {doc['id']!r} (from {src}); ids must be unique across corpora"
            )
        self.seen_ids.add(doc["id"])
        return True

    def count(self, domain: str, split: str, n_tokens: int) -> None:
        """Count a document written to ``split``."""
        s = self.domains.setdefault(domain, {}).setdefault(split, _new_stats())
        s["docs"] += 1
        s["tokens"] += n_tokens
        for t in LONG_THRESHOLDS:
            s[f"docs_ge_{t}"] += int(n_tokens >= t)

    def totals(self) -> dict[str, dict[str, int]]:
        """The statistics per split, summed over domains."""
        totals = {sp: _new_stats() for sp in SPLITS}
        for per_split in self.domains.values():
            for sp, s in per_split.items():
                for key, value in s.items():
                    totals.setdefault(sp, _new_stats())[key] += value
        return totals


def _swap_into_place(tmp: Path, out: Path) -> None:
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".old-{out.name}-", dir=out.parent))
        os.replace(out, old / out.name)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
