"""Training pieces checked against the released code's definitions, by hand computation on values:
the CEPED KL forms on a vocabulary larger than k, its -100 mask, the teacher's logits (soft-capping
included) and its row/position alignment with the student, chunk noise 1..L-1, MLM special tokens."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import tiny_decoder

from cepe.training.config import load_config
from cepe.training.data import build_example, chunk_noise_mask, collate, window_source
from cepe.training.losses import topk_kl

TINY = Path(__file__).resolve().parents[1] / "configs" / "train" / "tiny"

# student: V = 6 > k = 2; q = softmax(log [1, 2, 3, 4, 5, 5]) = [.05, .10, .15, .20, .25, .25]
LOGITS = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 5.0]]))
PROBS = torch.tensor([[0.5, 0.3]])  # teacher top-2 (sums to 0.8: the rest lies outside the top-k)
IDX = torch.tensor([[4, 3]])


def test_kl_drop_is_the_default_and_hand_computed():
    want = 0.5 * math.log(0.5 / 0.25) + 0.3 * math.log(0.3 / 0.20)  # neither side renormalised
    assert topk_kl(LOGITS, PROBS, IDX).item() == pytest.approx(want, rel=1e-5)
    assert topk_kl(LOGITS, PROBS, IDX, "drop").item() == pytest.approx(want, rel=1e-5)


def test_kl_renorm_hand_computed():
    p = [0.5 / 0.8, 0.3 / 0.8]
    q = [0.25 / 0.45, 0.20 / 0.45]  # student renormalised over the teacher's two ids
    want = sum(a * math.log(a / b) for a, b in zip(p, q))
    assert topk_kl(LOGITS, PROBS, IDX, "renorm").item() == pytest.approx(want, rel=1e-5)


def test_kl_other_bucket_hand_computed():
    eps = 0.01
    p = [(1 - eps) * x + eps / 3 for x in (0.5, 0.3, 0.2)]
    q = [0.25, 0.20, 0.55]
    want = sum(a * math.log(a / b) for a, b in zip(p, q))
    got = topk_kl(LOGITS, PROBS, IDX, "other", smoothing=eps)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(want, rel=1e-5)


def test_drop_charges_mass_moved_off_the_top_k_and_renorm_does_not():
    # the student keeps the teacher's ratio on {4, 3} but moves mass to token 0
    base = torch.log(torch.tensor([[1.0, 1.0, 1.0, 1.0, 5.0 / 3, 1.0]]))
    moved = base.clone()
    moved[0, 0] += 3.0
    probs = torch.tensor([[0.5, 0.3]])
    idx = torch.tensor([[4, 0 + 3]])
    assert topk_kl(moved, probs, idx, "renorm").item() == pytest.approx(
        topk_kl(base, probs, idx, "renorm").item(), abs=1e-6
    )
    assert topk_kl(moved, probs, idx, "drop").item() > topk_kl(base, probs, idx, "drop").item() + 0.1


def test_kl_is_masked_where_labels_are_ignored():
    logits = torch.cat([LOGITS, torch.randn(1, 6)]).requires_grad_()
    probs, idx = torch.cat([PROBS, PROBS]), torch.cat([IDX, IDX])
    first = topk_kl(LOGITS, PROBS, IDX).item()
    masked = topk_kl(logits, probs, idx, mask=torch.tensor([True, False]))
    assert masked.item() == pytest.approx(first, rel=1e-6)
    none = topk_kl(logits, probs, idx, mask=torch.tensor([False, False]))
    assert none.item() == 0.0
    none.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    with pytest.raises(ValueError, match="form must be one of"):
        topk_kl(LOGITS, PROBS, IDX, "bogus")


def test_kl_is_fp32_and_zero_for_the_teacher_itself():
    torch.manual_seed(0)
    logits = torch.randn(5, 50).to(torch.bfloat16)
    p = torch.softmax(logits.float(), -1)
    vals, idx = p.topk(10, -1)  # k = 10 of V = 50
    for form in ("drop", "renorm"):
        kl = topk_kl(logits, vals, idx, form)
        assert kl.dtype == torch.float32 and kl.item() == pytest.approx(0.0, abs=1e-6)
    other = torch.randn(5, 50)
    assert topk_kl(other, vals, idx, "drop").item() > 0.1


def test_shipped_ceped_configs_train_the_released_loss():
    for tier in ("tiny", "mini", "paper"):
        cfg = load_config(TINY.parent / tier / "ceped.yaml")
        assert (cfg.kl_form, cfg.kl_coef, cfg.ce_coef) == ("drop", 2.0, 1.0), tier
    assert (
        load_config({"stage": "cepe", "output_dir": "x", "data": {"synthetic": "random"}}).kl_form == "drop"
    )


# ----------------------------------------------------------------------------- the teacher
def _ceped_cfg(tmp_path, **over):
    items = [
        f"output_dir={tmp_path / 'd'}",
        f"teacher_dir={tmp_path / 't'}",
        "progress=false",
        "num_threads=1",
        "init_adapter=null",
        "steps=1",
        "batch_size=4",
        "micro_batch_size=2",
        "teacher_examples_per_shard=4",
    ] + [f"{k}={v}" for k, v in over.items()]
    return load_config(TINY / "ceped.yaml", items)


def test_teacher_rows_are_the_decoders_own_capped_next_token_distributions(tmp_path, monkeypatch):
    """Row t of an example is the teacher's distribution of decoder token t+1, read after concat(C, X)
    up to that token, with the decoder's own logits (Gemma 2 final soft-capping included)."""
    from cepe.training import models
    from cepe.training.teacher import TeacherStore, run_teacher

    cfg = _ceped_cfg(tmp_path)
    v = int(cfg.tiny_decoder["vocab_size"])
    teacher = tiny_decoder("gemma2", vocab_size=v, final_logit_softcapping=0.5)
    monkeypatch.setattr(models, "build_decoder", lambda c, name=None: teacher)
    run_teacher(cfg, num_examples=4, progress=False)
    store = TeacherStore(cfg)
    source = window_source(cfg, v)
    m = cfg.n_chunks * cfg.chunk_length
    for i in (0, 3):
        probs, idx = store.get(i)
        window = source[i]
        for t in (0, 7, cfg.n_decoder - 2):
            with torch.no_grad():
                ref = torch.softmax(teacher(window[None, : m + t + 1]).logits[0, -1].float(), -1)
            want_p = ref.topk(cfg.top_k).values
            torch.testing.assert_close(probs[t].float(), ref[idx[t]], rtol=2e-3, atol=1e-4)  # ids and values
            torch.testing.assert_close(probs[t].float(), want_p, rtol=2e-3, atol=1e-4)


def test_student_loss_aligns_with_teacher_rows(tmp_path):
    """StageModule's CEPED loss equals CE + 2·KL written out by hand from the student's full logits:
    student position t (predicting token t+1) meets teacher row t, and -100 labels drop both terms."""
    from cepe.training.models import StageModule, build_model
    from cepe.training.teacher import TeacherStore, run_teacher

    cfg = _ceped_cfg(tmp_path)
    run_teacher(cfg, num_examples=4, progress=False)
    store = TeacherStore(cfg)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for m in model.cross_attention_modules():
            m.o_proj.weight.normal_(0, 0.2)  # the context must matter
    source = window_source(cfg, int(cfg.tiny_decoder["vocab_size"]))
    examples = []
    for i in range(2):
        ex = build_example(cfg, source[i], i, None)
        ex["teacher_probs"], ex["teacher_indices"] = store.get(i)
        examples.append(ex)
    batch = collate(examples)
    batch.pop("index")
    batch["labels"][0, :5] = -100
    stage = StageModule(model, cfg)
    with torch.no_grad():
        loss, metrics = stage(batch)
    stage.release()
    with torch.no_grad():
        logits = model(
            batch["input_ids"],
            encoder_input_ids=batch["encoder_input_ids"],
            encoder_attention_mask=batch["encoder_attention_mask"],
        ).logits.float()
    logq = torch.log_softmax(logits, -1)
    ce_terms, kl_terms = [], []
    for b in range(2):
        for t in range(cfg.n_decoder - 1):
            label = int(batch["labels"][b, t + 1])
            if label == -100:
                continue
            ce_terms.append(-logq[b, t, label])
            p = batch["teacher_probs"][b, t].float()
            ids = batch["teacher_indices"][b, t]
            kl_terms.append((p * (p.clamp_min(1e-30).log() - logq[b, t, ids])).sum())
    ce, kl = torch.stack(ce_terms).mean(), torch.stack(kl_terms).mean()
    assert metrics["kl"].item() == pytest.approx(kl.item(), rel=1e-4)
    assert metrics["ce"].item() == pytest.approx(ce.item(), rel=1e-4)
    assert loss.item() == pytest.approx(ce.item() + 2.0 * kl.item(), rel=1e-4)


# ----------------------------------------------------------------------------- noise and MLM
def test_chunk_noise_removes_one_to_l_minus_one_tokens():
    k, length, n = 16, 8, 3000
    g = torch.Generator().manual_seed(0)
    noisy = chunk_noise_mask(torch.ones(n, k, length, dtype=torch.bool), 0.3, 0.0, g)
    kept = noisy.sum(-1).flatten()
    assert int(kept.min()) == 1  # with no whole-chunk removal, a chunk is never emptied
    dropped = length - kept[kept < length]
    counts = torch.bincount(dropped, minlength=length)
    assert (counts[1:length] > 0).all()  # every suffix length 1..L-1 occurs
    # a one-token chunk is only emptied by whole-chunk removal
    one = torch.zeros(n, 1, length, dtype=torch.bool)
    one[..., 0] = True
    assert chunk_noise_mask(one, 1.0, 0.0, g).sum() == n
    assert chunk_noise_mask(one, 1.0, 1.0, g).sum() == 0


def test_mlm_never_masks_special_tokens(tmp_path):
    from cepe.training.data import special_token_ids

    cfg = load_config(TINY / "mlm.yaml", [f"output_dir={tmp_path}", "mask_rate=0.9"])
    specials = special_token_ids(cfg)
    assert specials == (1, 2)  # the tiny Llama decoder's BOS and EOS
    window = torch.tensor([1, 2] * 32)
    for i in range(5):
        ex = build_example(cfg, window, i, 128)
        assert torch.equal(ex["input_ids"], window) and (ex["labels"] == -100).all()
    ex = build_example(cfg, torch.arange(3, 67), 0, 128)
    assert (ex["input_ids"] == 128).float().mean() > 0.7  # other tokens are masked at the rate
    assert torch.equal(ex["labels"] != -100, ex["input_ids"] == 128)


def test_mlm_special_tokens_of_a_real_decoder_config(tmp_path):
    from transformers import LlamaConfig

    from cepe.training.data import special_token_ids

    d = tmp_path / "dec"
    LlamaConfig(vocab_size=50, bos_token_id=7, eos_token_id=[8, 9], pad_token_id=3).save_pretrained(d)
    cfg = load_config(TINY / "mlm.yaml", [f"output_dir={tmp_path}", f"decoder={d}", "tiny_decoder=null"])
    assert special_token_ids(cfg) == (3, 7, 8, 9)
    ex = build_example(cfg, torch.tensor([3, 7, 8, 9] * 16), 0, 50)
    assert (ex["labels"] == -100).all()
