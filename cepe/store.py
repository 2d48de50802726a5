"""A persistent context store: encode a document once, ask about it many times.

Each document is tokenized, split into chunks of ``chunk_length`` tokens and encoded once with
:meth:`CepeForCausalLM.encode_context`; its Φ (one ``D_enc`` vector per token, shared by every decoder
layer) is written with its key mask and token ids to one safetensors file that is read back
memory-mapped. Asking a question reads Φ instead of re-encoding the text.

Layout of a store directory::

    store.json                  format, adapter / tokenizer fingerprints, chunk length, dtype, width
    contexts/<id>.safetensors   states (S, D_enc), key_mask (S,) bool, token_ids (N,) int32
    tmp/                        staging for atomic writes (left-overs of killed writers are removed)

Ids are content-derived (the first 16 hex digits of the SHA-256 of the UTF-8 text), so adding the same
text twice stores it once. Every file carries the SHA-256 of its tensors and is checked on load: a
truncated or corrupted file is refused, never used. A store written by another adapter, tokenizer or
chunk length is refused with a message naming what differs.

Shape legend: K chunks, L chunk length, S = K·L encoder positions, N real tokens (N ≤ S), D = D_enc.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from . import fileio
from .chunking import chunk_ids
from .dtypes import torch_dtype
from .serve_config import STORE_DTYPES
from .training.runctl import pid_alive

STORE_FORMAT = "cepe-context-store"
STORE_VERSION = 1
CONTEXT_FORMAT = "cepe-context/1"
ID_PATTERN = re.compile(r"^[0-9a-f]{16}$")
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".tex", ".html", ".json", ".csv", ".yaml", ".yml", ".toml"}

# CepeConfig fields that do not change Φ or the model's function (runtime choices): not fingerprinted.
_PROCESS_TOKEN = os.urandom(4).hex()  # tells this process's staging files from an earlier one's of its pid

_RUNTIME_FIELDS = {
    "attn_implementation",
    "cross_attention_cache",
    "encoder_micro_batch",
    "pack_keys",
    "decoder_name_or_path",
    "init_mode",
    "train_context_tokens",
    "extra",
}
_ST_DTYPES = {
    "BF16": (np.uint16, torch.bfloat16),
    "F16": (np.float16, torch.float16),
    "F32": (np.float32, torch.float32),
    "I32": (np.int32, torch.int32),
    "I64": (np.int64, torch.int64),
    "BOOL": (np.bool_, torch.bool),
}


class StoreError(ValueError):
    """A store or stored context cannot be used; the message says why and what to do."""


class ContextNotFound(StoreError, KeyError):
    """No context with this id in the store."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class CorruptContext(StoreError):
    """A stored file fails its hash or layout check."""


def _check_name(name: Any) -> None:
    """Refuse a context name that cannot be stored (it goes into the file's UTF-8 metadata)."""
    if name is None:
        return
    if not isinstance(name, str):
        raise StoreError(f"a context name must be text (str), got {type(name).__name__}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as err:
        raise StoreError(
            f"the context name {ascii(name[:200])} is not valid Unicode ({err.reason}); give a UTF-8 name"
        ) from err


# ---------------------------------------------------------------------------------------- fingerprints
def _sha256_tensor(h: Any, name: str, t: torch.Tensor | np.ndarray) -> None:
    arr = (
        t
        if isinstance(t, np.ndarray)
        else t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    )
    h.update(f"{name}:{arr.nbytes};".encode())
    h.update(memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8)))


def fingerprint_config(cepe_config) -> dict[str, Any]:
    """The config fields an adapter's fingerprint hashes: those that define its function (not the runtime
    ``_RUNTIME_FIELDS``), without ``mix_hash`` where it has the value a config saved before the field
    existed loads with (``wrap`` with suffix matches, ``exact`` without; it acts only with them), so that
    stores written before keep their adapters' fingerprints."""
    cfg = {k: v for k, v in cepe_config.to_dict().items() if k not in _RUNTIME_FIELDS}
    legacy = "wrap" if cfg.get("output_mix") and cfg.get("mix_match") else "exact"
    if cfg.get("mix_hash") == legacy:
        del cfg["mix_hash"]
    return cfg


def adapter_fingerprint(model) -> str:
    """SHA-256 (first 16 hex digits) of a CEPE model's added weights and of the config fields that define
    its function (runtime choices such as the cache mode are left out).

    Kept on the model until its added weights change: any in-place write to them (a training step,
    ``load_adapter_state_dict``) bumps their version counters, a replaced or added tensor changes their
    storage or names, and either makes the next call hash again."""
    text = json.dumps(fingerprint_config(model.cepe_config), sort_keys=True)
    state = model.adapter_state_dict()
    key = (
        text,
        tuple((n, t.data_ptr(), t._version, t.dtype, tuple(t.shape)) for n, t in sorted(state.items())),
    )
    cached = getattr(model, "_cepe_store_fingerprint", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    h = hashlib.sha256()
    h.update(text.encode())
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        _sha256_tensor(h, name, t)
    fp = h.hexdigest()[:16]
    model._cepe_store_fingerprint = (key, fp)
    return fp


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 (first 16 hex digits) of a tokenizer's vocabulary and special token ids."""
    tokenizer = getattr(tokenizer, "wrapped_tokenizer", tokenizer)  # see cepe.server.LockedTokenizer
    h = hashlib.sha256()
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is not None:
        for tok, idx in sorted(get_vocab().items(), key=lambda kv: kv[1]):
            h.update(f"{idx}\t{tok}\n".encode("utf-8", "surrogatepass"))
    else:
        h.update(f"{type(tokenizer).__name__}:{getattr(tokenizer, 'vocab_size', '?')}".encode())
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        h.update(f"{attr}={getattr(tokenizer, attr, None)};".encode())
    return h.hexdigest()[:16]


def context_id(text: str) -> str:
    """The content-derived id of a document: first 16 hex digits of SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def check_id(cid: str) -> str:
    """Validate a context id (16 lowercase hex digits); ids never name a path."""
    if not isinstance(cid, str) or not ID_PATTERN.match(cid):
        raise ContextNotFound(f"{cid!r} is not a context id (16 hex digits, as `cepe context list` shows)")
    return cid


# ---------------------------------------------------------------------------------------- file format
def _content_hash(tensors: dict[str, torch.Tensor | np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        _sha256_tensor(h, name, tensors[name])
    return h.hexdigest()


def read_safetensors_mmap(
    path: Path,
) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, np.ndarray]]:
    """Read a safetensors file memory-mapped (copy-on-write: nothing is read until used).

    Returns:
        ``(tensors, metadata, raw)``: torch views of the mapped file, the header's ``__metadata__`` and the
        raw byte arrays (for hashing).

    Raises:
        CorruptContext: truncated file, unreadable header, offsets outside the file or a size mismatch.
    """
    tensors, meta, raw, _ = _read_mapped(path)
    return tensors, meta, raw


def _read_mapped(
    path: Path,
) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, np.ndarray], os.stat_result]:
    """:func:`read_safetensors_mmap` and the file's ``stat``, all from one open file: the header, the
    mapped data and the stat belong to the same file even when another process replaces ``path`` meanwhile
    (a file removed and written again under the same name)."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        size = st.st_size
        head = f.read(8)
        if len(head) < 8:
            raise CorruptContext(f"{path.name}: truncated (no header)")
        n = int.from_bytes(head, "little")
        if n <= 0 or 8 + n > size:
            raise CorruptContext(
                f"{path.name}: truncated or corrupted header (length {n}, file {size} bytes)"
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CorruptContext(f"{path.name}: corrupted header ({err})") from err
        if not isinstance(header, dict):
            raise CorruptContext(f"{path.name}: corrupted header (not an object)")
        meta = header.pop("__metadata__", None) or {}
        data_start, data_len = 8 + n, size - 8 - n
        tensors, raw = {}, {}
        for name, info in header.items():
            try:
                np_dt, torch_dt = _ST_DTYPES[info["dtype"]]
                shape = [int(s) for s in info["shape"]]
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as err:
                raise CorruptContext(f"{path.name}: corrupted header entry {name!r}") from err
            count = int(np.prod(shape)) if shape else 1
            if not (0 <= begin <= end <= data_len) or end - begin != count * np.dtype(np_dt).itemsize:
                raise CorruptContext(
                    f"{path.name}: tensor {name!r} lies outside the file or has the wrong size (truncated?)"
                )
            if end == begin:
                arr = np.zeros(0, dtype=np.uint8)
            else:  # mapped from this open file (the map keeps it readable once it is closed)
                arr = np.memmap(f, dtype=np.uint8, mode="c", offset=data_start + begin, shape=(end - begin,))
            raw[name] = arr
            tensors[name] = torch.from_numpy(arr).view(torch_dt).reshape(shape)
    return tensors, meta, raw, st


# ---------------------------------------------------------------------------------------- records
@dataclass
class StoredDocument:
    """One stored context, memory-mapped.

    Attributes:
        id: content-derived id. meta: the file's metadata (str values as stored).
        states: Φ ``(S, D)`` in the stored dtype. key_mask: ``(S,)`` bool. token_ids: ``(N,)`` int32.
    """

    id: str
    meta: dict[str, str]
    states: torch.Tensor
    key_mask: torch.Tensor
    token_ids: torch.Tensor

    @property
    def chunk_length(self) -> int:
        return int(self.meta["chunk_length"])

    @property
    def n_chunks(self) -> int:
        return self.states.shape[0] // self.chunk_length

    def chunk_rows(self, k: int) -> slice:
        """Rows of ``states`` / ``key_mask`` that belong to chunk ``k``."""
        return slice(k * self.chunk_length, (k + 1) * self.chunk_length)

    def chunk_token_ids(self, k: int) -> torch.Tensor:
        """The token ids ``(L,)`` (long) of chunk ``k``, -1 where the last chunk is padded."""
        length = self.chunk_length
        ids = self.token_ids[k * length : (k + 1) * length].long()
        return torch.cat([ids, ids.new_full((length - ids.numel(),), -1)])


@dataclass
class StoredContext:
    """What cross-attention reads for a question: Φ of the selected stored chunks.

    Attributes:
        states: ``(1, S', D)``; key_mask: ``(1, S')`` bool.
        chunks: ``[(context id, chunk index), ...]`` used, in the order of ``states``.
        token_ids: ``(1, S')`` the chunks' token ids (-1 on padding), for a model whose output mixture
            matches the decoder's last tokens in the context (``mix_match``); None for other models.
        context_tokens: real tokens attended to; total_tokens: real tokens of the named contexts.
        retrieved: True when the contexts exceeded the budget and chunks were selected by retrieval.
        retriever: the retriever used (None when every chunk was used).
    """

    states: torch.Tensor
    key_mask: torch.Tensor
    chunks: list[tuple[str, int]]
    context_tokens: int
    total_tokens: int
    retrieved: bool = False
    retriever: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    token_ids: torch.Tensor | None = None

    def encoder_kwargs(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Keyword arguments for ``CepeForCausalLM.generate`` / ``forward`` / ``prepare_context`` in place
        of encoding the context: ``encoder_hidden_states (1, S', D)`` and ``encoder_attention_mask (1, S')``,
        and with :attr:`token_ids` the same positions' ``encoder_input_ids (1, S')`` (not encoded again:
        the output mixture's suffix match reads them)."""
        states = self.states if dtype is None else self.states.to(dtype)
        out = {"encoder_hidden_states": states, "encoder_attention_mask": self.key_mask}
        if self.token_ids is not None:
            out["encoder_input_ids"] = self.token_ids
        return out

    def describe(self) -> dict[str, Any]:
        """JSON-ready summary (what an answer's metadata reports); ``chunks_used`` maps each context id to
        half-open ranges ``[start, stop)`` of chunk indices."""
        used: dict[str, list[list[int]]] = {}
        for cid, k in self.chunks:
            ranges = used.setdefault(cid, [])
            if ranges and ranges[-1][1] == k:
                ranges[-1][1] = k + 1
            else:
                ranges.append([k, k + 1])
        return {
            "contexts": list(used),
            "chunks_used": used,
            "context_tokens": self.context_tokens,
            "total_tokens": self.total_tokens,
            "retrieved": self.retrieved,
            "retriever": self.retriever,
        }


# ---------------------------------------------------------------------------------------- the store
class ContextStore:
    """A directory of encoded contexts (see the module docstring for the layout).

    Args:
        path: the store directory (created by the first :meth:`add`).
        model: the CEPE model that writes / reads Φ; needed by :meth:`add` and :meth:`context`, not by
            :meth:`list`, :meth:`show` or :meth:`remove`. When given, the store's fingerprints are checked
            against it on open.
        tokenizer: the decoder's tokenizer (same condition as ``model``).
        dtype: storage dtype of Φ for a new store (``"bf16"`` halves the bytes of ``"fp32"``; Φ is cast
            to the model's dtype when read). An existing store keeps its own.
        verify: check each file's SHA-256 on (first) load.

    Raises:
        StoreError: the store was written by another adapter, tokenizer or chunk length.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        model=None,
        tokenizer=None,
        dtype: str = "bf16",
        verify: bool = True,
    ) -> None:
        if dtype not in STORE_DTYPES:
            raise StoreError(f"store dtype must be one of {sorted(STORE_DTYPES)}, got {dtype!r}")
        self.path = Path(path)
        self.model, self.tokenizer = model, tokenizer
        self.verify = verify
        self._verified: dict[str, tuple[int, int]] = {}  # id -> (size, mtime_ns) checked
        self._retrievers: dict[tuple, Any] = {}
        if self.path.exists() and not self.path.is_dir():
            raise StoreError(f"{self.path} is a file, not a context store directory")
        self.info = self._read_info()
        if self.info is None:
            self.dtype = dtype
        else:
            self.dtype = self.info["dtype"]
            if model is not None:
                self.check_compatible()
        self._clean_tmp()

    # ------------------------------------------------------------------ metadata
    @property
    def contexts_dir(self) -> Path:
        return self.path / "contexts"

    @property
    def tmp_dir(self) -> Path:
        return self.path / "tmp"

    def _read_info(self) -> dict[str, Any] | None:
        f = self.path / "store.json"
        if not f.exists():
            if self.path.exists() and not self._creation_leftovers():
                raise StoreError(f"{self.path} exists but is not a context store (no store.json)")
            return None
        try:
            info = json.loads(f.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CorruptContext(f"{f}: corrupted store description ({err})") from err
        if info.get("format") != STORE_FORMAT or info.get("version") != STORE_VERSION:
            raise StoreError(f"{self.path} is not a version-{STORE_VERSION} {STORE_FORMAT}")
        return info

    def _creation_leftovers(self) -> bool:
        """Whether the directory holds nothing but what a creation stopped before ``store.json`` leaves: an
        empty ``contexts/`` and a ``tmp/`` of staging files (or nothing at all): a new store then."""
        for entry in self.path.iterdir():
            if entry.name == "tmp" and entry.is_dir():
                continue
            if entry.name == "contexts" and entry.is_dir() and not any(entry.iterdir()):
                continue
            return False
        return True

    def _model_info(self) -> dict[str, Any]:
        if self.model is None or self.tokenizer is None:
            raise StoreError(
                "this operation needs the CEPE model and its tokenizer: pass model= and tokenizer="
            )
        if getattr(self, "_tokenizer_fp", None) is None:
            self._tokenizer_fp = tokenizer_fingerprint(self.tokenizer)
        return {  # the adapter's fingerprint again each time: its weights may have changed (kept until then)
            "adapter": adapter_fingerprint(self.model),
            "tokenizer": self._tokenizer_fp,
            "chunk_length": int(self.model.cepe_config.chunk_length),
            "d_enc": int(self.model.cepe_config.encoder.state_size),
        }

    def check_compatible(self, info: dict[str, Any] | None = None, what: str | None = None) -> None:
        """Refuse a store (or one stored file's metadata ``info``) written for another model.

        Raises:
            StoreError: naming the first field that differs and what to do.
        """
        mine = self._model_info()
        info = info if info is not None else self.info
        if info is None:
            return
        what = what or f"store {self.path}"
        labels = {
            "chunk_length": "chunk length",
            "tokenizer": "tokenizer",
            "adapter": "adapter (encoder / cross-attention weights and config)",
            "d_enc": "width of the stored encoder states",
        }
        for key in ("chunk_length", "d_enc", "tokenizer", "adapter"):
            theirs = info.get(key)
            if str(theirs) != str(mine[key]):
                raise StoreError(
                    f"{what} was written with another {labels[key]} ({key} {theirs}, this model has "
                    f"{mine[key]}); open it with the model that wrote it, or use a new --store"
                )

    def _staging(self) -> dict[str, Any]:
        """Options of :func:`cepe.fileio.atomic_path` for the store's files: staged in ``tmp_dir`` under a
        name with this process's id (so :meth:`_clean_tmp` can tell abandoned ones), ``fsync``-ed,
        readable by the owner only."""
        return {
            "tmp_dir": self.tmp_dir,
            "prefix": f".tmp-{os.getpid()}-{_PROCESS_TOKEN}-",
            "suffix": "",
            "fsync": True,
            "mode": 0o600,
        }

    def _refresh_info(self) -> dict[str, Any] | None:
        """The store's description; read again while this object has none, since another process (``cepe
        context add`` next to a running server) may have created the store after it was opened."""
        if self.info is None:
            info = self._read_info()
            if info is not None:
                if self.model is not None:
                    self.check_compatible(info)
                self.info, self.dtype = info, info["dtype"]
        return self.info

    def _ensure_created(self) -> None:
        if self._refresh_info() is not None:
            return
        info = {"format": STORE_FORMAT, "version": STORE_VERSION, "dtype": self.dtype, **self._model_info()}
        self.path.mkdir(parents=True, exist_ok=True)
        self.contexts_dir.mkdir(exist_ok=True)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        fileio.write_json(self.path / "store.json", info, indent=2, sort_keys=True, **self._staging())
        self.info = info

    def _clean_tmp(self) -> None:
        """Remove staging files left by writers that are no longer running (a killed ``add``)."""
        if not self.tmp_dir.is_dir():
            return
        for f in self.tmp_dir.iterdir():
            m = re.match(r"^\.tmp-(\d+)-(?:([0-9a-f]{8})-)?", f.name)
            pid = int(m.group(1)) if m else None
            if pid == os.getpid():
                if m.group(2) == _PROCESS_TOKEN:  # this process's own write, maybe still under way
                    continue
            elif pid is not None and pid_alive(pid):
                continue
            f.unlink(missing_ok=True)  # its writer is gone (an earlier process with this id: a restart)

    def _file(self, cid: str) -> Path:
        return self.contexts_dir / f"{check_id(cid)}.safetensors"

    # ------------------------------------------------------------------ write
    @torch.no_grad()
    def add_text(self, text: str, name: str | None = None) -> tuple[str, bool]:
        """Tokenize, chunk, encode and store one document.

        Args:
            text: the document.
            name: a label kept in the metadata (e.g. the file name; never used as a path).

        Returns:
            ``(id, added)``; ``added`` is False when the same text was already stored.

        Raises:
            StoreError: empty text, a name that is not valid Unicode (checked before encoding), or a store
                written for another model.
        """
        if not isinstance(text, str):
            raise StoreError(f"a context must be text (str), got {type(text).__name__}")
        _check_name(name)
        self._model_info()
        cid = context_id(text)
        if self._stored(cid):
            return cid, False
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._add(cid, ids, name, hashlib.sha256(text.encode("utf-8")).hexdigest())

    @torch.no_grad()
    def add_token_ids(
        self,
        ids: Sequence[int],
        name: str | None = None,
        encoded: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[str, bool]:
        """Store a document given as token ids; its id derives from the ids (int32 bytes).

        Args:
            ids: token ids ``(N,)``.
            name: a label kept in the metadata.
            encoded: Φ already computed for these ids by ``model.encode_context`` on
                ``chunk_ids(ids, L)``: ``(states (1, S, D), key_mask (1, S))`` (not encoded again).

        Returns:
            ``(id, added)``.

        Raises:
            StoreError: a name that is not valid Unicode, or a store written for another model.
        """
        _check_name(name)
        self._model_info()
        raw = np.asarray(list(ids), dtype=np.int32).tobytes()
        source = hashlib.sha256(raw).hexdigest()
        cid = source[:16]
        if self._stored(cid):
            return cid, False
        return self._add(cid, list(ids), name, source, encoded)

    def _stored(self, cid: str) -> bool:
        """Whether context ``cid`` is stored already; a corrupted or foreign copy is refused (load raises)
        instead of silently kept, and one removed meanwhile is not stored."""
        if not self._file(cid).exists():
            return False
        try:
            self.load(cid)
        except ContextNotFound:
            return False
        return True

    def _add(self, cid, ids, name, source_sha256, encoded=None) -> tuple[str, bool]:
        _check_name(name)
        info = self._model_info()
        if not ids:
            raise StoreError("the context is empty (no tokens); give some text")
        self._ensure_created()
        model, length = self.model, info["chunk_length"]
        chunks, mask = chunk_ids(ids, length, pad_id=getattr(self.tokenizer, "pad_token_id", None) or 0)
        t0 = time.perf_counter()
        if encoded is None:
            states, key_mask = model.encode_context(
                chunks[None].to(model.device), mask[None].to(model.device)
            )
        else:
            states, key_mask = encoded
            if tuple(states.shape) != (1, chunks.numel(), info["d_enc"]) or tuple(key_mask.shape) != (
                1,
                chunks.numel(),
            ):
                raise StoreError(
                    f"encoded states {tuple(states.shape)} / mask {tuple(key_mask.shape)} do not match "
                    f"{len(ids)} ids in chunks of {length} (expected (1, {chunks.numel()}, {info['d_enc']}))"
                )
        seconds = time.perf_counter() - t0
        tensors = {
            "states": states[0].to(torch_dtype(self.dtype)).cpu().contiguous(),  # (S, D)
            "key_mask": key_mask[0].bool().cpu().contiguous(),  # (S,)
            "token_ids": torch.as_tensor(ids, dtype=torch.int32),  # (N,)
        }
        meta = {
            "format": CONTEXT_FORMAT,
            "id": cid,
            "name": (name or "")[:200],
            "source_sha256": source_sha256,
            "n_tokens": str(len(ids)),
            "n_chunks": str(chunks.shape[0]),
            "chunk_length": str(length),
            "d_enc": str(info["d_enc"]),
            "dtype": self.dtype,
            "encode_dtype": str(model.dtype).removeprefix("torch."),
            "adapter": info["adapter"],
            "tokenizer": info["tokenizer"],
            "encode_seconds": f"{seconds:.4f}",
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "content_sha256": _content_hash(tensors),
        }
        self.contexts_dir.mkdir(parents=True, exist_ok=True)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        with fileio.atomic_path(self._file(cid), **{**self._staging(), "suffix": ".safetensors"}) as tmp:
            save_file(tensors, tmp, metadata=meta)
        return cid, True

    def add_paths(self, paths: Iterable[str | os.PathLike[str]], log=None) -> list[tuple[str, str, bool]]:
        """Add text files and every text file under directories (sorted; hidden entries skipped).

        Returns:
            ``[(id, file name, added), ...]``.

        Raises:
            StoreError: a path that does not exist or a file that is not UTF-8 text.
        """
        files: list[Path] = []
        own = self.path.resolve()
        for p in map(Path, paths):
            if p.is_dir():
                files += sorted(
                    f
                    for f in p.rglob("*")
                    if f.is_file()
                    and f.suffix.lower() in TEXT_SUFFIXES
                    and not any(part.startswith(".") for part in f.relative_to(p).parts)
                    and not f.resolve().is_relative_to(own)  # never the store's own files
                )
            elif p.is_file():
                files.append(p)
            else:
                raise StoreError(f"{p}: no such file or directory")
        for f in files:  # the name is stored as the context's label: refused before any file is encoded
            try:
                f.name.encode("utf-8")
            except UnicodeEncodeError as err:
                shown = os.fsencode(f).decode("utf-8", "backslashreplace")
                raise StoreError(
                    f"{shown}: the file name is not UTF-8; it is kept as the context's name, so rename the "
                    "file (nothing was added)"
                ) from err
        out = []
        for f in files:
            try:
                text = f.read_bytes().decode("utf-8")
            except UnicodeDecodeError as err:
                raise StoreError(
                    f"{f}: not UTF-8 text ({err.reason} at byte {err.start}); convert it first"
                ) from err
            cid, added = self.add_text(text, name=f.name)
            out.append((cid, f.name, added))
            if log:
                log(f"{cid}  {'added' if added else 'already stored'}  {f.name}")
        return out

    def remove(self, cid: str) -> None:
        """Delete one stored context.

        Raises:
            ContextNotFound: unknown id.
        """
        try:  # no exists() first: another remove may run between the two (the server's threads)
            self._file(cid).unlink()
        except FileNotFoundError:
            raise ContextNotFound(f"no context {cid} in {self.path}") from None
        self._verified.pop(cid, None)
        self._retrievers.clear()

    # ------------------------------------------------------------------ read
    def ids(self) -> list[str]:
        """Ids of the stored contexts (sorted)."""
        if not self.contexts_dir.is_dir():
            return []
        return sorted(
            f.stem
            for f in self.contexts_dir.iterdir()
            if f.suffix == ".safetensors" and ID_PATTERN.match(f.stem)
        )

    def __contains__(self, cid: str) -> bool:
        return isinstance(cid, str) and bool(ID_PATTERN.match(cid)) and self._file(cid).exists()

    def show(self, cid: str) -> dict[str, Any]:
        """Metadata of one context (header only: no hash check)."""
        f = self._file(cid)
        try:
            _, meta, _ = read_safetensors_mmap(f)
            size = f.stat().st_size
        except FileNotFoundError:  # never stored, or removed meanwhile
            raise ContextNotFound(f"no context {cid} in {self.path}") from None
        out: dict[str, Any] = dict(meta)
        for key in ("n_tokens", "n_chunks", "chunk_length", "d_enc"):
            if key in out:
                out[key] = int(out[key])
        out["file_bytes"] = size
        return out

    def list(self) -> list[dict[str, Any]]:
        """Metadata of every stored context (header only; one removed while listing is left out)."""
        out = []
        for cid in self.ids():
            try:
                out.append(self.show(cid))
            except ContextNotFound:
                continue
            except CorruptContext as err:
                out.append({"id": cid, "error": str(err)})
        return out

    def load(self, cid: str, verify: bool | None = None) -> StoredDocument:
        """Map one stored context (its SHA-256 is checked on the first load of each file version).

        Raises:
            ContextNotFound: unknown id. CorruptContext: truncated or corrupted file. StoreError: written
            for another model.
        """
        f = self._file(cid)
        try:  # the stamp, header and data of one file (another process may replace it meanwhile)
            tensors, meta, raw, st = _read_mapped(f)
        except FileNotFoundError:  # never stored, or removed meanwhile
            raise ContextNotFound(f"no context {cid} in {self.path}") from None
        missing = {"states", "key_mask", "token_ids"} - set(tensors)
        if missing or meta.get("format") != CONTEXT_FORMAT:
            raise CorruptContext(f"context {cid}: not a {CONTEXT_FORMAT} file (missing {sorted(missing)})")
        if meta.get("id") != cid:
            raise CorruptContext(f"context {cid}: the file says it holds {meta.get('id')!r}")
        verify = self.verify if verify is None else verify
        stamp = (st.st_size, st.st_mtime_ns)
        if verify and self._verified.get(cid) != stamp:
            if _content_hash(raw) != meta.get("content_sha256"):
                raise CorruptContext(
                    f"context {cid} is corrupted (its SHA-256 does not match); remove it "
                    f"(`cepe context rm {cid}`) and add the document again"
                )
            self._verified[cid] = stamp
        if self.model is not None:
            self.check_compatible(meta, what=f"context {cid}")
        states, key_mask = tensors["states"], tensors["key_mask"]
        if (
            states.dim() != 2
            or key_mask.shape != states.shape[:1]
            or states.shape[0] % int(meta["chunk_length"])
        ):
            raise CorruptContext(f"context {cid}: inconsistent tensor shapes")
        return StoredDocument(cid, meta, states, key_mask, tensors["token_ids"])

    def chunk_texts(self, doc: StoredDocument) -> list[str]:
        """The text of each of a document's chunks (decoded from its stored token ids)."""
        ids, length = doc.token_ids.tolist(), doc.chunk_length
        return [self.tokenizer.decode(ids[i : i + length]) for i in range(0, len(ids), length)]

    def context(
        self,
        ids: Sequence[str],
        query: str | None = None,
        budget_tokens: int | None = None,
        retriever: str = "bm25",
        retriever_model_dir: str | None = None,
    ) -> StoredContext:
        """Φ of stored contexts for one question, ready for ``generate(**ctx.encoder_kwargs())``.

        When the contexts hold more than ``budget_tokens`` tokens, the ``budget_tokens // L`` chunks most
        relevant to ``query`` are selected with a retriever (``"bm25"`` or ``"dense"``, see
        :mod:`cepe.eval.retrieval`) over the stored chunks' text; otherwise every chunk is used.

        Raises:
            ContextNotFound / CorruptContext / StoreError: see :meth:`load`; ValueError: no ids, or a
            budget smaller than one chunk.
        """
        if self.model is None:
            raise StoreError("reading contexts for a question needs the model: pass model= and tokenizer=")
        if not ids:
            raise StoreError("name at least one context id")
        ids = list(dict.fromkeys(ids))  # repeated ids once
        t0 = time.perf_counter()
        docs = [self.load(cid) for cid in ids]
        t_load = time.perf_counter() - t0
        total = sum(int(d.meta["n_tokens"]) for d in docs)
        length = int(self._model_info()["chunk_length"])  # each loaded document's, as load checked
        all_chunks = [(d, k) for d in docs for k in range(d.n_chunks)]
        retrieved = False
        kind = None
        if budget_tokens is not None and total > budget_tokens:
            if budget_tokens < length:
                raise StoreError(
                    f"the context budget ({budget_tokens} tokens) is less than one chunk ({length})"
                )
            kind = retriever
            keep = budget_tokens // length
            index = self._retriever(ids, docs, retriever, retriever_model_dir)
            idx, _ = index.search([query or ""], keep)
            chosen = sorted(int(i) for i in idx[0][:keep])
            all_chunks = [all_chunks[i] for i in chosen]
            retrieved = True
        t1 = time.perf_counter()
        states = torch.cat([d.states[d.chunk_rows(k)] for d, k in all_chunks])  # (S', D)
        mask = torch.cat([d.key_mask[d.chunk_rows(k)] for d, k in all_chunks])  # (S',)
        states = states.to(device=self.model.device, dtype=self.model.dtype)
        token_ids = None
        if getattr(self.model, "reads_context_ids", False):  # the output mixture's suffix match
            token_ids = torch.cat([d.chunk_token_ids(k) for d, k in all_chunks])[None].to(self.model.device)
        return StoredContext(
            states=states[None],
            key_mask=mask[None].to(self.model.device),
            chunks=[(d.id, k) for d, k in all_chunks],
            context_tokens=int(mask.sum()),
            total_tokens=total,
            retrieved=retrieved,
            retriever=kind,
            timings={"load_s": t_load, "gather_s": time.perf_counter() - t1},
            token_ids=token_ids,
        )

    def _retriever(self, ids: list[str], docs: list[StoredDocument], kind: str, model_dir: str | None):
        key = (tuple(ids), kind, model_dir)
        index = self._retrievers.get(key)
        if index is None:
            from .eval.retrieval import build_retriever

            texts = [t for d in docs for t in self.chunk_texts(d)]
            index = build_retriever(kind, texts, model_dir=model_dir)
            if len(self._retrievers) >= 8:  # the oldest out (a remove() may have emptied it meanwhile)
                self._retrievers.pop(next(iter(self._retrievers), None), None)
            self._retrievers[key] = index
        return index


# ---------------------------------------------------------------------------------------- asking
def prompt_ids(tokenizer, messages: Sequence[dict[str, str]], chat: bool = True) -> list[int]:
    """Decoder token ids for a conversation: the tokenizer's chat template with a generation prompt, or
    (no template, or ``chat=False``) the messages' contents joined by newlines."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        return list(ids)
    text = "\n".join(m["content"] for m in messages)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def ask(
    model,
    tokenizer,
    store: ContextStore,
    question: str,
    ids: Sequence[str],
    max_new_tokens: int = 64,
    budget_tokens: int | None = None,
    retriever: str = "bm25",
    cross_attention_cache: str | None = None,
    chat: bool = True,
) -> dict[str, Any]:
    """Answer ``question`` from stored contexts without re-encoding them (greedy decoding).

    Returns:
        ``{"answer": text, "context": StoredContext.describe(), "prompt_tokens", "completion_tokens"}``.
    """
    ids_q = prompt_ids(tokenizer, [{"role": "user", "content": question}], chat)
    if not ids_q:
        raise StoreError("the question is empty (no tokens): give a question")
    ctx = store.context(ids, query=question, budget_tokens=budget_tokens, retriever=retriever)
    input_ids = torch.tensor([ids_q])
    out = model.generate(
        input_ids.to(model.device),
        attention_mask=torch.ones_like(input_ids).to(model.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=getattr(tokenizer, "pad_token_id", None),
        cross_attention_cache=cross_attention_cache,
        **ctx.encoder_kwargs(),
    )
    new = out[0, input_ids.shape[1] :]
    return {
        "answer": tokenizer.decode(new, skip_special_tokens=True),
        "context": ctx.describe(),
        "prompt_tokens": int(input_ids.shape[1]),
        "completion_tokens": int(new.numel()),
    }
