"""Readers and builders: compressed JSON lines named in capitals, a negative dataset length."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from cepe.data.formats import read_path
from cepe.data.sequences import SequenceMixture
from cepe.data.tokenized import ShardWriter


def test_jsonl_gz_is_read_whatever_the_case_of_its_name(tmp_path: Path) -> None:
    """read_path takes ``*.JSONL.GZ`` for compressed JSON lines (it compares names case-blind); the
    reader then opened it as plain text and failed with a bare UnicodeDecodeError."""
    p = tmp_path / "DATA.JSONL.GZ"
    with gzip.open(p, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"text": "hello"}) + "\n")
    (doc,) = list(read_path(p))
    assert doc["text"] == "hello" and doc["id"] == "DATA/1"
    d = tmp_path / "dir"
    d.mkdir()
    p.rename(d / "part.Jsonl.Gz")  # a directory's record files go through the same reader
    assert [x["text"] for x in read_path(d)] == ["hello"]


def test_negative_num_examples_is_refused_with_what_to_give(tmp_path: Path) -> None:
    with ShardWriter(tmp_path / "tok", eos_id=0, vocab_size=100) as w:
        w.add("train", "d0", "dom", list(range(1, 40)))
    with pytest.raises(ValueError, match="num_examples .* must be 0 or more, got -1"):
        SequenceMixture(tmp_path / "tok", seq_length=8, ratio=(0, 1), num_examples=-1)
    assert len(SequenceMixture(tmp_path / "tok", seq_length=8, ratio=(0, 1), num_examples=0)) == 0
