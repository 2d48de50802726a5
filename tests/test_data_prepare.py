"""prepare_data and `cepe prepare-data` on tiny local corpora with a tiny in-test tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cepe.data.prepare import prepare_data
from cepe.data.sequences import SequenceMixture
from cepe.data.tokenized import TokenizedCorpus

WORDS = [f"w{i}" for i in range(50)]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="[UNK]")


def _text(n: int, start: int = 0) -> str:
    return " ".join(WORDS[(start + k) % len(WORDS)] for k in range(n))


@pytest.fixture()
def sources(tmp_path: Path) -> list[str]:
    jl = tmp_path / "web.jsonl"
    rows = [{"id": f"web{i}", "text": _text(10 + 37 * i, i)} for i in range(40)]
    rows.append({"id": "dup", "text": rows[0]["text"]})  # an exact copy: skipped
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    books = tmp_path / "books"
    books.mkdir()
    for i in range(5):
        (books / f"b{i}.txt").write_text(_text(5000 + 100 * i, i), encoding="utf-8")
    return [str(jl), str(books)]


def test_prepare_data_end_to_end(tmp_path: Path, sources: list[str]) -> None:
    out = prepare_data(
        sources, tmp_path / "out", tokenizer=_tokenizer(), seed=1, shard_tokens=4000, progress=False
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_duplicates"] == 1
    total_docs = sum(s["docs"] for s in summary["splits"].values())
    assert total_docs == 45
    assert summary["domains"]["books"]["train"]["docs_ge_4096"] >= 1
    c = TokenizedCorpus(out)
    assert c.eos_id == 1 and len(c.shard_sizes("train")) > 1
    t = c.documents("train")
    ids_by_split = {s: set(c.documents(s).ids) for s in c.splits}
    assert sum(len(v) for v in ids_by_split.values()) == len(set().union(*ids_by_split.values()))
    (where,) = [s for s in c.splits if "books/b0.txt" in ids_by_split[s]]
    k = c.documents(where).ids.index("books/b0.txt")
    assert c.doc_tokens(where, k)[:3].tolist() == [2, 3, 4] and len(c.doc_tokens(where, k)) == 5000
    assert sum(summary["splits"][s]["tokens"] for s in c.splits) == sum(c.num_tokens(s) for s in c.splits)
    ds = SequenceMixture(c, "train", seq_length=512, seed=0)
    assert ds[0].shape == (512,)
    # same inputs + seed -> identical output; rebuilding replaces the directory
    again = prepare_data(sources, tmp_path / "out", tokenizer=_tokenizer(), seed=1, progress=False)
    assert TokenizedCorpus(again).documents("train").ids == t.ids
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_prepare_data_errors(tmp_path: Path, sources: list[str]) -> None:
    tok = _tokenizer()
    with pytest.raises(ValueError, match="unknown corpus 'nope'"):
        prepare_data(["nope"], tmp_path / "o", tokenizer=tok)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty and holds no cepe index.json"):
        prepare_data(sources, foreign, tokenizer=tok)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": "a", "text": "w1"}\n{"id": "a", "text": "w2"}\n')
    with pytest.raises(ValueError, match="duplicate document id 'a'"):
        prepare_data([str(dup)], tmp_path / "o", tokenizer=tok, progress=False)
    assert not (tmp_path / "o").exists()  # nothing half-written
    with pytest.raises(ValueError, match="exceed 1"):
        prepare_data(sources, tmp_path / "o", tokenizer=tok, test_fraction=0.7, retrieval_fraction=0.5)


def test_cli_prepare_data(tmp_path: Path, sources: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from cepe.cli import main

    tok_dir = tmp_path / "tok"
    _tokenizer().save_pretrained(tok_dir)
    out = tmp_path / "cli-out"
    code = main(
        [
            "prepare-data",
            *sources,
            "--out",
            str(out),
            "--tokenizer",
            str(tok_dir),
            "--max-docs",
            "3",
            "--quiet",
        ]
    )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert sum(s["docs"] for s in summary["splits"].values()) == 6 and summary["max_docs"] == 3
    assert "wrote" in capsys.readouterr().out
    assert main(["prepare-data", "--corpora", "nope", "--out", str(out), "--quiet"]) == 2
    assert "unknown corpus 'nope'" in capsys.readouterr().err
