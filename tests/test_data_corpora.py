"""Bundled corpus loaders: a few documents of each load (Linux via a fake cached tree)."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest

from cepe.data import corpora
from cepe.data.corpora import CorpusUnavailableError, load_corpus


def _first(name: str, n: int = 3) -> list[dict]:
    return list(itertools.islice(load_corpus(name), n))


def _check(docs: list[dict], domain: str) -> None:
    assert docs
    for d in docs:
        assert isinstance(d["id"], str) and d["id"].startswith(domain + "/")
        assert isinstance(d["text"], str) and d["text"].strip() and d["domain"] == domain


def test_acl_papers_and_summaries() -> None:
    docs = _first("acl")
    _check(docs, "acl")
    assert len(docs[0]["text"]) > 5000 and docs[0]["title"]
    summaries = list(corpora.acl_summaries("test"))
    assert len(summaries) > 50 and {"challenge", "approach", "outcome", "paper_id"} <= set(summaries[0])
    assert all(s["split"] == "test" for s in summaries)
    with pytest.raises(ValueError, match="unknown aclsum split"):
        list(corpora.acl_summaries("dev"))


def test_bbc_news_has_labels() -> None:
    docs = list(corpora.bbc_news())
    assert len(docs) == 2225
    _check(docs[:3], "bbc")
    assert {d["label"] for d in docs} == set(corpora.BBC_LABELS)


def test_essays_and_stdlib() -> None:
    essays = list(corpora.essays())
    assert len(essays) == 49
    _check(essays[:3], "essays")
    code = _first("stdlib", 20)
    _check(code, "stdlib")
    assert not any("/test" in d["id"] or "site-packages" in d["id"] for d in code)


def test_linux_loaders_read_the_cached_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CEPE_CACHE", str(tmp_path))
    root = tmp_path / "corpora" / "linux-6.1"
    (root / "Documentation" / "mm").mkdir(parents=True)
    (root / "Documentation" / "mm" / "a.rst").write_text("Title\n=====\n")
    (root / "kernel").mkdir()
    (root / "kernel" / "fork.c").write_text("int x;\n")
    (root / "kernel" / "notes.txt").write_text("not c")
    (docs,) = list(load_corpus("linux-docs", download=False))
    assert docs["id"] == "linux-docs/Documentation/mm/a.rst"
    assert [d["path"] for d in load_corpus("linux-code", download=False)] == ["kernel/fork.c"]


def test_missing_debian_package_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CEPE_CACHE", str(tmp_path))
    with pytest.raises(CorpusUnavailableError, match="download=True"):
        list(load_corpus("austen", download=False))
    monkeypatch.setattr(shutil, "which", lambda _: None)
    with pytest.raises(CorpusUnavailableError, match="apt-get, dpkg-deb not found"):
        list(load_corpus("linux-docs"))
    with pytest.raises(ValueError, match="unknown corpus 'x'"):
        load_corpus("x")


def test_austen_novels() -> None:
    try:
        docs = list(corpora.austen())
    except CorpusUnavailableError as err:
        pytest.skip(f"Austen needs `apt-get download r-cran-janeaustenr` (network): {err}")
    assert len(docs) == 6
    _check(docs, "austen")
    assert any(d["title"] == "Emma" and "Emma Woodhouse" in d["text"] for d in docs)
