"""Token shards: round trip, streaming across shards, atomic writes, errors."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from cepe.data.tokenized import ShardWriter, TokenizedCorpus, token_dtype

EOS = 7


def _write(
    tmp_path: Path, docs: dict[str, list[list[int]]], shard_tokens: int = 10, vocab: int = 100
) -> Path:
    with ShardWriter(tmp_path / "tok", eos_id=EOS, vocab_size=vocab, shard_tokens=shard_tokens) as w:
        for split, items in docs.items():
            for i, toks in enumerate(items):
                w.add(split, f"{split}-{i}", "dom" if i % 2 else "other", toks)
    return tmp_path / "tok"


def test_round_trip_multiple_shards(tmp_path: Path) -> None:
    train = [list(range(10, 10 + n)) for n in (3, 12, 1, 0, 5, 8)]
    out = _write(tmp_path, {"train": train, "test": [[1, 2]]}, shard_tokens=10)
    c = TokenizedCorpus(out)
    assert c.splits == ("test", "train") and c.eos_id == EOS and c.dtype == np.uint16
    t = c.documents("train")
    assert len(t) == 6 and t.ids[1] == "train-1" and t.domains[1] == "dom"
    assert len(c.shard_sizes("train")) > 1
    for i, toks in enumerate(train):
        assert c.doc_tokens("train", i).tolist() == toks
    assert c.num_tokens("train") == sum(map(len, train))
    stream = [tok for toks in train for tok in [*toks, EOS]]
    assert c.stream_length("train") == len(stream)
    assert c.stream_slice("train", 0, len(stream)).tolist() == stream
    assert c.stream_slice("train", 2, 9).tolist() == stream[2:11]  # crosses a shard boundary
    assert c.stream_slice("train", 2, 9).dtype == np.int64
    assert [d for d, _, _ in c.iter_documents("test")] == ["test-0"]
    # no temporary files remain; index names every shard
    names = {p.name for p in out.iterdir()}
    assert not any(n.startswith(".") for n in names)
    index = json.loads((out / "index.json").read_text())
    assert {s["file"] for s in index["splits"]["train"]["shards"]} <= names
    # picklable without its memory maps
    again = pickle.loads(pickle.dumps(c))
    assert again.doc_tokens("train", 1).tolist() == train[1]


def test_dtype_choice() -> None:
    assert token_dtype(49152) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
    with pytest.raises(ValueError):
        token_dtype(0)


def test_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no index.json"):
        TokenizedCorpus(tmp_path)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ShardWriter(tmp_path / "x", eos_id=100, vocab_size=100)
    w = ShardWriter(tmp_path / "y", eos_id=1, vocab_size=100)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 100\)"):
        w.add("train", "d", "dom", [5, 100])
    with pytest.raises(ValueError, match="split name"):
        w.add("../evil", "d", "dom", [5])
    c = TokenizedCorpus(_write(tmp_path, {"train": [[1, 2, 3]]}))
    with pytest.raises(ValueError, match="split 'test' not in"):
        c.documents("test")
    with pytest.raises(ValueError, match="outside"):
        c.stream_slice("train", 2, 5)
