"""Shared evaluation plumbing: the loaded model bundle, task configs, document sources, the per-method
loop with cost measurement, and small text helpers.

Shape legend: B batch, K chunks, L chunk length, T tokens.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cepe.alloc import purge
from cepe.eval.methods import METHODS, Method
from cepe.eval.registry import build_method
from cepe.measure import Meter


@dataclass
class EvalSetup:
    """A loaded model bundle and run-wide options.

    Attributes:
        tokenizer: HF tokenizer (or any object with ``encode``/``decode`` and special token ids).
        decoder: the plain HF causal LM used by the baselines (for a CEPE model: ``model.decoder``; with no
            context set its cross-attention is inactive).
        cepe_model: the CEPE model, or None (then the ``cepe`` method is unavailable).
        methods: method names to run.
        method_options: per-method settings, e.g. ``{"streamingllm": {"recent_tokens": 2044}}``.
        autocast_dtype: e.g. ``torch.bfloat16`` for bf16 autocast (None = model dtype).
        batch_size: requests of equal length scored per forward.
        seed: run seed.
        limit: cap on examples per setting (None = the config's count).
        progress: show progress bars.
    """

    tokenizer: Any
    decoder: torch.nn.Module
    cepe_model: torch.nn.Module | None = None
    methods: list[str] = field(default_factory=lambda: ["truncated"])
    method_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    autocast_dtype: torch.dtype | None = None
    batch_size: int = 8
    seed: int = 0
    limit: int | None = None
    progress: bool = True
    _cache: dict[str, Method] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for m in self.methods:
            if m not in METHODS:
                raise ValueError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
        if "cepe" in self.methods and self.cepe_model is None:
            raise ValueError(
                "method 'cepe' needs a CEPE model: pass --model <CEPE adapter dir>, or remove 'cepe' from "
                "--methods to evaluate a plain decoder"
            )

    @property
    def device(self) -> torch.device:
        return next(self.decoder.parameters()).device

    @property
    def eos_ids(self) -> list[int]:
        """The ids that end a generation: the tokenizer's EOS and those of the decoder's generation config
        (an instruction-tuned decoder may end its turns with another token than its tokenizer's EOS)."""
        ids = [getattr(self.tokenizer, "eos_token_id", None)]
        gen = getattr(self.decoder, "generation_config", None)
        own = getattr(gen, "eos_token_id", None)
        ids += own if isinstance(own, (list, tuple)) else [own]
        return sorted({int(e) for e in ids if e is not None})

    @property
    def pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(self.tokenizer, "eos_token_id", None)
        return int(pad or 0)

    @property
    def start_id(self) -> int:
        """Token that stands for the empty string (BOS if the tokenizer has one, else EOS)."""
        for name in ("bos_token_id", "eos_token_id"):
            v = getattr(self.tokenizer, name, None)
            if v is not None:
                return int(v)
        raise ValueError(
            "the tokenizer defines neither a BOS nor an EOS token; the empty prompt is undefined"
        )

    def reset_methods(self) -> None:
        """Forget the built method objects (after changing ``methods`` or ``method_options``)."""
        self._cache.clear()

    def method(self, name: str) -> Method:
        """The (cached) method object for ``name``."""
        if name not in self._cache:
            self._cache[name] = build_method(
                name,
                self.decoder,
                self.cepe_model,
                self.method_options.get(name),
                eos_token_id=self.eos_ids,
                pad_token_id=self.pad_id,
                autocast_dtype=self.autocast_dtype,
                batch_size=self.batch_size,
            )
        return self._cache[name]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def newline_ids(self) -> tuple[int, ...]:
        """Ids of tokens that decode to text containing a newline (generation stops there)."""
        ids = self.encode("\n")
        return tuple(ids) if len(ids) == 1 else ()


def iter_source(source: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Documents ``{"id", "text", "domain", ...}`` of one source spec.

    A spec is ``{"corpus": <bundled name>}`` (see :mod:`cepe.data.corpora`), ``{"path": <file or dir>,
    "text_field": "text"}`` (JSONL, JSON, parquet, text files), or ``{"documents": [{"text": ...}, ...]}``
    (inline, for tests). ``name`` renames the domain, ``max_documents`` caps the count. ``download:
    true`` lets a ``corpus`` that comes from a Debian package be fetched into the cache when it is not
    there (otherwise that is an error naming the command that fetches it).

    ``split`` (``"train" | "test" | "retrieval"``) keeps only the documents of that split of the
    deterministic document-level split used for training: its seed and fractions are read from
    ``split_from`` (a ``cepe prepare-data`` output directory with ``summary.json``) or given as
    ``split_seed`` / ``test_fraction`` / ``retrieval_fraction``. Evaluating on ``split: test`` of the
    training data's directory guarantees the documents were never trained on: a held-out split also drops
    a document whose text (up to whitespace) is a training document's too (the same text under another
    id), so a held-out split is read whole before its first document comes.
    """
    name = source.get("name")
    cap = source.get("max_documents")
    if "documents" in source:
        docs: Iterable[dict[str, Any]] = (
            {"id": d.get("id", f"doc{i}"), "domain": d.get("domain", name or "inline"), **d}
            for i, d in enumerate(source["documents"])
        )
    elif "corpus" in source:
        from cepe.data.corpora import load_corpus

        docs = load_corpus(source["corpus"], download=bool(source.get("download", False)))
    elif "path" in source:
        from cepe.data.formats import read_path

        docs = read_path(source["path"], text_field=source.get("text_field", "text"))
    else:
        raise ValueError(f"source {source} needs one of 'corpus', 'path' or 'documents'")
    if "split" in source:
        docs = _filter_split(docs, source)
    for i, d in enumerate(docs):
        if cap is not None and i >= cap:
            break
        if name:
            d = {**d, "domain": name}
        yield d


def _filter_split(docs: Iterable[dict[str, Any]], source: dict[str, Any]) -> Iterator[dict[str, Any]]:
    import json
    from pathlib import Path

    from cepe.data.split import SPLITS, SplitFractions, assign_split

    split = source["split"]
    if split not in SPLITS:
        raise ValueError(f"source split must be one of {SPLITS}, got {split!r}")
    if "split_from" in source:
        summary = Path(source["split_from"]) / "summary.json"
        if not summary.exists():
            raise FileNotFoundError(
                f"{summary} not found: split_from must be a `cepe prepare-data` output dir"
            )
        info = json.loads(summary.read_text())
        seed, fr = int(info["seed"]), info["fractions"]
        fractions = SplitFractions(test=float(fr["test"]), retrieval=float(fr["retrieval"]))
    else:
        seed = int(source.get("split_seed", 0))
        fractions = SplitFractions(
            test=float(source.get("test_fraction", 0.05)),
            retrieval=float(source.get("retrieval_fraction", 0.05)),
        )
    if split == "train":
        for d in docs:
            if assign_split(d["id"], seed, fractions) == split:
                yield d
        return
    # a held-out document whose text (up to whitespace) is also a training document's was trained on:
    # corpora hold such copies under other ids, which the id-keyed split puts on either side
    held: list[dict[str, Any]] = []
    trained: set[bytes] = set()
    for d in docs:
        side = assign_split(d["id"], seed, fractions)
        if side == split:
            held.append(d)
        elif side == "train":
            trained.add(text_key(d.get("text", "")))
    for d in held:
        if text_key(d.get("text", "")) not in trained:
            yield d


def text_key(text: str) -> bytes:
    """A 16-byte digest of ``text`` with its whitespace runs made single spaces (copies of one document
    laid out differently share it)."""
    import hashlib

    return hashlib.blake2b(" ".join(str(text).split()).encode(), digest_size=16).digest()


def run_examples(
    setup: EvalSetup,
    method: str,
    items: Sequence[Any],
    fn: Callable[[Method, Any], tuple[float | dict[str, float], int]],
    desc: str,
) -> tuple[list[float | dict[str, float]], dict[str, Any]]:
    """Run ``fn(method_obj, item) -> (value, tokens)`` over ``items`` under a :class:`Meter`.

    Returns:
        ``(values, cost)``: per-item values and the meter summary (tokens/s, peak memory).
    """
    from tqdm.auto import tqdm

    m = setup.method(method)
    meter = Meter(setup.device)
    values = []
    for item in tqdm(items, desc=f"{desc} [{method}]", disable=not setup.progress, leave=False):
        with meter.measure(0):
            value, tokens = fn(m, item)
        meter.tokens += int(tokens)
        values.append(value)
        if setup.device.type == "cpu":  # jemalloc's kept pages back to the kernel: an item's footprint
            purge()
    return values, meter.summary()


def limit_items(items: list[Any], n: int | None, setup: EvalSetup) -> list[Any]:
    """Keep the first ``min(n, setup.limit)`` items (None = no cap)."""
    for cap in (n, setup.limit):
        if cap is not None:
            items = items[: int(cap)]
    return items


_SENT = re.compile(r"(?<=[.!?])\s+")


def split_sentences(text: str) -> list[str]:
    """Split text after ``.``/``!``/``?`` followed by whitespace; each sentence keeps a trailing space."""
    return [s + " " for s in _SENT.split(text.strip()) if s]


def pack_sentences(sentences: Sequence[Sequence[int]], chunk_length: int) -> list[list[int]]:
    """Greedily pack tokenised sentences into chunks of at most ``chunk_length`` tokens, splitting only at
    sentence boundaries (a sentence longer than a chunk is cut into full chunks)."""
    chunks: list[list[int]] = []
    cur: list[int] = []
    for s in sentences:
        s = list(s)
        if len(cur) + len(s) <= chunk_length:
            cur.extend(s)
            continue
        if cur:
            chunks.append(cur)
            cur = []
        while len(s) > chunk_length:
            chunks.append(s[:chunk_length])
            s = s[chunk_length:]
        cur = s
    if cur:
        chunks.append(cur)
    return chunks


def chunk_tail_aligned(ids: Sequence[int], chunk_length: int) -> list[list[int]]:
    """Split ``ids`` into pieces of ``chunk_length`` aligned to the end (the first piece may be shorter),
    so the last piece adjoins what follows."""
    ids = list(ids)
    first = len(ids) % chunk_length
    out = [ids[:first]] if first else []
    out.extend(ids[i : i + chunk_length] for i in range(first, len(ids), chunk_length))
    return out


def wrap_prompt(setup: EvalSetup, use_chat: bool | str, body_marker: str = "\x00BODY\x00") -> tuple[str, str]:
    """Text before and after the user content when a chat template applies (``("", "")`` otherwise).

    ``use_chat`` is True, False or ``"auto"`` (use the tokenizer's chat template when it has one).
    """
    tok = setup.tokenizer
    has = bool(getattr(tok, "chat_template", None))
    if use_chat == "auto":
        use_chat = has
    if not use_chat:
        return "", ""
    if not has:
        raise ValueError(
            "chat_template=true but the tokenizer has no chat template; set chat_template: false"
        )
    text = tok.apply_chat_template(
        [{"role": "user", "content": body_marker}], tokenize=False, add_generation_prompt=True
    )
    before, after = text.split(body_marker, 1)
    return before, after
