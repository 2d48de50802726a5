"""Readers for local corpora: plain text files or directories, JSONL, parquet and Hugging Face datasets.

Each reader yields documents ``{"id": str, "text": str, "domain": str, ...}`` like the bundled loaders of
:mod:`cepe.data.corpora`, streaming (a file is never loaded whole except a single text document).
Records without an id get ``"<source>/<row number>"``; records without a domain get ``domain``
(default: the file or directory stem). Extra fields of JSONL/parquet/dataset records are kept.
"""

from __future__ import annotations

import gzip
import json
import os
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from cepe.data.corpora import Document, read_text_file

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".c", ".h", ".tex")
"""File suffixes :func:`read_text` picks up when given a directory (override with ``suffixes``)."""
_DATASET_METADATA = frozenset({"dataset_info.json", "state.json", "dataset_dict.json"})  # no documents


def _record_to_doc(
    record: Mapping[str, Any],
    where: str,
    default_id: str,
    text_field: str,
    id_field: str,
    domain_field: str,
    domain: str | None,
    default_domain: str,
) -> Document:
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected a JSON object / dict record, got {type(record).__name__}")
    if text_field not in record:
        keys = ", ".join(sorted(map(str, record))[:20])
        raise ValueError(
            f"{where}: record has no {text_field!r} field (fields: {keys}); pass text_field=<name> "
            "(`--text-field` on the command line)"
        )
    text = record[text_field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field {text_field!r} must be a string, got {type(text).__name__}")
    doc = {k: v for k, v in record.items() if k not in (text_field, id_field, domain_field)}
    rid = record.get(id_field)
    doc["id"] = str(rid) if rid is not None and rid != "" else default_id
    doc["text"] = text
    doc["domain"] = domain or str(record.get(domain_field) or default_domain)
    return doc


def read_text(
    path: str | os.PathLike[str],
    domain: str | None = None,
    suffixes: tuple[str, ...] = TEXT_SUFFIXES,
) -> Iterator[Document]:
    """One document per text file: ``path`` itself, or every file under a directory with a suffix in
    ``suffixes`` (sorted, recursive). Ids are ``"<stem>/<relative path>"``; extra key ``path``.

    Raises:
        ValueError: ``path`` does not exist, or a directory holds no matching file.
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(f"input {p} does not exist")
    name = p.stem if p.is_file() else p.name
    if p.is_file():
        files, base = [p], p.parent
    else:
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in suffixes)
        base = p
        if not files:
            raise ValueError(f"directory {p} holds no files ending in {', '.join(suffixes)}")
    for f in files:
        rel = f.relative_to(base).as_posix()
        text = read_text_file(f)
        if text.strip():
            yield {"id": f"{name}/{rel}", "text": text, "domain": domain or name, "path": rel}


def read_jsonl(
    path: str | os.PathLike[str],
    text_field: str = "text",
    id_field: str = "id",
    domain_field: str = "domain",
    domain: str | None = None,
    default_domain: str | None = None,
    id_prefix: str | None = None,
) -> Iterator[Document]:
    """Documents from a JSON-lines file (``.jsonl`` or ``.jsonl.gz``), one object per line; ``domain``
    overrides every record's, ``default_domain`` (else the file's name) is for records without one; a
    record without an id is ``<id_prefix>/<line>`` (default prefix: the file's name up to its first dot).

    Raises:
        ValueError: the file is missing, a line is not valid JSON, or a record lacks ``text_field``
            (the message names the file and line).
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"JSONL file {p} does not exist")
    stem = p.name.split(".")[0]
    prefix = stem if id_prefix is None else id_prefix
    opener = gzip.open if p.suffix.lower() == ".gz" else open  # read_path dispatches case-blind
    with opener(p, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
            yield _record_to_doc(
                record,
                where,
                f"{prefix}/{lineno}",
                text_field,
                id_field,
                domain_field,
                domain,
                default_domain or stem,
            )


def read_parquet(
    path: str | os.PathLike[str],
    text_field: str = "text",
    id_field: str = "id",
    domain_field: str = "domain",
    domain: str | None = None,
    batch_size: int = 1024,
    default_domain: str | None = None,
    id_prefix: str | None = None,
) -> Iterator[Document]:
    """Documents from a parquet file, read in record batches with ``pyarrow`` (``pip install pyarrow``).

    Raises:
        ValueError: the file is missing or has no ``text_field`` column.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"parquet file {p} does not exist")
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError("reading parquet needs pyarrow: `pip install pyarrow` (or cepe[data])") from err
    pf = pq.ParquetFile(p)
    names = pf.schema_arrow.names
    if text_field not in names:
        raise ValueError(
            f"{p}: no {text_field!r} column (columns: {', '.join(names)}); pass text_field=<name> "
            "(`--text-field` on the command line)"
        )
    row = 0
    for batch in pf.iter_batches(batch_size=batch_size):
        for record in batch.to_pylist():
            yield _record_to_doc(
                record,
                f"{p} row {row}",
                f"{p.stem if id_prefix is None else id_prefix}/{row}",
                text_field,
                id_field,
                domain_field,
                domain,
                default_domain or p.stem,
            )
            row += 1


def from_records(
    records: Iterable[Mapping[str, Any]],
    name: str = "records",
    text_field: str = "text",
    id_field: str = "id",
    domain_field: str = "domain",
    domain: str | None = None,
) -> Iterator[Document]:
    """Documents from any iterable of dict records, e.g. a Hugging Face ``datasets.Dataset``.

    Raises:
        ValueError: a record is not a mapping or lacks ``text_field``.
    """
    for i, record in enumerate(records):
        yield _record_to_doc(
            record, f"{name} record {i}", f"{name}/{i}", text_field, id_field, domain_field, domain, name
        )


def read_hf_dataset(
    dataset: Any,
    split: str = "train",
    text_field: str = "text",
    id_field: str = "id",
    domain: str | None = None,
    streaming: bool = True,
    **load_kwargs: Any,
) -> Iterator[Document]:
    """Documents from a Hugging Face dataset: a ``datasets`` object (any iterable of dicts) or a name /
    path passed to ``datasets.load_dataset(dataset, split=split, streaming=streaming, **load_kwargs)``.

    ``datasets`` is optional: it is imported only when ``dataset`` is a string.

    Raises:
        ImportError: ``dataset`` is a name and ``datasets`` is not installed.
    """
    if isinstance(dataset, (str, os.PathLike)):
        try:
            import datasets
        except ImportError as err:
            raise ImportError(
                "loading a dataset by name needs the optional `datasets` package: `pip install datasets`; "
                "or pass a JSONL/parquet file instead"
            ) from err
        name = str(dataset).rstrip("/").split("/")[-1]
        dataset = datasets.load_dataset(str(dataset), split=split, streaming=streaming, **load_kwargs)
    else:
        name = getattr(getattr(dataset, "info", None), "dataset_name", None) or "dataset"
    return from_records(dataset, name=name, text_field=text_field, id_field=id_field, domain=domain)


def read_path(
    path: str | os.PathLike[str],
    text_field: str = "text",
    id_field: str = "id",
    domain: str | None = None,
) -> Iterator[Document]:
    """Dispatch on the file name: ``*.jsonl``/``*.jsonl.gz`` -> :func:`read_jsonl`, ``*.json`` (one object
    or a list of objects) -> :func:`from_records`,
    ``*.parquet`` -> :func:`read_parquet`, any other file or a directory -> :func:`read_text`.

    A directory of ``*.jsonl`` / ``*.parquet`` files is read file by file in sorted order (a record without
    an id is ``<file name up to its first dot>/<line or row>``, or where two files share that name, the
    file's path there); text and ``.json`` files beside them are left out, with a warning (a dataset's
    README, licence and metadata files silently).

    Raises:
        ValueError: ``path`` does not exist.
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(f"input {p} does not exist (expected a bundled corpus name, a file or a directory)")
    name = p.name.lower()
    if p.is_dir():
        tabular = sorted(
            f
            for f in p.rglob("*")
            if f.is_file() and f.name.lower().endswith((".jsonl", ".jsonl.gz", ".parquet"))
        )
        if tabular:
            other = sorted(
                f.relative_to(p).as_posix()
                for f in p.rglob("*")
                if f.is_file()
                and (f.suffix in TEXT_SUFFIXES or f.suffix == ".json")
                and not f.name.upper().startswith(("README", "LICENSE"))
                and f.name not in _DATASET_METADATA
            )
            if other:  # (a dataset's README and licence are no documents)
                warnings.warn(
                    f"directory {p} holds record files (.jsonl / .parquet) and text files too "
                    f"({', '.join(other[:3])}{' ...' if len(other) > 3 else ''}): only the records are read; "
                    "give the text files as an input of their own",
                    stacklevel=2,
                )
            prefixes = _id_prefixes(tabular, p)
            for f in tabular:  # a record's own domain kept; the directory's name for those without one
                yield from _read_tabular(f, text_field, id_field, domain, p.name, prefixes[f])
            return
        yield from read_text(p, domain=domain)
    elif name.endswith((".jsonl", ".jsonl.gz")):
        yield from read_jsonl(p, text_field=text_field, id_field=id_field, domain=domain)
    elif name.endswith(".json"):
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{p}: invalid JSON ({err.msg} at line {err.lineno})") from None
        records = data if isinstance(data, list) else [data]
        yield from from_records(records, name=p.stem, text_field=text_field, id_field=id_field, domain=domain)
    elif name.endswith(".parquet"):
        yield from read_parquet(p, text_field=text_field, id_field=id_field, domain=domain)
    elif name.endswith(_PACKED):
        raise ValueError(
            f"{p} is compressed or archived ({name.rsplit('.', 1)[-1]}): unpack it, or give JSON lines as "
            "*.jsonl.gz (the one compressed form read here)"
        )
    else:
        yield from read_text(p, domain=domain)


_PACKED = (".gz", ".bz2", ".xz", ".zst", ".zip", ".tar", ".tgz", ".7z", ".lz4")
"""File endings read_path refuses rather than read as text (``.jsonl.gz`` is read)."""


def _id_prefixes(files: list[Path], root: Path) -> dict[Path, str]:
    """The default id prefix of each record file of the directory ``root``: the file's own default (its
    name up to the first dot; a parquet file's stem), or where two files share that, its path there
    without its record suffix (``sub/part-0`` for ``sub/part-0.jsonl``), so that ids stay unique and
    files that never collided keep the ids (and the document split) they had."""

    def own(f: Path) -> str:
        return f.stem if f.name.lower().endswith(".parquet") else f.name.split(".")[0]

    def path_of(f: Path) -> str:
        rel = f.relative_to(root).as_posix()
        for suffix in (".jsonl.gz", ".jsonl", ".parquet"):
            if rel.lower().endswith(suffix):
                return rel[: -len(suffix)]
        return rel

    counts = Counter(own(f) for f in files)
    prefix = {f: own(f) if counts[own(f)] == 1 else path_of(f) for f in files}
    again = Counter(prefix.values())  # x.jsonl beside x.parquet: their paths without suffixes still meet
    return {f: v if again[v] == 1 else f.relative_to(root).as_posix() for f, v in prefix.items()}


def _read_tabular(
    f: Path, text_field: str, id_field: str, domain: str | None, default_domain: str, id_prefix: str
) -> Iterator[Document]:
    """One ``*.jsonl`` / ``*.jsonl.gz`` / ``*.parquet`` file of a directory."""
    kw = dict(text_field=text_field, id_field=id_field, domain=domain, default_domain=default_domain)
    if f.name.lower().endswith(".parquet"):
        yield from read_parquet(f, id_prefix=id_prefix, **kw)
    else:
        yield from read_jsonl(f, id_prefix=id_prefix, **kw)
