"""Deterministic document-level train / test / retrieval split."""

from __future__ import annotations

import pytest

from cepe.data.split import SPLITS, SplitFractions, assign_split, doc_hash, split_documents


def test_assignment_is_deterministic_and_order_free() -> None:
    ids = [f"doc-{i}" for i in range(2000)]
    first = {i: assign_split(i, seed=3) for i in ids}
    again = {i: assign_split(i, seed=3) for i in reversed(ids)}
    assert first == again
    assert set(first.values()) == set(SPLITS)


def test_fractions_are_respected_and_seed_reshuffles() -> None:
    ids = [f"doc-{i}" for i in range(20000)]
    fr = SplitFractions(test=0.1, retrieval=0.2)
    counts = {s: 0 for s in SPLITS}
    for i in ids:
        counts[assign_split(i, 0, fr)] += 1
    assert abs(counts["test"] / len(ids) - 0.1) < 0.015
    assert abs(counts["retrieval"] / len(ids) - 0.2) < 0.015
    other = sum(assign_split(i, 0, fr) != assign_split(i, 1, fr) for i in ids)
    assert other > 0.2 * len(ids)


def test_no_leakage_each_doc_in_exactly_one_split() -> None:
    docs = [{"id": f"d{i}", "text": "x"} for i in range(500)]
    pairs = list(split_documents(docs, seed=7))
    assert [d["id"] for _, d in pairs] == [d["id"] for d in docs]
    by_split: dict[str, set[str]] = {s: set() for s in SPLITS}
    for split, doc in pairs:
        by_split[split].add(doc["id"])
    assert sum(len(v) for v in by_split.values()) == len(docs)
    assert not (by_split["train"] & by_split["test"]) and not (by_split["train"] & by_split["retrieval"])


def test_edge_fractions() -> None:
    assert all(assign_split(f"d{i}", 0, SplitFractions(0.0, 0.0)) == "train" for i in range(100))
    assert all(assign_split(f"d{i}", 0, SplitFractions(1.0, 0.0)) == "test" for i in range(100))
    assert 0.0 <= doc_hash("a") < 1.0


@pytest.mark.parametrize(("test", "retrieval", "match"), [(-0.1, 0.0, "test"), (0.6, 0.6, "exceed 1")])
def test_bad_fractions(test: float, retrieval: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SplitFractions(test=test, retrieval=retrieval)


def test_bad_id() -> None:
    with pytest.raises(ValueError, match="non-empty string"):
        assign_split("")
