"""Training data for CEPE: bundled corpora, local formats, splits, tokenized shards, sequence builders.

Typical use::

    from cepe.data import SequenceMixture, TokenizedCorpus, prepare_data, split_for_cepe
    out = prepare_data(["austen", "acl", "stdlib"], "data/tok")          # shards + summary.json
    ds = SequenceMixture(TokenizedCorpus(out), "train", seq_length=8192, seed=0)
    window = ds[0]                                                       # (T,) int64
    enc_ids, dec_ids = split_for_cepe(window, n_decoder=4096, chunk_length=256, n_chunks=16)

Names are imported lazily so that ``cepe --help`` does not pay for torch.
"""

from __future__ import annotations

from cepe.lazy import lazy_getattr

_EXPORTS = {
    "BUNDLED": "corpora",
    "CorpusUnavailableError": "corpora",
    "acl_summaries": "corpora",
    "load_corpus": "corpora",
    "read_path": "formats",
    "read_hf_dataset": "formats",
    "SPLITS": "split",
    "SplitFractions": "split",
    "assign_split": "split",
    "ShardWriter": "tokenized",
    "TokenizedCorpus": "tokenized",
    "SequenceMixture": "sequences",
    "ResumableSampler": "sequences",
    "split_for_cepe": "sequences",
    "split_for_warmup": "sequences",
    "cepe_example": "sequences",
    "mask_encoder_chunks": "sequences",
    "mlm_example": "sequences",
    "prepare_data": "prepare",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)
