"""Training data for CEPE: bundled corpora, local formats, splits, tokenized shards, sequence builders.

Typical use::

    from cepe.data import prepare_data, TokenizedCorpus, SequenceMixture, split_for_cepe
    out = prepare_data(["austen", "acl", "stdlib"], "data/tok")          # shards + summary.json
    ds = SequenceMixture(TokenizedCorpus(out), "train", seq_length=8192, seed=0)
    window = ds[0]                                                       # (T,) int64
    enc_ids, dec_ids = split_for_cepe(window, n_decoder=4096, chunk_length=256, n_chunks=16)
"""

from __future__ import annotations

from cepe.data.corpora import BUNDLED, CorpusUnavailableError, acl_summaries, load_corpus
from cepe.data.split import SPLITS, SplitFractions, assign_split
from cepe.data.tokenized import ShardWriter, TokenizedCorpus

__all__ = [
    "BUNDLED",
    "SPLITS",
    "CorpusUnavailableError",
    "ShardWriter",
    "SplitFractions",
    "TokenizedCorpus",
    "acl_summaries",
    "assign_split",
    "load_corpus",
]
