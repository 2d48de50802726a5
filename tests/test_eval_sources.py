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
