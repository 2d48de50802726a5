"""The online CEPED teacher: the frozen decoder reads the student's context in its own window during
training, and the loss is CE + KL to it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from cepe.training.config import load_config
from cepe.training.data import build_example, collate, window_source
from cepe.training.losses import teacher_topk, topk_kl
from cepe.training.models import StageModule, build_model
from cepe.training.online_teacher import online_teacher_topk
from cepe.training.teacher import run_teacher
from cepe.training.trainer import read_log, train


def _cfg(tmp_path, **over):
    d = yaml.safe_load(Path("configs/train/tiny/cepe.yaml").read_text())
    d.pop("init_adapter")
    d.update(
        output_dir=str(tmp_path / "run"),
        steps=4,
        progress=False,
        data={"synthetic": "distinct"},
        encoder_init="decoder",
        encoder={"num_hidden_layers": 1},
        cepe={"init_mode": "gate", "mirror_self_attention": True},
        online_teacher=True,
        top_k=16,
    )
    d.update(over)
    return load_config(d)


def test_teacher_reads_the_unmasked_context_where_told(tmp_path):
    """Row t of example i is the decoder's own distribution of token t+1 after reading, at ``context_at``,
    exactly the encoder tokens the mask keeps (chunk noise and padding dropped, in order)."""
    cfg = _cfg(tmp_path)
    model = build_model(cfg)
    dec = model.decoder
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (2, 12), generator=g)
    enc = torch.randint(0, 128, (2, 3, 5), generator=g)
    mask = torch.ones(2, 3, 5, dtype=torch.bool)
    mask[0, 1, 2:] = False  # chunk noise: a suffix removed
    mask[1, 2] = False  # a whole chunk
    labels = ids.clone()
    labels[1, :7] = -100  # example 1 scores only its last tokens
    at = torch.tensor([0, 4])
    probs, idx = online_teacher_topk(dec, ids, labels, enc, mask, 16, at)
    assert probs.shape == idx.shape == (2, 11, 16)
    for i in range(2):
        ctx = enc[i][mask[i]]
        a = int(at[i])
        full = torch.cat([ids[i, :a], ctx, ids[i, a:]])[None]
        with torch.no_grad():
            logits = dec(full).logits[0]
        for t in range(11):
            if labels[i, t + 1] == -100:
                assert not probs[i, t].any()
                continue
            row = t if t + 1 < a else t + ctx.numel()  # token t+1 after the context: read after it
            p, j = teacher_topk(logits[row], 16)
            torch.testing.assert_close(probs[i, t], p)
            assert torch.equal(idx[i, t], j.long())
    assert ctx.numel() == 10  # example 1 kept two whole chunks


def test_kl_vanishes_when_the_student_reads_what_the_teacher_reads(tmp_path):
    """With every context token masked the teacher reads the decoder tokens alone and CEPE equals the
    decoder exactly (the invariant), so the KL is only the fp16 rounding of the stored probabilities;
    with context and closed gates (the start of training) it is the context's real effect."""
    cfg = _cfg(tmp_path, chunk_noise=0.0)
    model = build_model(cfg)
    module = StageModule(model, cfg)
    src = window_source(cfg, 128)
    batch = collate([build_example(cfg, src[i], i, None) for i in range(4)])
    batch.pop("index")
    empty = dict(batch, encoder_attention_mask=torch.zeros_like(batch["encoder_attention_mask"]))
    loss, metrics = module(empty)
    module.release()
    assert float(metrics["kl"]) < 2e-3
    torch.testing.assert_close(loss, cfg.ce_coef * metrics["lm"] + cfg.kl_coef * metrics["kl"])
    _, with_context = module(batch)
    module.release()
    assert float(with_context["kl"]) > 20 * float(metrics["kl"])


def _open_gates(model) -> None:
    """Every cross-attention gate at 0.5, so that the student differs from the teacher."""
    with torch.no_grad():
        for m in model.cross_attention_modules():
            for name, p in m.named_parameters():
                if "gate" in name:
                    p.fill_(0.5)


def test_online_kl_matches_the_plain_computation(tmp_path):
    """The fast path (chunked CE, head on scored rows) gives the loss of full logits + topk_kl by hand."""
    cfg = _cfg(
        tmp_path, tasks={"lm": 1, "copy": 1, "recall": 1}, recall_cue=4, recall_span=[4, 12], align_coef=1.0
    )
    model = build_model(cfg)
    _open_gates(model)
    src = window_source(cfg, 128)
    batch = collate([build_example(cfg, src[i], i, None) for i in range(4)])
    batch.pop("index")
    fast = StageModule(model, cfg)
    loss, metrics = fast(batch)
    fast.release()
    probs, idx = online_teacher_topk(
        model.decoder,
        batch["input_ids"],
        batch["labels"],
        batch["encoder_input_ids"],
        batch["encoder_attention_mask"],
        16,
        batch["context_at"],
    )
    with torch.no_grad():
        out = model(
            batch["input_ids"],
            encoder_input_ids=batch["encoder_input_ids"],
            encoder_attention_mask=batch["encoder_attention_mask"],
        )
    logits = out.logits[:, :-1]
    keep = batch["labels"][:, 1:] != -100
    ce = torch.nn.functional.cross_entropy(logits[keep].float(), batch["labels"][:, 1:][keep])
    kl = topk_kl(logits[keep], probs[keep], idx[keep], cfg.kl_form)
    torch.testing.assert_close(metrics["kl"], kl, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(metrics["lm"], ce, rtol=1e-4, atol=1e-5)
    assert float(kl) > 0.05
    torch.testing.assert_close(
        loss, cfg.ce_coef * ce + cfg.kl_coef * kl + cfg.align_coef * metrics["align"], rtol=1e-4, atol=1e-5
    )


def test_online_teacher_trains_and_resumes_exactly(tmp_path):
    cfg = _cfg(tmp_path, steps=4, save_every=2)
    log = read_log(train(cfg))
    assert len(log) == 4 and all("kl" in r and "lm" in r for r in log)
    again = _cfg(tmp_path, steps=4, save_every=2, output_dir=str(tmp_path / "again"))
    train(again)
    import shutil

    shutil.rmtree(tmp_path / "again" / "checkpoints" / "step_000004")
    resumed = read_log(train(again, resume=True))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in log]


def test_kl_gradient_pulls_the_student_to_the_teacher(tmp_path):
    """Distillation alone (no CE) on one fixed batch: the KL's gradient reaches the adapter and lowers it."""
    cfg = _cfg(tmp_path, ce_coef=0.0, kl_coef=1.0, chunk_noise=0.0, top_k=128)
    model = build_model(cfg)
    module = StageModule(model, cfg)
    src = window_source(cfg, 128)
    batch = collate([build_example(cfg, src[i], i, None) for i in range(4)])
    batch.pop("index")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=3e-3)
    kls = []
    for _ in range(25):
        loss, metrics = module(batch)
        loss.backward()
        module.release()
        opt.step()
        opt.zero_grad()
        kls.append(float(metrics["kl"]))
    assert kls[-1] < 0.6 * kls[0]


def test_online_teacher_config(tmp_path):
    cfg = _cfg(tmp_path)
    assert cfg.fingerprint() != _cfg(tmp_path, online_teacher=False).fingerprint()
    plain = _cfg(tmp_path, online_teacher=False)
    assert (
        "online_teacher" not in plain.to_dict()
        or plain.fingerprint()
        == _cfg(tmp_path, online_teacher=False, output_dir=str(tmp_path / "x")).fingerprint()
    )
    with pytest.raises(ValueError, match="online_teacher"):
        load_config({**yaml.safe_load(open("configs/train/tiny/warmup.yaml")), "online_teacher": True})
    with pytest.raises(ValueError, match="remove teacher_dir"):
        _cfg(tmp_path, teacher_dir=str(tmp_path / "t"))
    ceped = _cfg(tmp_path, stage="ceped")  # no teacher_dir needed
    assert ceped.online_teacher and ceped.teacher_dir is None
    with pytest.raises(ValueError, match="no pass is needed"):
        run_teacher(ceped, progress=False)
    log = read_log(train(_cfg(tmp_path, stage="ceped", steps=2, output_dir=str(tmp_path / "d"))))
    assert len(log) == 2 and all("kl" in r for r in log)


def test_teacher_tasks_distil_only_the_named_kinds(tmp_path):
    """teacher_tasks: the teacher runs only for the named kinds (the others' rows stay zeros) and the KL
    is the plain one over those examples' scored rows alone; the CE still covers every example."""
    mixed = {"tasks": {"lm": 1, "recall": 1}, "recall_cue": 4, "recall_span": [4, 12], "chunk_noise": 0.0}
    cfg = _cfg(tmp_path, teacher_tasks=["lm"], **mixed)
    model = build_model(cfg)
    _open_gates(model)
    src = window_source(cfg, 128)
    batch = collate([build_example(cfg, src[i], i, None) for i in range(6)])
    batch.pop("index")
    taught = batch["task"] == 0  # lm
    assert 0 < int(taught.sum()) < 6
    loss, metrics = StageModule(model, cfg)(batch)
    args = [model.decoder, batch["input_ids"], batch["labels"]]
    args += [batch["encoder_input_ids"], batch["encoder_attention_mask"], 16, batch["context_at"]]
    probs, idx = online_teacher_topk(*args, select=taught)
    everyone, _ = online_teacher_topk(*args)
    assert not probs[~taught].any() and probs[~taught].shape[0] > 0
    torch.testing.assert_close(probs[taught], everyone[taught])
    kl = assert_plain_kl_and_ce(model, batch, probs, idx, taught, cfg.kl_form, metrics)
    assert float(kl) > 0.05
    # every kind taught: the KL also counts the recall rows, so it differs
    _, all_taught = StageModule(model, _cfg(tmp_path, teacher_tasks=["lm", "recall"], **mixed))(batch)
    assert abs(float(all_taught["kl"]) - float(kl)) > 1e-4


def assert_plain_kl_and_ce(model, batch, probs, idx, taught, kl_form, metrics, ce_key="lm"):
    """The stage module's logged KL and CE (``metrics[ce_key]``: ``ce`` for CEPED) are the plain ones by
    hand: the KL over the scored rows of the ``taught`` examples ``(B,)``, the CE over every scored row.
    Returns the KL."""
    with torch.no_grad():
        logits = model(
            batch["input_ids"],
            encoder_input_ids=batch["encoder_input_ids"],
            encoder_attention_mask=batch["encoder_attention_mask"],
        ).logits[:, :-1]
    keep = batch["labels"][:, 1:] != -100
    sel = keep & taught[:, None]
    kl = topk_kl(logits[sel], probs[sel], idx[sel], kl_form)
    ce = torch.nn.functional.cross_entropy(logits[keep].float(), batch["labels"][:, 1:][keep])
    torch.testing.assert_close(metrics["kl"], kl, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(metrics[ce_key], ce, rtol=1e-4, atol=1e-5)
    return kl


def test_teacher_keeps_the_last_context_that_fits_its_positions(tmp_path):
    """Beyond the teacher's positions it reads the context's last tokens that fit, before the decoder's."""
    cfg = _cfg(tmp_path)
    dec = build_model(cfg).decoder
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (1, 8), generator=g)
    enc = torch.randint(0, 128, (1, 3, 5), generator=g)
    mask = torch.ones(1, 3, 5, dtype=torch.bool)
    short, _ = online_teacher_topk(dec, ids, ids, enc, mask, 16, max_positions=8 + 6)
    kept = enc.reshape(1, 1, 15)[:, :, 9:]  # the last 6 context tokens
    by_hand, _ = online_teacher_topk(dec, ids, ids, kept, torch.ones_like(kept, dtype=torch.bool), 16)
    torch.testing.assert_close(short, by_hand)
    full, _ = online_teacher_topk(dec, ids, ids, enc, mask, 16, max_positions=8 + 15)
    torch.testing.assert_close(full, online_teacher_topk(dec, ids, ids, enc, mask, 16)[0])
    assert not torch.equal(short, full)


def test_teacher_tasks_config(tmp_path):
    mixed = {"tasks": {"lm": 1, "recall": 1}, "recall_cue": 4, "recall_span": [4, 12]}
    assert (
        _cfg(tmp_path, **mixed).fingerprint() != _cfg(tmp_path, teacher_tasks=["lm"], **mixed).fingerprint()
    )
    assert "teacher_tasks" not in _cfg(tmp_path, **mixed).to_dict() or _cfg(
        tmp_path, **mixed
    ).fingerprint() == (_cfg(tmp_path, teacher_tasks=None, **mixed).fingerprint())
    with pytest.raises(ValueError, match="teacher_tasks must be a list of kinds named in tasks"):
        _cfg(tmp_path, teacher_tasks=["qa"], **mixed)
    with pytest.raises(ValueError, match="needs online_teacher: true and tasks"):
        _cfg(tmp_path, teacher_tasks=["lm"], online_teacher=False, **mixed)
    with pytest.raises(ValueError, match="needs online_teacher: true and tasks"):
        _cfg(tmp_path, teacher_tasks=["lm"])


def test_cost_model_counts_the_teacher_for_its_share_of_examples(tmp_path):
    """teacher_tasks: the teacher's forward is counted for the taught kinds' share of examples."""
    from cepe.training.speed import step_flops

    mixed = {"tasks": {"lm": 1, "recall": 3}, "recall_cue": 4, "recall_span": [4, 12]}
    every, quarter = _cfg(tmp_path, **mixed), _cfg(tmp_path, teacher_tasks=["lm"], **mixed)
    none = _cfg(tmp_path, online_teacher=False, **mixed)
    model = build_model(every)
    f_all, f_quarter, f_none = (step_flops(c, model)["forward"] for c in (every, quarter, none))
    assert f_none < f_quarter < f_all
    assert abs((f_quarter - f_none) - 0.25 * (f_all - f_none)) <= 2 * every.batch_size
    # teacher_context: the taught lm examples' teacher reads the cut context, not the whole K·L
    k, n = every.n_chunks, every.chunk_length
    cut = _cfg(tmp_path, teacher_tasks=["lm"], teacher_context=n, **mixed)
    whole = _cfg(tmp_path, teacher_tasks=["lm"], teacher_context=k * n, **mixed)
    assert f_none < step_flops(cut, model)["forward"] < f_quarter == step_flops(whole, model)["forward"]


def test_teacher_context_shortens_the_taught_lm_examples_only(tmp_path):
    """teacher_context: lm examples keep only their last chunks (within the limit) for student and teacher;
    recall examples keep the whole context; the option is refused without lm taught or off the chunk grid."""
    from cepe.training.data import example_task

    mixed = {"tasks": {"lm": 1, "recall": 1}, "recall_cue": 4, "recall_span": [4, 12], "chunk_noise": 0.0}
    cfg = _cfg(tmp_path, teacher_tasks=["lm"], **mixed)
    k, n = cfg.n_chunks, cfg.chunk_length
    short = _cfg(tmp_path, teacher_tasks=["lm"], teacher_context=n, **mixed)
    src = window_source(cfg, 128)
    kinds = set()
    for i in range(8):
        full, cut, kind = (
            build_example(cfg, src[i], i, None),
            build_example(short, src[i], i, None),
            example_task(cfg, i),
        )
        kinds.add(kind)
        if kind == "lm":
            assert not cut["encoder_attention_mask"][: k - 1].any()
            assert torch.equal(cut["encoder_attention_mask"][k - 1], full["encoder_attention_mask"][k - 1])
        else:
            assert torch.equal(cut["encoder_attention_mask"], full["encoder_attention_mask"])
        assert torch.equal(cut["input_ids"], full["input_ids"])
    assert kinds == {"lm", "recall"}
    assert short.fingerprint() != cfg.fingerprint()
    with pytest.raises(ValueError, match="needs teacher_tasks with lm"):
        _cfg(tmp_path, teacher_tasks=["recall"], teacher_context=n, **mixed)
    with pytest.raises(ValueError, match="positive multiple of chunk_length"):
        _cfg(tmp_path, teacher_tasks=["lm"], teacher_context=n + 1, **mixed)


def test_teacher_context_longer_than_a_drawn_layouts_context_keeps_that_context_whole(tmp_path):
    """With ``context_chunks``, a layout whose whole context is within ``teacher_context`` has nothing to
    cut: the config is accepted and that layout's lm examples are those it builds without the option."""
    from cepe.training.data import at_layout

    mixed = {
        "tasks": {"lm": 1},
        "recall_cue": 2,
        "recall_span": [2, 4],
        "chunk_noise": 0.0,
        "context_chunks": [1, 4],
    }
    n = 8  # chunk_length of the tiny config; 4 chunks
    cut = _cfg(tmp_path, teacher_tasks=["lm"], teacher_context=2 * n, **mixed)
    plain = _cfg(tmp_path, teacher_tasks=["lm"], **mixed)
    src = window_source(cut, 128)
    for i in range(4):
        c1, w1 = at_layout(cut, src[i], None, 1)
        p1, v1 = at_layout(plain, src[i], None, 1)
        assert c1.teacher_context is None and torch.equal(w1, v1)
        one = build_example(c1, w1, i, None)
        assert torch.equal(
            one["encoder_attention_mask"], build_example(p1, v1, i, None)["encoder_attention_mask"]
        )
        assert one["encoder_attention_mask"].all()
        c4, w4 = at_layout(cut, src[i], None, 4)
        four = build_example(c4, w4, i, None)["encoder_attention_mask"]
        assert c4.teacher_context == 2 * n and not four[:2].any() and four[2:].all()
