"""Filter / cat sequence builders, their mixture, resumable iteration, example layouts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from cepe.data.sequences import (
    ResumableSampler,
    SequenceMixture,
    cepe_example,
    mask_encoder_chunks,
    mlm_example,
    split_for_cepe,
    split_for_warmup,
)
from cepe.data.tokenized import ShardWriter, TokenizedCorpus

EOS = 0
VOCAB = 1 << 20
LENGTHS = [40, 5, 100, 17, 64, 3, 250, 31]  # tokens per document


def _tok(doc: int, pos: int) -> int:
    return 1 + doc * 1000 + pos  # encodes (document, position); never EOS


@pytest.fixture()
def corpus(tmp_path: Path) -> TokenizedCorpus:
    with ShardWriter(tmp_path / "tok", eos_id=EOS, vocab_size=VOCAB, shard_tokens=64) as w:
        for d, n in enumerate(LENGTHS):
            w.add("train", f"doc{d}", "long" if d % 2 == 0 else "short", [_tok(d, p) for p in range(n)])
    return TokenizedCorpus(tmp_path / "tok")


def _stream() -> list[int]:
    return [t for d, n in enumerate(LENGTHS) for t in [*(_tok(d, p) for p in range(n)), EOS]]


def test_filter_windows_stay_inside_one_long_document(corpus: TokenizedCorpus) -> None:
    T = 32
    ds = SequenceMixture(corpus, seq_length=T, ratio=(1, 0), seed=1, num_examples=200)
    seen_docs = set()
    for i in range(200):
        w = ds[i]
        assert w.shape == (T,) and w.dtype == torch.long
        doc, pos = divmod(int(w[0]) - 1, 1000)
        assert LENGTHS[doc] >= T
        assert w.tolist() == [_tok(doc, pos + k) for k in range(T)]
        info = ds.describe(i)
        assert info["source"] == "filter" and info["doc_id"] == f"doc{doc}" and info["start"] == pos
        seen_docs.add(doc)
    assert seen_docs == {d for d, n in enumerate(LENGTHS) if n >= T}
    only_short = SequenceMixture(corpus, seq_length=30, ratio=(1, 0), filter_domains=["short"])
    assert {only_short.describe(i)["doc_id"] for i in range(30)} == {"doc7"}


def test_cat_windows_cover_the_eos_joined_stream(corpus: TokenizedCorpus) -> None:
    T = 50
    stream = _stream()
    ds = SequenceMixture(corpus, seq_length=T, ratio=(0, 1), seed=0)
    n = len(stream) // T
    assert len(ds) == n
    starts = []
    for i in range(n):
        w = ds[i].tolist()
        start = ds.describe(i)["start"]
        assert w == stream[start : start + T]
        starts.append(start)
    offset = min(starts)
    assert sorted(starts) == [offset + k * T for k in range(n)]  # one epoch = every window once
    assert EOS in ds[0].tolist() or EOS in ds[1].tolist()


def test_mixture_ratio_and_determinism(corpus: TokenizedCorpus) -> None:
    ds = SequenceMixture(corpus, seq_length=16, ratio=(2, 1), seed=5)
    kinds = [ds.source(i)[0] for i in range(300)]
    assert kinds.count("filter") == 200 and kinds.count("cat") == 100
    for b in range(100):  # every block of 3 holds 2 filter + 1 cat
        assert kinds[3 * b : 3 * b + 3].count("cat") == 1
    assert kinds[:30] != ["filter", "filter", "cat"] * 10  # order shuffled within blocks
    # builder indices are a bijection onto 0, 1, 2, ...
    f_idx = sorted(ds.source(i)[1] for i in range(300) if kinds[i] == "filter")
    assert f_idx == list(range(200))
    same = SequenceMixture(corpus, seq_length=16, ratio=(2, 1), seed=5)
    other = SequenceMixture(corpus, seq_length=16, ratio=(2, 1), seed=6)
    assert all(torch.equal(ds[i], same[i]) for i in range(50))
    assert any(not torch.equal(ds[i], other[i]) for i in range(50))
    # random access equals sequential access (pure function of (seed, i))
    assert torch.equal(ds[77], list(ds.iter_windows(70, 80))[7])


def test_resumable_sampler_reproduces_the_run(corpus: TokenizedCorpus) -> None:
    ds = SequenceMixture(corpus, seq_length=16, seed=2, num_examples=24)
    full = [b for b in DataLoader(ds, batch_size=4, sampler=ResumableSampler(num_examples=24))]
    sampler = ResumableSampler(num_examples=24)
    first = []
    for b in DataLoader(ds, batch_size=4, sampler=sampler):
        first.append(b)
        if len(first) == 2:
            break
    state = {"position": 2 * 4}  # examples consumed by the loop
    resumed = ResumableSampler(num_examples=24)
    resumed.load_state_dict(state)
    rest = [b for b in DataLoader(ds, batch_size=4, sampler=resumed)]
    assert all(torch.equal(a, b) for a, b in zip(full, first + rest, strict=True))
    assert resumed.state_dict() == {"position": 24}
    # two ranks see disjoint indices that together cover 0..
    r0 = list(ResumableSampler(5, rank=0, world_size=2))
    r1 = list(ResumableSampler(5, rank=1, world_size=2))
    assert sorted(r0 + r1) == list(range(10))
    with pytest.raises(ValueError, match="rank"):
        ResumableSampler(rank=2, world_size=2)


def test_mixture_errors(corpus: TokenizedCorpus) -> None:
    with pytest.raises(ValueError, match="no document of split 'train' has at least 1000 tokens"):
        SequenceMixture(corpus, seq_length=1000, ratio=(2, 1))
    with pytest.raises(ValueError, match="fewer than one window"):
        SequenceMixture(corpus, seq_length=10_000, ratio=(0, 1))
    with pytest.raises(ValueError, match="ratio"):
        SequenceMixture(corpus, seq_length=8, ratio=(0, 0))
    with pytest.raises(ValueError, match="ratio"):
        SequenceMixture(corpus, seq_length=8, ratio=(1.5, 1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seq_length"):
        SequenceMixture(corpus, seq_length=0)


def test_split_for_cepe_layout() -> None:
    w = torch.arange(4 * 3 + 5)
    enc, dec = split_for_cepe(w, n_decoder=5, chunk_length=3, n_chunks=4)
    assert enc.shape == (4, 3) and dec.shape == (5,)
    assert enc.flatten().tolist() == list(range(12)) and dec.tolist() == list(range(12, 17))
    benc, bdec = split_for_cepe(torch.stack([w, w + 100]), 5, 3, 4)
    assert benc.shape == (2, 4, 3) and bdec.shape == (2, 5) and benc[1, 0, 0] == 100
    ex = cepe_example(np.arange(17), 5, 3, 4)
    assert ex["encoder_attention_mask"].all() and torch.equal(ex["labels"], ex["input_ids"])
    with pytest.raises(ValueError, match=r"4\*3 \+ 6 = 18"):
        split_for_cepe(w, n_decoder=6, chunk_length=3, n_chunks=4)


def test_split_for_warmup_layout() -> None:
    enc, dec = split_for_warmup(torch.arange(300), n=256, k=4)
    assert enc.shape == (4, 64) and dec.shape == (256,)
    assert torch.equal(enc.flatten(), dec) and dec.tolist() == list(range(256))
    benc, bdec = split_for_warmup(torch.zeros(3, 8, dtype=torch.long), n=8, k=2)
    assert benc.shape == (3, 2, 4) and bdec.shape == (3, 8)
    with pytest.raises(ValueError, match="multiple of k"):
        split_for_warmup(torch.arange(10), n=10, k=3)
    with pytest.raises(ValueError, match="warmup needs n=256"):
        split_for_warmup(torch.arange(10))


def test_encoder_noise_and_mlm() -> None:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2000, 8, dtype=torch.bool)
    noisy = mask_encoder_chunks(mask, generator=g)
    assert mask.all()  # input untouched
    kept = noisy.sum(-1)
    assert 0.25 < (kept < 8).float().mean() < 0.35
    assert (kept == 0).any()
    rows = noisy.long()
    assert torch.all(rows[:, :-1] >= rows[:, 1:])  # only suffixes are removed
    ids = torch.arange(2, 5002)
    ids[::10] = 1
    inp, labels = mlm_example(ids, mask_token_id=0, generator=g, special_ids=[1])
    chosen = labels != -100
    assert (
        0.25 < chosen.float().mean() < 0.3 and (inp[chosen] == 0).all() and (labels[ids == 1] == -100).all()
    )
    assert torch.equal(inp[~chosen], ids[~chosen])
