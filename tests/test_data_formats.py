"""Local corpus readers: text, JSONL, JSON, parquet, dataset-like iterables."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from cepe.data.formats import from_records, read_hf_dataset, read_jsonl, read_parquet, read_path, read_text


def test_text_file_and_directory(tmp_path: Path) -> None:
    d = tmp_path / "notes"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("alpha", encoding="utf-8")
    (d / "sub" / "b.md").write_text("beta", encoding="utf-8")
    (d / "skip.bin").write_bytes(b"\x00\x01")
    (d / "empty.txt").write_text("  \n", encoding="utf-8")
    docs = list(read_text(d))
    assert [x["id"] for x in docs] == ["notes/a.txt", "notes/sub/b.md"]
    assert [x["text"] for x in docs] == ["alpha", "beta"]
    assert {x["domain"] for x in docs} == {"notes"}
    (single,) = list(read_path(d / "a.txt", domain="books"))
    assert single["domain"] == "books" and single["text"] == "alpha"


def test_jsonl_plain_and_gzip(tmp_path: Path) -> None:
    rows = [{"id": "x1", "text": "one", "domain": "news", "label": 3}, {"body": "two"}]
    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows[:1]) + "\n\n", encoding="utf-8")
    (doc,) = list(read_path(p))
    assert doc == {"id": "x1", "text": "one", "domain": "news", "label": 3}
    g = tmp_path / "c2.jsonl.gz"
    with gzip.open(g, "wt", encoding="utf-8") as f:
        f.write(json.dumps(rows[1]) + "\n")
    (doc2,) = list(read_jsonl(g, text_field="body"))
    assert doc2["text"] == "two" and doc2["id"] == "c2/1" and doc2["domain"] == "c2"


def test_jsonl_errors_name_the_problem(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n{"content": "no text"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: record has no 'text' field \(fields: content\)"):
        list(read_jsonl(p))
    p.write_text('{"text": "ok"}\n{not json\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        list(read_jsonl(p))
    p.write_text('{"text": 5}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="must be a string"):
        list(read_jsonl(p))
    with pytest.raises(ValueError, match="does not exist"):
        list(read_path(tmp_path / "missing.jsonl"))


def test_json_array(tmp_path: Path) -> None:
    p = tmp_path / "arr.json"
    p.write_text(json.dumps([{"text": "a"}, {"text": "b", "id": "k"}]), encoding="utf-8")
    assert [d["id"] for d in read_path(p)] == ["arr/0", "k"]


def test_parquet_round_trip(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"], "content": ["x", "y", "z"], "year": [1, 2, 3]}), p)
    docs = list(read_parquet(p, text_field="content", batch_size=2))
    assert [d["text"] for d in docs] == ["x", "y", "z"] and docs[2]["year"] == 3 and docs[0]["domain"] == "t"
    with pytest.raises(ValueError, match="no 'text' column"):
        list(read_path(p))
    # a directory of tabular files is read file by file
    assert [d["id"] for d in read_path(tmp_path, text_field="content")] == ["a", "b", "c"]


class _FakeDataset:
    """Stands in for a datasets.Dataset: iterable of dict records."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def test_dataset_like_iterables() -> None:
    ds = _FakeDataset([{"text": "a", "id": 7}, {"text": "b"}])
    docs = list(read_hf_dataset(ds, domain="web"))
    assert [d["id"] for d in docs] == ["7", "dataset/1"] and {d["domain"] for d in docs} == {"web"}
    with pytest.raises(ValueError, match="record 0: expected a JSON object"):
        list(from_records(["not a dict"]))


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed")
def test_dataset_by_name_without_datasets_says_how_to_install() -> None:
    with pytest.raises(ImportError, match="pip install datasets"):
        list(read_hf_dataset("some/dataset"))


def test_directory_of_jsonl_keeps_each_records_domain(tmp_path: Path) -> None:
    """In a directory of JSON-lines files a record's own domain is kept, as when its file is read alone;
    the directory's name is for records without one; an explicit domain still overrides both."""
    d = tmp_path / "mixed"
    d.mkdir()
    rows = [{"id": "a", "text": "one", "domain": "books"}, {"id": "b", "text": "two"}]
    (d / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [x["domain"] for x in read_path(d / "a.jsonl")] == ["books", "a"]
    assert [x["domain"] for x in read_path(d)] == ["books", "mixed"]
    assert [x["domain"] for x in read_path(d, domain="web")] == ["web", "web"]


def test_compressed_files_are_refused_not_read_as_text(tmp_path: Path) -> None:
    """A compressed or archived file other than JSON lines is refused by name (before: one document of
    undecodable bytes); ``*.jsonl.gz`` is read."""
    for name in ("c4.json.gz", "x.txt.zst", "t.parquet.gz", "docs.tar"):
        p = tmp_path / name
        p.write_bytes(gzip.compress(b"hello"))
        with pytest.raises(ValueError, match="is compressed or archived"):
            list(read_path(p))
    ok = tmp_path / "fine.jsonl.gz"
    ok.write_bytes(gzip.compress(b'{"text": "hi"}\n'))
    assert [x["text"] for x in read_path(ok)] == ["hi"]


def test_directory_default_ids_are_unique_and_text_beside_records_is_named(tmp_path: Path) -> None:
    """Records without ids in files of one directory keep their file's default prefix where it is unique;
    files that share one (``train/part-0`` and ``extra/part-0``, ``data.1`` and ``data.2``: all once
    ``part-0/1`` or ``data/1``) take their path there. Text files beside records are left out with a
    warning naming them; a README is not warned of."""
    d = tmp_path / "corpus"
    for rel in ("train/part-0.jsonl", "extra/part-0.jsonl", "data.1.jsonl", "data.2.jsonl", "solo.jsonl"):
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(json.dumps({"text": f"from {rel}"}) + "\n")
    (d / "README.md").write_text("# a dataset card")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ids = [x["id"] for x in read_path(d)]
    assert sorted(ids) == ["data.1/1", "data.2/1", "extra/part-0/1", "solo/1", "train/part-0/1"]
    assert [x["id"] for x in read_path(d / "data.1.jsonl")] == ["data/1"]  # a file alone: as before
    (d / "dataset_info.json").write_text("{}")  # metadata: no warning either
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(read_path(d))) == 5
    (d / "notes.txt").write_text("a note")
    (d / "more.json").write_text("[]")
    with pytest.warns(
        UserWarning, match=r"text files too \(more.json, notes.txt\): only the records are read"
    ):
        assert len(list(read_path(d))) == 5
    (d / "solo.jsonl.gz").write_bytes(gzip.compress(json.dumps({"text": "zipped"}).encode() + b"\n"))
    with pytest.warns(UserWarning):
        ids = [x["id"] for x in read_path(d)]
    assert len(ids) == len(set(ids)) and {"solo.jsonl/1", "solo.jsonl.gz/1"} <= set(ids)
