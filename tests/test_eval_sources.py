"""Held-out document sources: the eval split filter agrees with the training data split."""

from __future__ import annotations

import json

import pytest

from cepe.data.split import SplitFractions, assign_split
from cepe.eval.common import iter_source


def test_split_filter_matches_training_split(tmp_path):
    docs = [{"id": f"d{i}", "text": f"text {i}"} for i in range(200)]
    (tmp_path / "summary.json").write_text(
        json.dumps({"seed": 3, "fractions": {"train": 0.7, "test": 0.2, "retrieval": 0.1}})
    )
    got = {d["id"] for d in iter_source({"documents": docs, "split": "test", "split_from": str(tmp_path)})}
    want = {
        d["id"] for d in docs if assign_split(d["id"], 3, SplitFractions(test=0.2, retrieval=0.1)) == "test"
    }
    assert got == want and 0 < len(got) < 200
    explicit = {
        d["id"]
        for d in iter_source(
            {
                "documents": docs,
                "split": "test",
                "split_seed": 3,
                "test_fraction": 0.2,
                "retrieval_fraction": 0.1,
            }
        )
    }
    assert explicit == want
    with pytest.raises(ValueError, match="split must be one of"):
        list(iter_source({"documents": docs, "split": "dev"}))
    with pytest.raises(FileNotFoundError, match="prepare-data"):
        list(iter_source({"documents": docs, "split": "test", "split_from": str(tmp_path / "none")}))


def test_several_non_overlapping_windows_per_document():
    from cepe.eval.tasks.lm import sample_sequences

    docs = [list(range(100)), list(range(1000, 1030)), list(range(2000, 2500))]
    one = sample_sequences(docs, 50, 10, seed=0)
    assert len(one) == 2 and all(len(w) == 50 for w in one)  # one per long-enough document
    many = sample_sequences(docs, 50, 10, seed=0, per_document=3)
    assert len(many) == 5 and all(len(w) == 50 for w in many)
    starts = sorted(w[0] for w in many if w[0] >= 2000)
    assert len(starts) == 3 and all(b - a >= 50 for a, b in zip(starts, starts[1:]))
    assert sample_sequences(docs, 50, 10, seed=0, per_document=3) == many  # deterministic


def test_corpus_sources_download_only_when_asked(monkeypatch):
    import yaml

    import cepe.data.corpora as corpora

    asked = []

    def fake_load(name, download=True):
        asked.append((name, download))
        return iter([{"id": "a", "text": "x"}])

    monkeypatch.setattr(corpora, "load_corpus", fake_load)
    list(iter_source({"corpus": "linux-docs"}))
    list(iter_source({"corpus": "linux-docs", "download": True}))
    assert asked == [("linux-docs", False), ("linux-docs", True)]
    # the kernel curve is computed on a fresh machine: its package is fetched, not an error
    from pathlib import Path

    with open(Path(__file__).parents[1] / "configs/eval/fixedppl_val_short_kernel.yaml") as f:
        sources = yaml.safe_load(f)["sources"]
    assert sources and all(s.get("download") is True for s in sources)


@pytest.mark.parametrize("split", ["test", "retrieval"])
def test_held_out_split_drops_copies_of_training_documents(split):
    """A text under two ids, one drawn into training and one held out, is not held out (whitespace aside);
    the training split keeps every document it draws."""
    fr = SplitFractions(test=0.3, retrieval=0.3)
    ids = [f"d{i}" for i in range(60)]
    sides = {i: assign_split(i, 0, fr) for i in ids}
    trained = next(i for i in ids if sides[i] == "train")
    copy = next(i for i in ids if sides[i] == split)
    docs = [{"id": i, "text": f"text {i}"} for i in ids]
    docs[ids.index(copy)]["text"] = f"  text\n\n {trained}\t"  # the trained text laid out otherwise
    assert " ".join(docs[ids.index(copy)]["text"].split()) == f"text {trained}"
    spec = {"documents": docs, "split_seed": 0, "test_fraction": 0.3, "retrieval_fraction": 0.3}
    got = [d["id"] for d in iter_source({**spec, "split": split})]
    assert got == [i for i in ids if sides[i] == split and i != copy]
    assert [d["id"] for d in iter_source({**spec, "split": "train"})] == [
        i for i in ids if sides[i] == "train"
    ]


def test_a_decoder_directory_without_tokenizer_files_takes_the_tokenizer_given(tmp_path):
    """``--tokenizer`` is what a plain decoder directory without tokenizer files needs; its own tokenizer
    was loaded first and failed before the one given was read."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from cepe.eval.api import load_setup
    from cepe.tiny import tiny_decoder

    tiny_decoder().save_pretrained(tmp_path / "decoder")  # weights and config only
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    setup = load_setup(str(tmp_path / "decoder"), ["truncated"], tokenizer=str(tmp_path / "tok"))
    assert setup.encode("a b a") == [1, 2, 1]
