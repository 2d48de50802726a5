"""Deterministic document-level split into ``train`` / ``test`` / ``retrieval`` (paper §2.2).

A document's split is a pure function of ``(seed, document id)``: a 64-bit BLAKE2b hash mapped to
``[0, 1)`` and compared with the cumulative fractions. Every document lands in exactly one split, the
assignment does not depend on corpus order or size, and adding documents never moves existing ones.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

SPLITS = ("train", "test", "retrieval")
"""The split names, in the order their hash intervals are laid out."""


@dataclass(frozen=True)
class SplitFractions:
    """Fractions of documents per split; ``train`` is what the other two leave.

    Raises:
        ValueError: a fraction is negative or ``test + retrieval > 1``.
    """

    test: float = 0.05
    retrieval: float = 0.05

    def __post_init__(self) -> None:
        for name in ("test", "retrieval"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} fraction must be in [0, 1], got {value}")
        if self.test + self.retrieval > 1.0 + 1e-12:
            raise ValueError(
                f"test ({self.test}) + retrieval ({self.retrieval}) fractions exceed 1; nothing would be left"
            )

    @property
    def train(self) -> float:
        """Fraction of training documents."""
        return max(0.0, 1.0 - self.test - self.retrieval)

    def as_dict(self) -> dict[str, float]:
        """``{"train": .., "test": .., "retrieval": ..}``."""
        return {"train": round(self.train, 12), "test": self.test, "retrieval": self.retrieval}


def doc_hash(doc_id: str, seed: int = 0) -> float:
    """Uniform number in ``[0, 1)`` from ``(seed, doc_id)``, stable across processes and machines."""
    if not isinstance(doc_id, str) or not doc_id:
        raise ValueError(f"document id must be a non-empty string, got {doc_id!r}")
    digest = hashlib.blake2b(f"{int(seed)}\x00{doc_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def assign_split(doc_id: str, seed: int = 0, fractions: SplitFractions | None = None) -> str:
    """Split of one document: ``"train"``, ``"test"`` or ``"retrieval"``.

    Args:
        doc_id: the document's unique id.
        seed: changing it reshuffles the assignment.
        fractions: target fractions (default 90 / 5 / 5 %).
    """
    fr = fractions or SplitFractions()
    u = doc_hash(doc_id, seed)
    if u < fr.train:
        return "train"
    if u < fr.train + fr.test:
        return "test"
    return "retrieval"


def split_documents(
    docs: Iterable[dict], seed: int = 0, fractions: SplitFractions | None = None
) -> Iterator[tuple[str, dict]]:
    """Yield ``(split, doc)`` for each document (keeps the input order; streams)."""
    fr = fractions or SplitFractions()
    for doc in docs:
        yield assign_split(doc["id"], seed, fr), doc
