"""Training options of the copy-warmup recipe: the encoder built from the decoder, shuffled windows,
decoder spans, a frozen encoder, and fingerprints that older runs keep."""

from __future__ import annotations

import pytest
import torch
import yaml

from cepe.training.config import load_config
from cepe.training.data import build_example, window_source
from cepe.training.models import build_model, trainable_parameters
from cepe.training.trainer import read_log, train

TINY = yaml.safe_load(open("configs/train/tiny/warmup.yaml"))


def _cfg(tmp_path, **over):
    d = {k: v for k, v in TINY.items() if k != "init_encoder"}
    d.update(output_dir=str(tmp_path / "run"), steps=4, progress=False, bf16=False, encoder={})
    d.update(over)
    return load_config(d)


def test_decoder_built_encoder_trains_and_shares_embeddings(tmp_path):
    cfg = _cfg(
        tmp_path,
        encoder_init="decoder",
        encoder={"num_hidden_layers": 1, "causal": True},
        cepe={"init_mode": "zero", "mirror_self_attention": True, "cross_attention_layers": [1]},
    )
    model = build_model(cfg)
    assert model.cepe_config.share_embeddings and model.cepe_config.encoder.causal
    dec_layer = model.decoder.model.layers[0]
    torch.testing.assert_close(model.encoder.layers[0].mlp.up_proj.weight, dec_layer.mlp.up_proj.weight)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(
        n.startswith("encoder.layers") or n.startswith("encoder.norm") or ".cross_attn." in n for n in names
    )
    out = train(cfg)
    losses = [r["loss"] for r in read_log(out)]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))


def test_frozen_encoder_trains_only_cross_attention(tmp_path):
    cfg = _cfg(tmp_path, encoder_init="decoder", encoder={"num_hidden_layers": 1}, freeze_encoder=True)
    params = trainable_parameters(build_model(cfg))
    model = build_model(cfg)
    assert all(not p.requires_grad for p in model.encoder.parameters())
    assert len(params) == sum(1 for _ in model.cross_attention_modules()) * 5


def test_train_only_moves_the_named_weights_and_nothing_else(tmp_path):
    over = dict(
        encoder_init="decoder", encoder={"num_hidden_layers": 1}, cepe={"null_key": True, "init_mode": "copy"}
    )
    cfg = _cfg(tmp_path, train_only=["null_key"], optim={"lr": 1e-2}, **over)
    model = build_model(cfg)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(n.endswith("cross_attn.null_key") for n in trained)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    from cepe.modeling import CepeForCausalLM
    from cepe.training.models import build_decoder

    out = train(cfg)
    after = dict(CepeForCausalLM.from_pretrained(out, decoder=build_decoder(cfg)).named_parameters())
    moved = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert moved == trained  # every null key moved, no other weight did


def test_train_only_rejects_a_part_that_matches_nothing(tmp_path):
    with pytest.raises(ValueError, match="train_only entry 'nul_key' matches no trainable parameter"):
        build_model(
            _cfg(tmp_path, encoder_init="decoder", encoder={"num_hidden_layers": 1}, train_only=["nul_key"])
        )
    with pytest.raises(ValueError, match="non-empty list"):
        _cfg(tmp_path, train_only=[])


def test_shuffle_and_span_layout(tmp_path):
    plain = _cfg(tmp_path)
    shuffled = _cfg(tmp_path, data={**TINY["data"], "shuffle": 1.0})
    span = _cfg(tmp_path, warmup_decoder_tokens=8)
    src = window_source(plain, 128)
    for i in range(3):
        a, b, c = (build_example(x, src[i], i, None) for x in (plain, shuffled, span))
        assert sorted(a["input_ids"].tolist()) == sorted(b["input_ids"].tolist())  # same tokens ...
        assert not torch.equal(a["input_ids"], b["input_ids"])  # ... in another order
        assert torch.equal(b["encoder_input_ids"].flatten(), b["input_ids"])  # both sides see the same
        flat = c["encoder_input_ids"].flatten().tolist()
        dec = c["input_ids"].tolist()
        assert len(dec) == 8 and any(flat[s : s + 8] == dec for s in range(len(flat) - 7))
    half = _cfg(tmp_path, data={**TINY["data"], "shuffle": 0.5})
    moved = sum(
        not torch.equal(build_example(half, src[i], i, None)["input_ids"], src[i][:32]) for i in range(200)
    )
    assert 60 < moved < 140


def test_fingerprint_unchanged_by_new_defaults(tmp_path):
    """Runs written before the new fields keep their fingerprint (so they still resume)."""
    cfg = _cfg(tmp_path)
    d = cfg.to_dict()
    for key in (
        "encoder_init",
        "warmup_decoder_tokens",
        "freeze_encoder",
        "train_only",
        "match_gate_calibrate",
        "align_coef",
        "align_heads",
        "align_layers",
        "tasks",
        "copy_shuffle",
        "recall_cue",
        "recall_span",
        "recall_foreign",
        "recall_drop",
        "recall_detour",
        "recall_anywhere",
        "copy_drop",
        "qa_templates",
        "qa_inline",
        "qa_span",
        "qa_span_tokens",
        "qa_compound",
        "qa_line_break",
        "qa_decoys",
        "qa_window_decoy",
        "icl_scored",
        "icl_arbitrary",
        "icl_align",
        "context_drop",
        "chunk_lengths",
        "decoder_lengths",
        "context_chunks",
        "online_teacher",
        "teacher_tasks",
        "teacher_context",
        "teacher_adapter",
        "teacher_drop_mixture",
        "teacher_max_context",
        "projection_fit_tokens",
    ):
        d.pop(key)
    d["data"].pop("shuffle")
    d["optim"].pop("gate_lr")
    d["optim"].pop("lr_by_name")
    import hashlib
    import json

    from cepe.training.config import RUN_CONTROL_FIELDS

    for key in ("output_dir", "progress", "save_every", "keep_checkpoints", "log_every", "num_threads"):
        d.pop(key, None)
    for key in RUN_CONTROL_FIELDS:
        d.pop(key, None)
    assert cfg.fingerprint() == hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
    assert _cfg(tmp_path, freeze_encoder=True).fingerprint() != cfg.fingerprint()
    assert _cfg(tmp_path, train_only=["null_key"]).fingerprint() != cfg.fingerprint()
    assert _cfg(tmp_path, qa_inline=0.5).fingerprint() != cfg.fingerprint()
    assert _cfg(tmp_path, icl_arbitrary=1.0).fingerprint() != cfg.fingerprint()
    from cepe.training.config import QA_SPAN_TOKENS
    from cepe.training.synthetic_qa import SPAN_TOKENS

    assert tuple(QA_SPAN_TOKENS) == SPAN_TOKENS  # the config's default is the generator's
    assert _cfg(tmp_path, qa_span_tokens=list(SPAN_TOKENS)).fingerprint() == cfg.fingerprint()
    assert _cfg(tmp_path, qa_span_tokens=[8, 32]).fingerprint() != cfg.fingerprint()
    assert _cfg(tmp_path, qa_compound=0.0).fingerprint() == cfg.fingerprint()
    assert _cfg(tmp_path, qa_compound=0.5).fingerprint() != cfg.fingerprint()
    assert _cfg(tmp_path, qa_line_break=0.0).fingerprint() == cfg.fingerprint()
    assert _cfg(tmp_path, qa_line_break=0.5).fingerprint() != cfg.fingerprint()
    assert _cfg(tmp_path, qa_decoys=0.0).fingerprint() == cfg.fingerprint()
    assert _cfg(tmp_path, qa_decoys=0.5).fingerprint() != cfg.fingerprint()
    assert _cfg(tmp_path, qa_window_decoy=0.0).fingerprint() == cfg.fingerprint()
    assert _cfg(tmp_path, qa_window_decoy=0.5).fingerprint() != cfg.fingerprint()
    assert _cfg(tmp_path, optim={"lr_by_name": {"gate": 1e-2}}).fingerprint() != cfg.fingerprint()


def test_gate_lr_opens_gates_at_their_own_rate(tmp_path):
    from cepe.training.trainer import param_groups

    over = dict(encoder_init="decoder", encoder={"num_hidden_layers": 1}, cepe={"init_mode": "gate"})
    cfg = _cfg(tmp_path, optim={"lr": 1e-3, "gate_lr": 5e-2}, **over)
    model = build_model(cfg)
    groups = param_groups(model, trainable_parameters(model), cfg)
    assert len(groups) == 2 and groups[1]["lr"] == 5e-2
    assert {id(p) for p in groups[1]["params"]} == {id(m.gate) for m in model.cross_attention_modules()}
    assert len(param_groups(model, trainable_parameters(model), _cfg(tmp_path, **over))) == 1


def test_lr_by_name_gives_each_named_part_its_rate(tmp_path):
    from cepe.training.trainer import param_groups

    over = dict(
        cepe={"token_gate": True, "match_gate": True}, train_only=["token_gate", "match_gate", "o_proj"]
    )
    rates = {"match_gate": 2e-2, "token_gate": 1e-3, "gate": 5.0}  # "gate" comes last: matches nothing new
    cfg = _cfg(tmp_path, optim={"lr": 1e-4, "lr_by_name": rates}, **over)
    model = build_model(cfg)
    params = trainable_parameters(model)
    groups = param_groups(model, params, cfg)
    by_id = {id(p): n for n, p in model.named_parameters()}
    assert [g.get("lr") for g in groups] == [None, 2e-2, 1e-3]
    assert all(by_id[id(p)].endswith("o_proj.weight") for p in groups[0]["params"])
    assert all(by_id[id(p)].endswith("cross_attn.match_gate") for p in groups[1]["params"])
    assert all(".token_gate." in by_id[id(p)] for p in groups[2]["params"])
    assert sum(len(g["params"]) for g in groups) == len(params)
    # a part whose parameters train_only leaves frozen sets nothing (an inherited rate); a misspelt one fails
    frozen = dict(rates, q_proj=3e-3)
    again = param_groups(model, params, _cfg(tmp_path, optim={"lr": 1e-4, "lr_by_name": frozen}, **over))
    assert [[id(p) for p in g["params"]] for g in again] == [[id(p) for p in g["params"]] for g in groups]
    assert [g.get("lr") for g in again] == [None, 2e-2, 1e-3]
    with pytest.raises(ValueError, match="'mach_gate' matches no parameter of the model"):
        param_groups(model, params, _cfg(tmp_path, optim={"lr_by_name": {"mach_gate": 1e-2}}, **over))
    with pytest.raises(ValueError, match="positive"):
        _cfg(tmp_path, optim={"lr_by_name": {"match_gate": -1.0}}, **over)


def test_align_nll_by_hand():
    from cepe.cross_attention import AlignProbe, align_nll

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 3, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)  # H=4, KV=2
    targets = torch.tensor([[1, 4, -1], [0, 2, 3]])
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 4] = False
    got = align_nll(q, k, mask, 0.5, AlignProbe(targets, heads=3))
    nll, n = 0.0, 0
    for b in range(2):
        for h in range(3):
            for t in range(3):
                if targets[b, t] < 0:
                    continue
                s = (q[b, h, t] @ k[b, h // 2].T) * 0.5
                s[~mask[b]] = float("-inf")
                nll -= float(torch.log_softmax(s, -1)[targets[b, t]])
                n += 1
    assert float(got) == pytest.approx(nll / n, rel=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_align_nll_on_the_supervised_rows_equals_the_reference(seed):
    """The fast path (scores of the supervised positions alone) gives the reference's value and gradients
    on random inputs: grouped key heads, padded keys, an example without targets, and a batch without any
    (0, connected to the graph)."""
    from cepe.cross_attention import AlignProbe, align_nll, align_nll_ref

    g = torch.Generator().manual_seed(seed)
    b, h, kv, t, s_len, hd = 3, 6, 2, 9, 13, 8
    q0, k0 = torch.randn(b, h, t, hd, generator=g), torch.randn(b, kv, s_len, hd, generator=g)
    targets = torch.randint(0, s_len - 2, (b, t), generator=g)
    targets[torch.rand(b, t, generator=g) < 0.5] = -1
    targets[1] = -1  # an example with no target
    mask = torch.rand(b, s_len, generator=g) < 0.85
    mask[torch.arange(b), targets.clamp_min(0).max(-1).values] = True
    mask[:, 0] = True
    for tg in (targets, torch.full_like(targets, -1)):
        out = []
        for fn in (align_nll, align_nll_ref):
            q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
            loss = fn(q, k, mask, 0.3, AlignProbe(tg, heads=4))
            loss.backward()
            out.append((loss.detach(), q.grad, k.grad))
        (fast, gq, gk), (ref, rq, rk) = out
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gq, rq, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gk, rk, rtol=1e-5, atol=1e-6)
    assert float(ref) == 0.0 and not gq.any()


def test_attention_supervision_teaches_the_copy_position(tmp_path):
    """With align_coef the targets point at the copy of the next token and the supervised loss falls (on
    this tiny random decoder from sharply wrong attention to about uniform; the real decoder goes below)."""
    over = dict(
        encoder_init="decoder",
        encoder={"num_hidden_layers": 1, "causal": False},
        cepe={"init_mode": "zero", "cross_attention_layers": [1]},
        align_coef=1.0,
        align_heads=2,
        warmup_decoder_tokens=16,
        steps=150,
        optim={"lr": 1e-2},
    )
    cfg = _cfg(tmp_path, **over)
    ex = build_example(cfg, window_source(cfg, 128)[0], 0, None)
    enc = ex["encoder_input_ids"].flatten()
    t = ex["align_targets"]
    assert t[-1] == -1 and torch.equal(enc[t[:-1]], ex["input_ids"][1:])  # targets hold the next tokens
    log = read_log(train(cfg))
    print([round(r["align"], 2) for r in log])
    assert log[-1]["align"] < 0.3 * log[0]["align"]


def test_cost_model_counts_the_decoder_span(tmp_path):
    """With warmup_decoder_tokens the decoder reads the span only; the encoder the whole window."""
    from cepe.training.speed import step_flops

    cfg = _cfg(tmp_path, warmup_decoder_tokens=8)
    flops = step_flops(cfg, build_model(cfg))
    assert flops["decoder_tokens"] == cfg.batch_size * 8
    assert flops["encoder_tokens"] == cfg.batch_size * cfg.warmup_tokens
    full = step_flops(_cfg(tmp_path), build_model(_cfg(tmp_path)))
    assert full["decoder_tokens"] == cfg.batch_size * cfg.warmup_tokens and full["total"] > flops["total"]


def test_cost_model_skips_the_backward_of_frozen_parts(tmp_path):
    """A frozen encoder gets no backward; frozen cross-attention weights cost input gradients only."""
    from cepe.training.speed import step_flops

    over = dict(encoder_init="decoder", encoder={"num_hidden_layers": 1}, cepe={"null_key": True})
    costs = {}
    for name, extra in (
        ("all", {}),
        ("frozen_encoder", {"freeze_encoder": True}),
        ("null", {"train_only": ["null_key"]}),
    ):
        cfg = _cfg(tmp_path, **over, **extra)
        costs[name] = step_flops(cfg, build_model(cfg))
    assert costs["all"]["forward"] == costs["frozen_encoder"]["forward"] == costs["null"]["forward"]
    assert costs["all"]["backward"] > costs["frozen_encoder"]["backward"] > costs["null"]["backward"] > 0


def _mixed(tmp_path, **over):
    d = yaml.safe_load(open("configs/train/tiny/cepe.yaml"))
    d.pop("init_adapter")
    d.update(
        output_dir=str(tmp_path / "mixed"),
        steps=4,
        progress=False,
        data={"synthetic": "distinct"},
        encoder_init="decoder",
        encoder={"num_hidden_layers": 1},
        tasks={"lm": 1, "copy": 1, "recall": 1},
        recall_cue=4,
        recall_span=[4, 12],
        align_coef=1.0,
    )
    d.update(over)
    return load_config(d)


def _assert_draws(tmp_path, cfg, draw, values: set) -> None:
    """``draw(cfg, step, micro)`` gives every one of ``values`` over 40 micro-batches, the same each time
    (a function of the step and the micro-batch), None for the plain config; the list is in the fingerprint."""
    drawn = [draw(cfg, s, m) for s in range(20) for m in range(2)]
    assert set(drawn) == values and drawn == [draw(cfg, s, m) for s in range(20) for m in range(2)]
    assert draw(_mixed(tmp_path), 0, 0) is None
    assert _mixed(tmp_path).fingerprint() != cfg.fingerprint()


def _assert_drawn_per_micro_batch(tmp_path, same: dict, drawn: dict) -> None:
    """A list drawn per micro-batch (``chunk_lengths``, ``decoder_lengths``, ``context_chunks``): holding
    only the config's own value it trains what the plain config trains (the same losses); with several
    values it trains something else and resumes exactly."""
    import shutil

    plain = read_log(train(_mixed(tmp_path, steps=3, output_dir=str(tmp_path / "plain"))))
    one = read_log(train(_mixed(tmp_path, steps=3, output_dir=str(tmp_path / "same"), **same)))
    assert [r["loss"] for r in one] == [r["loss"] for r in plain]
    mixed = _mixed(tmp_path, steps=4, save_every=2, output_dir=str(tmp_path / "cut"), **drawn)
    log = read_log(train(mixed))
    assert [r["loss"] for r in log[:3]] != [r["loss"] for r in plain]
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_000004")  # as if stopped after step 2
    assert [r["loss"] for r in read_log(train(mixed, resume=True))] == [r["loss"] for r in log]


def test_mixed_stage_layouts(tmp_path):
    """Every kind has the CEPE shapes; copied tokens' attention targets point at their encoder copies;
    recall keeps the decoder's own text before the cue and does not score the cue; lm has chunk noise
    and no targets; the kind of an example is a function of its index and the shares."""
    from cepe.training.data import example_task

    cfg = _mixed(tmp_path, copy_shuffle=1.0)
    src = window_source(cfg, 128)
    seen = set()
    for i in range(40):
        window = src[i]
        ex, kind = build_example(cfg, window, i, None), example_task(cfg, i)
        seen.add(kind)
        enc, dec, labels, align = (
            ex["encoder_input_ids"],
            ex["input_ids"],
            ex["labels"],
            ex["align_targets"],
        )
        assert enc.shape == (4, 8) and dec.shape == labels.shape == align.shape == (32,)
        flat = enc.flatten()
        pos = (align >= 0).nonzero().flatten()
        assert torch.equal(flat[align[pos]], dec[pos + 1])  # position t reads the copy of token t+1
        if kind == "lm":
            assert not len(pos) and torch.equal(dec, window[32:]) and torch.equal(labels, dec)
            assert torch.equal(enc.flatten(), window[:32])
        elif kind == "copy":
            assert len(pos) == 31 and torch.equal(labels, dec)
            assert sorted(flat.tolist()) == sorted(window[:32].tolist())
            assert not torch.equal(flat, window[:32])  # copy_shuffle 1: permuted
            assert bool(ex["encoder_attention_mask"].all())
        else:
            cue = int((labels == -100).sum())
            assert cue == 4
            at = int((labels == -100).nonzero()[0])
            assert torch.equal(dec[:at], window[32 : 32 + at])  # the decoder's own text first
            assert pos.tolist() == list(range(at, 31))
            assert 4 <= 32 - at - 4 <= 12
    assert seen == {"lm", "copy", "recall"}
    only_lm = _mixed(tmp_path, tasks={"lm": 1.0, "copy": 0.0})
    assert {example_task(only_lm, i) for i in range(20)} == {"lm"}


def test_recall_foreign_plants_another_window_as_a_needle(tmp_path):
    """``recall_foreign`` 1: every recall example's cue and span are window ``i + FOREIGN_OFFSET``'s text,
    planted over the encoder at the recalled place (the rest of the encoder is the window's own), and
    the decoder recalls them; every other draw (kinds, places, spans) is that of a run without it."""
    from cepe.training.data import FOREIGN_OFFSET, example_task, needs_foreign

    plain = _mixed(tmp_path)
    cfg = _mixed(tmp_path, recall_foreign=1.0)
    src = window_source(cfg, 128)
    planted = 0
    for i in range(40):
        window = src[i]
        a = build_example(plain, window, i, None)
        assert needs_foreign(cfg, i) == (example_task(cfg, i) == "recall")
        if not needs_foreign(cfg, i):
            b = build_example(cfg, window, i, None)
            assert all(torch.equal(a[k], b[k]) for k in a)
            continue
        with pytest.raises(ValueError, match="foreign window"):
            build_example(cfg, window, i, None)
        foreign = src[i + FOREIGN_OFFSET]
        b = build_example(cfg, window, i, None, foreign=foreign)
        assert torch.equal(a["labels"] == -100, b["labels"] == -100) and torch.equal(
            a["align_targets"], b["align_targets"]
        )
        at = int((b["labels"] == -100).nonzero()[0])  # the cue's first position
        start = int(b["align_targets"][at]) - 1  # it reads the copy of token at + 1
        total = b["input_ids"].numel() - at
        flat_a, flat_b = a["encoder_input_ids"].flatten(), b["encoder_input_ids"].flatten()
        seg = flat_b[start : start + total]
        assert torch.equal(b["input_ids"][at:], seg) and torch.equal(b["input_ids"][:at], a["input_ids"][:at])
        assert any(torch.equal(seg, foreign[j : j + total]) for j in range(foreign.numel() - total + 1))
        keep = torch.ones_like(flat_a, dtype=torch.bool)
        keep[start : start + total] = False
        assert torch.equal(flat_a[keep], flat_b[keep])
        planted += 1
    assert planted > 0
    with pytest.raises(ValueError, match="recall_foreign"):
        _mixed(tmp_path, recall_foreign=1.5)
    assert plain.fingerprint() != cfg.fingerprint()
    assert plain.fingerprint() == _mixed(tmp_path, recall_foreign=0.0).fingerprint()


def test_recall_drop_shortens_the_context_and_keeps_the_cue(tmp_path):
    """``recall_drop`` 1: every recall example drops a prefix of whole chunks (drawn at or before the
    cue's chunk, so sometimes none), never the chunks that hold the cue and its span; tokens, labels and
    attention targets are those of a run without it, and other kinds are untouched."""
    from cepe.training.data import example_task

    plain = _mixed(tmp_path)
    cfg = _mixed(tmp_path, recall_drop=1.0)
    src = window_source(cfg, 128)
    kept = []
    for i in range(60):
        a, b = build_example(plain, src[i], i, None), build_example(cfg, src[i], i, None)
        for k in ("input_ids", "labels", "encoder_input_ids", "align_targets"):
            assert torch.equal(a[k], b[k])
        if example_task(cfg, i) != "recall":
            assert torch.equal(a["encoder_attention_mask"], b["encoder_attention_mask"])
            continue
        mask = b["encoder_attention_mask"]
        per_chunk = mask.all(dim=1)
        assert torch.equal(per_chunk, mask.any(dim=1))  # whole chunks only
        d = int((~per_chunk).sum())
        assert not per_chunk[:d].any() and per_chunk[d:].all()  # a prefix
        at = int((b["labels"] == -100).nonzero()[0])
        start = int(b["align_targets"][at]) - 1  # the cue's flat encoder position
        assert d <= start // mask.shape[1]  # the cue's chunk is kept
        kept.append(mask.shape[0] - d)
    assert len(set(kept)) > 1 and min(kept) < cfg.n_chunks
    with pytest.raises(ValueError, match="recall_drop"):
        _mixed(tmp_path, recall_drop=-0.1)
    assert plain.fingerprint() != cfg.fingerprint()
    assert plain.fingerprint() == _mixed(tmp_path, recall_drop=0.0).fingerprint()


def test_copy_drop_shortens_the_context_and_copies_from_what_is_kept(tmp_path):
    """``copy_drop`` 1: every copy example drops a prefix of whole chunks and its copied span (the decoder's
    tokens, found in the encoder through the attention targets) lies in the chunks kept; other kinds are
    untouched, and examples that drop nothing are those of a run without it."""
    from cepe.training.data import example_task

    kinds = {
        "tasks": {"lm": 1.0, "copy": 1.0},
        "n_decoder": 8,
        "recall_span": [2, 4],
    }  # 8 copied, 4 chunks of 8
    plain = _mixed(tmp_path, **kinds)
    cfg = _mixed(tmp_path, **kinds, copy_drop=1.0)
    src = window_source(cfg, 128)
    kept = []
    for i in range(60):
        a, b = build_example(plain, src[i], i, None), build_example(cfg, src[i], i, None)
        mask = b["encoder_attention_mask"]
        if example_task(cfg, i) != "copy":
            for k in ("input_ids", "labels", "encoder_input_ids", "encoder_attention_mask"):
                assert torch.equal(a[k], b[k])
            continue
        assert torch.equal(a["encoder_input_ids"], b["encoder_input_ids"])
        per_chunk = mask.all(dim=1)
        assert torch.equal(per_chunk, mask.any(dim=1))  # whole chunks only
        d = int((~per_chunk).sum())
        assert not per_chunk[:d].any() and per_chunk[d:].all()  # a prefix
        flat, length = b["encoder_input_ids"].reshape(-1), mask.shape[1]
        start = int(b["align_targets"][0]) - 1  # the span's first encoder position
        n = int((b["labels"] != -100).sum())
        assert start >= d * length and torch.equal(b["input_ids"][:n], flat[start : start + n])
        if d == 0:
            assert torch.equal(a["input_ids"], b["input_ids"])
        kept.append(mask.shape[0] - d)
    assert len(set(kept)) > 1 and min(kept) < cfg.n_chunks
    with pytest.raises(ValueError, match="copy_drop"):
        _mixed(tmp_path, copy_drop=1.5)
    assert plain.fingerprint() != cfg.fingerprint()
    assert plain.fingerprint() == _mixed(tmp_path, **kinds, copy_drop=0.0).fingerprint()


def _recall_pairs(plain, cfg, src, count: int = 60):
    """``(i, a, b)`` for the recall examples among the first ``count``: ``a`` built with ``plain``, ``b``
    with ``cfg`` (a recall option on); every other kind, and every encoder, is checked to be the same."""
    from cepe.training.data import example_task

    for i in range(count):
        a, b = build_example(plain, src[i], i, None), build_example(cfg, src[i], i, None)
        assert torch.equal(a["encoder_input_ids"], b["encoder_input_ids"])
        if example_task(cfg, i) != "recall":
            assert all(torch.equal(a[k], b[k]) for k in a)
            continue
        yield i, a, b


def test_recall_anywhere_puts_cue_and_span_at_any_decoder_position(tmp_path):
    """``recall_anywhere`` 1: a recall example's cue and span sit at a decoder position drawn uniformly,
    the window's own text before and after them; the cue and the first token after the span are not
    scored, the span is, and its attention targets point at its encoder copy. Other kinds and the encoder
    are those of a run without it."""
    from cepe.data.sequences import split_for_cepe

    plain, cfg = _mixed(tmp_path), _mixed(tmp_path, recall_anywhere=1.0)
    src = window_source(cfg, 128)
    cue, ats, inner = cfg.recall_cue, set(), 0
    for i, a, b in _recall_pairs(plain, cfg, src):
        _, own = split_for_cepe(src[i], cfg.n_decoder, cfg.chunk_length, cfg.n_chunks)
        flat, dec, lab, al = b["encoder_input_ids"].flatten(), b["input_ids"], b["labels"], b["align_targets"]
        n = dec.numel()
        copied = (al != -1).nonzero().flatten()
        at, end = int(copied[0]), int(copied[-1]) + 2  # the cue's first position, one past the span
        start = int(al[at]) - 1
        total = end - at
        assert total == int((a["align_targets"] != -1).sum()) + 1  # the same cue and span as at the end
        assert torch.equal(dec[at:end], flat[start : start + total])
        assert al[at : end - 1].tolist() == list(range(start + 1, start + total))
        assert torch.equal(dec[:at], own[:at]) and torch.equal(dec[end:], own[end:])
        assert (lab[at : at + cue] == -100).all() and torch.equal(lab[at + cue : end], dec[at + cue : end])
        if end < n:
            inner += 1
            assert lab[end] == -100 and torch.equal(lab[end + 1 :], dec[end + 1 :])
        ats.add(at)
    assert len(ats) > 5 and inner > 5
    with pytest.raises(ValueError, match="recall_anywhere"):
        _mixed(tmp_path, recall_anywhere=1.5)
    assert plain.fingerprint() != cfg.fingerprint()
    assert plain.fingerprint() == _mixed(tmp_path, recall_anywhere=0.0).fingerprint()


def test_recall_detour_puts_own_tokens_between_cue_and_span(tmp_path):
    """``recall_detour`` 1: a recall example's cue is followed by 1-3 unscored tokens of the decoder's own
    earlier text, then by the span from where the cue ended in the encoder (its end cut so the decoder
    keeps its length); attention targets point each span token's predictor at its encoder copy. Other
    kinds and the encoder are those of a run without it."""
    plain, cfg = _mixed(tmp_path), _mixed(tmp_path, recall_detour=1.0)
    src = window_source(cfg, 128)
    detours = set()
    for _, a, b in _recall_pairs(plain, cfg, src):
        flat, dec, lab, al = b["encoder_input_ids"].flatten(), b["input_ids"], b["labels"], b["align_targets"]
        at = int((a["labels"] == -100).nonzero()[0])
        start = int(a["align_targets"][at]) - 1
        cue = cfg.recall_cue
        scored = (lab != -100).nonzero().flatten()
        first = int(scored[0]) if at <= int(scored[0]) else int(scored[scored >= at][0])
        d = first - (at + cue)
        assert 1 <= d <= 3
        detours.add(d)
        assert torch.equal(dec[:at], a["input_ids"][:at]) and torch.equal(
            dec[at : at + cue], flat[start : start + cue]
        )
        own = dec[at + cue : first]
        assert any(torch.equal(own, dec[j : j + d]) for j in range(at - d + 1))  # the decoder's own tokens
        m = dec.numel() - first
        assert torch.equal(dec[first:], flat[start + cue : start + cue + m])  # the span goes on
        assert (lab[at:first] == -100).all() and torch.equal(lab[first:], dec[first:])
        assert (al[at + cue - 1 : first - 1] == -1).all()
        assert al[first - 1 : -1].tolist() == list(range(start + cue, start + cue + m))
    assert detours == {1, 2, 3}
    with pytest.raises(ValueError, match="recall_detour"):
        _mixed(tmp_path, recall_detour=2.0)
    assert plain.fingerprint() != cfg.fingerprint()
    assert plain.fingerprint() == _mixed(tmp_path, recall_detour=0.0).fingerprint()


def test_mixed_stage_validation_and_fingerprint(tmp_path):
    plain = yaml.safe_load(open("configs/train/tiny/cepe.yaml"))
    plain.update(output_dir=str(tmp_path / "p"))
    base = load_config(plain)
    assert base.fingerprint() == load_config({**plain, "copy_shuffle": 0.0}).fingerprint()
    assert _mixed(tmp_path).fingerprint() != _mixed(tmp_path, copy_shuffle=0.5).fingerprint()
    for over, msg in (
        ({"tasks": {"lm": 1, "passkey": 1}}, "tasks must map"),
        ({"tasks": {"lm": 0}}, "not all zero"),
        ({"recall_span": [4, 40]}, "must fit"),
        ({"recall_span": [5, 4]}, "recall_span"),
        ({"copy_shuffle": 2}, "copy_shuffle"),
    ):
        with pytest.raises(ValueError, match=msg):
            _mixed(tmp_path, **over)
    with pytest.raises(ValueError, match="mixed CEPE stage"):
        load_config({**plain, "align_coef": 1.0})


def test_mixed_stage_trains_and_resumes_exactly(tmp_path):
    cfg = _mixed(tmp_path, steps=4, save_every=2)
    log = read_log(train(cfg))
    assert len(log) == 4 and all("align" in r and "lm" in r for r in log)
    kinds = {k for r in log for k in r if k.startswith("lm_")}
    assert kinds == {"lm_lm", "lm_copy", "lm_recall", "lm_recall_span"}  # each kind's loss is logged
    one = next(r for r in log if {"lm_lm", "lm_copy", "lm_recall"} <= set(r))
    assert (
        min(one["lm_lm"], one["lm_copy"], one["lm_recall"])
        <= one["lm"]
        <= max(one["lm_lm"], one["lm_copy"], one["lm_recall"])
    )
    again = _mixed(tmp_path, steps=4, save_every=2, output_dir=str(tmp_path / "again"))
    train(again)
    import shutil

    shutil.rmtree(tmp_path / "again" / "checkpoints" / "step_000004")  # as if stopped after step 2
    resumed = read_log(train(again, resume=True))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in log]


def test_mixed_stage_qa_examples(tmp_path):
    """qa: facts planted in the encoder, a question then the restated fact in the decoder; only the
    answer is scored and its tokens' attention targets hold the planted copies (bytes on a tiny decoder)."""
    from cepe.training.data import example_task
    from cepe.training.synthetic_qa import ByteCodec

    d = yaml.safe_load(open("configs/train/tiny/cepe.yaml"))["tiny_decoder"]
    cfg = _mixed(
        tmp_path,
        tiny_decoder={**d, "vocab_size": 259},
        n_decoder=160,
        chunk_length=64,
        n_chunks=4,
        tasks={"qa": 1.0},
        data={"synthetic": "random", "synthetic_vocab": 256},
    )
    src = window_source(cfg, 259)
    for i in range(5):
        assert example_task(cfg, i) == "qa"
        ex = build_example(cfg, src[i], i, None)
        dec, labels, align = ex["input_ids"], ex["labels"], ex["align_targets"]
        flat = ex["encoder_input_ids"].flatten()
        assert dec.shape == (160,) and flat.shape == (256,)
        scored = (labels != -100).nonzero().flatten()
        answer = bytes(dec[scored].tolist()).decode()
        asked = bytes(dec[: scored[0]].tolist()).decode(errors="replace").rsplit("\n\n", 1)[1]
        assert answer.endswith(".") and asked.endswith("?")
        assert "\n" + answer + "\n" in bytes(flat.tolist()).decode(errors="replace")  # planted on its line
        pos = (align >= 0).nonzero().flatten()
        assert pos.tolist() == (scored - 1).tolist()  # every answer token reads its planted copy
        assert torch.equal(flat[align[pos]], dec[pos + 1])
    assert ByteCodec().encode("é") == [195, 169]
    small = _mixed(tmp_path, tasks={"qa": 1.0}, n_decoder=160, chunk_length=64, n_chunks=4)
    with pytest.raises(ValueError, match="vocab_size >= 256"):  # the tiny config's 128 ids
        build_example(small, src[0], 0, None)


def test_qa_facts_planted_inline_after_sentence_ends():
    """qa_inline: a fact goes inside the running text right after a sentence's end ("end. Fact."), the
    answer's tokens are the planted ones and its attention targets point at them; a text without sentence
    ends falls back to facts on their own lines; the option changes nothing when off (older runs)."""
    import random

    from cepe.training.synthetic_qa import qa_example

    text = " ".join(f"Word{i} goes here{'.!?'[i % 3]}" for i in range(40)).encode()[:256]
    enc = torch.tensor(list(text)).reshape(4, 64)
    dec = torch.full((160,), ord("x"))
    for seed in range(6):
        new_enc, ids, labels, align = qa_example(enc, dec, random.Random(seed), "d", 259, inline=True)
        flat = new_enc.flatten()
        scored = (labels != -100).nonzero().flatten()
        answer = bytes(ids[scored].tolist()).decode()
        body = bytes(flat.tolist()).decode(errors="replace")
        at = body.find(" " + answer)
        assert at > 0 and body[at - 1] in ".!?", body  # after a sentence's end, not on its own line
        assert "\n" not in body
        pos = (align >= 0).nonzero().flatten()
        assert torch.equal(flat[align[pos]], ids[pos + 1])
    plain = torch.full((4, 64), ord("a"))  # no sentence end: its own line
    new_enc, ids, labels, _ = qa_example(plain, dec, random.Random(0), "d", 259, inline=True)
    answer = bytes(ids[(labels != -100)].tolist()).decode()
    assert "\n" + answer + "\n" in bytes(new_enc.flatten().tolist()).decode(errors="replace")
    off = [qa_example(enc, dec, random.Random(3), "d", 259, inline=False) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*off))
    assert "\n" in bytes(off[0][0].flatten().tolist()).decode(errors="replace")


def test_context_drop_keeps_the_last_chunks_of_continuation_examples(tmp_path):
    """context_drop: a continuation example keeps only its last k of K encoder chunks (k from 1 to K
    over the examples), in the mixed and the plain CEPE stage; at 0 every chunk is kept."""
    src = window_source(_mixed(tmp_path), 80)
    for over in ({"tasks": {"lm": 1.0}}, {"tasks": None, "align_coef": 0.0}):
        cfg = _mixed(tmp_path, chunk_noise=0.0, context_drop=1.0, **over)
        kept = set()
        for i in range(80):
            mask = build_example(cfg, src[i], i, None)["encoder_attention_mask"]
            per_chunk = mask.all(-1)
            k = int(per_chunk.sum())
            assert mask.any(-1).sum() == k and per_chunk[mask.shape[0] - k :].all(), mask
            kept.add(k)
        assert kept == set(range(1, cfg.n_chunks + 1)), kept
        off = _mixed(tmp_path, chunk_noise=0.0, **over)
        assert all(build_example(off, src[i], i, None)["encoder_attention_mask"].all() for i in range(10))


def _byte_qa_inputs(k: int, length: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Encoder text ``(k, length)`` of numbered words in bytes (for the byte-level stand-in tokenizer) and a
    decoder ``(n,)`` of filler."""
    words = "amber quokka lattice verdant pylon mosaic".split()
    text = " ".join(words[i % 6] + str(i) for i in range(k * length // 3)).encode()[: k * length]
    return torch.tensor(list(text)).reshape(k, length), torch.full((n,), ord("x"))


def test_qa_span_facts_copy_the_encoders_own_text():
    """qa_span: a fact's value is a few tokens of the encoder's own text (never a word from the fact
    lists), the answer restates the planted fact and its attention targets point at the planted copy;
    span 0 draws nothing, so older runs are unchanged."""
    import random

    from cepe.training.synthetic_qa import make_fact, make_span_fact, qa_example

    enc, dec = _byte_qa_inputs(4, 64, 200)
    for seed in range(8):
        new_enc, ids, labels, align = qa_example(enc, dec, random.Random(seed), "d", 259, span=1.0)
        answer = bytes(ids[labels != -100].tolist()).decode().removesuffix("\n")
        body = bytes(new_enc.flatten().tolist()).decode(errors="replace")
        assert answer in body  # planted as the answer spells it
        value = answer.split('"')[1] if '"' in answer else answer.split(": ", 1)[1].rstrip(".")
        assert len(value) >= 3 and value in bytes(enc.flatten().tolist()).decode(), answer
        pos = (align >= 0).nonzero().flatten()
        assert torch.equal(new_enc.flatten()[align[pos]], ids[pos + 1])
    fact = make_span_fact(random.Random(0), "three small words")
    assert (
        "three small words" in fact.fact and fact.question.endswith("?") and not fact.fact.startswith("The ")
    )
    off = qa_example(enc, dec, random.Random(5), "d", 259, span=0.0)
    r = random.Random(5)
    facts = [make_fact(r).fact for _ in range(r.randint(1, 4))]  # the draws of a run without qa_span
    assert bytes(off[1][off[2] != -100].tolist()).decode().removesuffix("\n") in facts


def test_qa_span_tokens_sets_the_length_of_free_form_values(tmp_path):
    """qa_span_tokens: values of ``[min, max]`` tokens, crossing sentence ends inside the answer when long;
    the answer still restates the planted fact and ends the turn once; bad bounds are refused."""
    import random

    from cepe.training.synthetic_qa import ByteCodec, qa_example, span_value

    text = ("One clause ends here. Another, longer one follows it; then a third. " * 8).encode()[:512]
    stream = list(text)
    tok = ByteCodec()
    r = random.Random(0)
    lengths = [len(v) for v in (span_value(stream, r, tok, (40, 60)) for _ in range(50)) if v]
    assert lengths and min(lengths) >= 30 and max(lengths) <= 60
    assert any("." in v for v in (span_value(stream, r, tok, (40, 60)) for _ in range(20)) if v)
    short = [span_value(stream, r, tok) for _ in range(50)]
    assert max(len(v) for v in short if v) <= 10
    enc = torch.tensor(stream).reshape(8, 64)
    dec = torch.full((240,), ord("x"))
    crossed = 0
    for seed in range(12):
        new_enc, ids, labels, _ = qa_example(
            enc, dec, random.Random(seed), "d", 259, span=1.0, span_tokens=(40, 60)
        )
        answer = bytes(ids[labels != -100].tolist()).decode()
        assert answer in bytes(new_enc.flatten().tolist()).decode(errors="replace")
        crossed += answer.rstrip(".").count(".") > 0
    assert crossed > 0  # some answers hold a sentence end before their last one
    for bad in ([10, 3], [0, 4], [5]):
        with pytest.raises(ValueError, match="qa_span_tokens"):
            _mixed(tmp_path, qa_span_tokens=bad)


def _off_at_zero_and_bounded(tmp_path, enc, dec, arg: str, field: str) -> None:
    """A qa_example probability ``arg`` at 0 draws nothing (older runs unchanged), and the config field
    ``field`` refuses values outside [0, 1]."""
    import random

    from cepe.training.synthetic_qa import qa_example

    plain = [qa_example(enc, dec, random.Random(s), "d", 259) for s in range(3)]
    zero = [qa_example(enc, dec, random.Random(s), "d", 259, **{arg: 0.0}) for s in range(3)]
    assert all(torch.equal(a[1], b[1]) for a, b in zip(plain, zero))
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=field):
            _mixed(tmp_path, **{field: bad})


def test_qa_compound_facts_answer_with_the_whole_sentence(tmp_path):
    """qa_compound: two facts in one planted sentence, asked about the first; the answer restates the whole
    sentence (both clauses) with its attention targets on the planted copy; 0 draws nothing."""
    import random

    from cepe.training.synthetic_qa import Fact, compound_fact, make_fact, qa_example

    f = compound_fact(
        Fact("Mara Olsen was born in Porto.", "Where was Mara Olsen born?"), make_fact(random.Random(1))
    )
    assert (
        f.fact.startswith("Mara Olsen was born in Porto, and ") and f.question == "Where was Mara Olsen born?"
    )
    named = compound_fact(f, Fact("Kofi Varga owns 12 books.", "?"))
    assert named.fact.endswith(", and Kofi Varga owns 12 books.")  # a name keeps its capital
    lower = compound_fact(f, Fact("The access code for the mill in Fez is 4471.", "?"))
    assert lower.fact.endswith(", and the access code for the mill in Fez is 4471.")
    enc, dec = _byte_qa_inputs(8, 128, 240)  # room for four two-clause facts
    for seed in range(6):
        new_enc, ids, labels, align = qa_example(enc, dec, random.Random(seed), "d", 259, compound=1.0)
        answer = bytes(ids[labels != -100].tolist()).decode().removesuffix("\n")
        assert ", and " in answer and answer.count(".") >= 1
        assert answer in bytes(new_enc.flatten().tolist()).decode(errors="replace")
        pos = (align >= 0).nonzero().flatten()
        assert len(pos) > 0 and torch.equal(new_enc.flatten()[align[pos]], ids[pos + 1])
    _off_at_zero_and_bounded(tmp_path, enc, dec, "compound", "qa_compound")


def test_decoy_facts_open_with_the_asked_facts_words():
    """decoy_fact: the same opening two words (a name, or a template's words), another question."""
    import random

    from cepe.training.synthetic_qa import ByteCodec, Fact, decoy_fact

    stream = list(b"The river ran past the mill. Nobody crossed it in winter, and the ferry was slow.")
    asked = [
        Fact("Mara Olsen was born in Porto.", "Where was Mara Olsen born?"),
        Fact("The access code for the mill in Fez is 4471.", "What is the access code for the mill in Fez?"),
        Fact("A telegram to Kofi Varga said only: come home.", "What did the telegram to Kofi Varga say?"),
        Fact("The mill in Fez was built in 1410.", "When was the mill in Fez built?"),
    ]
    for fact in asked:
        for seed in range(5):
            decoy = decoy_fact(fact, random.Random(seed), stream, ByteCodec())
            assert decoy is not None and decoy.fact.split()[:2] == fact.fact.split()[:2]
            assert decoy.question != fact.question and decoy.fact != fact.fact
    assert decoy_fact(Fact("Zebras roam the plain.", "?"), random.Random(0), stream, ByteCodec()) is None


def test_qa_decoys_plant_the_answers_opening_more_than_once(tmp_path):
    """qa_decoys: the answer's opening words stand in the encoder at two or more planted facts, and the
    answer's attention targets are the asked fact's copy, token after token; 0 draws nothing."""
    import random

    from cepe.training.synthetic_qa import qa_example

    enc, dec = _byte_qa_inputs(8, 128, 200)
    for seed in range(6):
        new_enc, ids, labels, align = qa_example(enc, dec, random.Random(seed), "d", 259, decoys=1.0)
        answer = bytes(ids[labels != -100].tolist()).decode()
        text = bytes(new_enc.flatten().tolist()).decode(errors="replace")
        opening = " ".join(answer.split()[:2])
        assert text.count("\n" + opening) >= 2 and ("\n" + answer + "\n") in text
        pos = (align >= 0).nonzero().flatten()
        assert torch.equal(new_enc.flatten()[align[pos]], ids[pos + 1])
        assert torch.equal(align[pos], align[pos[0]] + torch.arange(len(pos)))  # one copy, in order
        assert len(pos) == len(answer)
    _off_at_zero_and_bounded(tmp_path, enc, dec, "decoys", "qa_decoys")


def test_qa_window_decoy_ends_the_decoders_text_with_the_answers_opening(tmp_path):
    """qa_window_decoy: the decoder's own text before the question ends with a line that opens with the
    answer's first words and goes on otherwise; the answer, its labels and its attention targets are those
    of the same draw without it; 0 draws nothing."""
    import random

    from cepe.training.synthetic_qa import ByteCodec, Fact, qa_example, window_decoy_line

    fact = Fact(
        "The access code for the mill in Fez is 4471.", "What is the access code for the mill in Fez?"
    )
    stream = list(b"The river ran past the mill. Nobody crossed it in winter, and the ferry was slow.")
    for seed in range(5):
        line = window_decoy_line(fact, random.Random(seed), stream, ByteCodec())
        assert line is not None and line.startswith("\n\nThe ")
        assert not fact.fact.startswith(line.strip().rstrip("."))
    enc, dec = _byte_qa_inputs(8, 128, 200)
    seen = 0
    for seed in range(6):
        new_enc, ids, labels, align = qa_example(enc, dec, random.Random(seed), "d", 259, window_decoy=1.0)
        plain = qa_example(enc, dec, random.Random(seed), "d", 259)  # the same draw without the line
        for mine, theirs in zip((new_enc, labels, align), (plain[0], plain[2], plain[3])):
            assert torch.equal(mine, theirs)
        changed = (ids != plain[1]).nonzero().flatten()  # only the decoder's own text before the question
        assert len(changed) == 0 or changed.max() < (labels != -100).nonzero().min()
        answer = bytes(ids[labels != -100].tolist()).decode()
        text = bytes(ids.tolist()).decode(errors="replace")
        before_question = text[: text.rindex("\n\n")]
        last = before_question[before_question.rindex("\n\n") + 2 :] if "\n\n" in before_question else ""
        if last:
            seen += 1
            assert last.split()[0] == answer.split()[0] and not answer.startswith(last.rstrip("."))
        pos = (align >= 0).nonzero().flatten()
        assert len(pos) > 0 and torch.equal(new_enc.flatten()[align[pos]], ids[pos + 1])
        assert len(ids) == len(dec) and (labels != -100).sum() == len(answer)
    assert seen >= 4
    _off_at_zero_and_bounded(tmp_path, enc, dec, "window_decoy", "qa_window_decoy")


class _WordCodec:
    """Splits text as byte-level BPE pre-tokenizers do (a word keeps its leading space, a line break is its
    own token), so a word after a line break is a different token from the same word after a space."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def encode(self, text, add_special_tokens=False):
        import re

        return [self.vocab.setdefault(p, len(self.vocab)) for p in re.findall(r"\n| ?[^\s]+", text)]


def test_broken_answer_respells_the_word_after_the_break():
    """broken_answer: one space becomes a line break; every token but the break copies a token of the
    unbroken spelling, the respelled word ("to" for " to") copying its unbroken self."""
    import random

    from cepe.training.synthetic_qa import broken_answer

    tok = _WordCodec()
    fact = "They prune the roses in March and feed them."
    ids = tok.encode(fact)
    seen = set()
    for seed in range(40):
        broken, source = broken_answer(tok, fact, ids, random.Random(seed))
        inv = {v: k for k, v in tok.vocab.items()}
        text = "".join(inv[t] for t in broken)
        assert text.count("\n") == 1 and text.replace("\n", " ") == fact
        assert source.count(-1) == 1 and inv[broken[source.index(-1)]] == "\n"
        for t, s in zip(broken, source):
            if s >= 0:
                assert inv[t].strip() == inv[ids[s]].strip()
        assert source[-1] == len(ids) - 1
        seen.add(text.index("\n"))
    assert len(seen) >= 5 and min(seen) > 0  # at many places, never before the first word
    assert broken_answer(tok, "Alone.", tok.encode("Alone."), random.Random(0)) is None


def test_qa_line_break_answers_skip_the_break_and_copy_on(tmp_path):
    """qa_line_break: the answer holds one line break, not scored and with no target; every scored answer
    token but the end of turn has its copy in the encoder as its target; 0 draws nothing."""
    import random

    from cepe.training.synthetic_qa import qa_example

    enc, dec = _byte_qa_inputs(8, 128, 200)
    for seed in range(6):
        new_enc, ids, labels, align = qa_example(enc, dec, random.Random(seed), "d", 259, line_break=1.0)
        answer = ids[(labels != -100).nonzero().min() :]
        assert answer.tolist().count(ord("\n")) == 1  # the byte stand-in has no end-of-turn token
        at = (ids == ord("\n")).nonzero().flatten()[-1]
        assert labels[at] == -100 and align[at - 1] == -1
        pos = (align >= 0).nonzero().flatten()
        assert len(pos) >= len(answer) - 2 and torch.equal(new_enc.flatten()[align[pos]], ids[pos + 1])
        assert (
            bytes(answer.tolist()).decode().replace("\n", " ") in bytes(new_enc.flatten().tolist()).decode()
        )
    _off_at_zero_and_bounded(tmp_path, enc, dec, "line_break", "qa_line_break")


def test_training_facts_are_not_the_evaluations_templates():
    """The QA / RULER evaluations plant "The <attribute> of <person> is <value>." with four attributes,
    and the needle tasks their own sentences; training facts never take those forms."""
    import random
    import re

    from cepe.eval.tasks.needle import Config as NeedleConfig
    from cepe.eval.tasks.qa import _ATTRIBUTES as QA_ATTRIBUTES
    from cepe.training.synthetic_qa import compound_fact, make_fact, make_span_fact

    r = random.Random(0)
    facts = [make_fact(r) for _ in range(500)] + [make_fact(r, 6) for _ in range(100)]
    spans = [make_span_fact(r, v) for v in ("of the house is empty", "is the colour of", "secret") * 20]
    spans += [compound_fact(make_fact(r), make_fact(r)) for _ in range(200)]
    attrs = {a for a, _ in QA_ATTRIBUTES}
    needle = NeedleConfig()
    for f in facts:
        assert not re.fullmatch(r"The .+ of .+ is .+\.", f.fact), f.fact
        assert not any(a in f.fact or a in f.question for a in attrs), f.fact
        assert f.question != needle.question and f.fact != needle.needle
    assert len({f.fact for f in facts}) > 580  # little repetition: answers cannot be memorised
    for f in spans:  # free-form values, even ones with "of" and "is" in them, keep the forms apart
        assert not re.fullmatch(r"The .+ of .+ is .+\.", f.fact), f.fact
        assert f.question != needle.question and f.fact != needle.needle


def _icl_families():
    import numpy as np

    from cepe.training.synthetic_icl import families_from_documents

    docs = [
        (f"lib/{c}/{i}.py", "lib", np.full(700, ord(c[0])))
        for c in ("alpha", "beta", "gamma")
        for i in range(2)
    ]
    docs.append(("lib/delta/0.py", "lib", np.full(300, ord("d"))))  # too few tokens: not a class
    docs.append(("other/one", "other", np.full(50, ord("o"))))
    return families_from_documents(docs)


def test_icl_examples_label_demonstrations_consistently():
    """icl: demonstrations one per chunk from the first, every snippet of a class labelled with the same
    word (its own name or an arbitrary one, one per class), only the decoder's complete labels scored, and
    neither the evaluation's template nor its labels."""
    import random

    from cepe.data.corpora import BBC_LABELS
    from cepe.training.synthetic_icl import HEADS, KEYS, LABEL_WORDS, icl_example
    from cepe.training.synthetic_qa import ByteCodec

    fams = _icl_families()
    assert [(f.name, sorted(f.classes)) for f in fams] == [("lib-sub", ["alpha", "beta", "gamma"])]
    assert not {"Article", "Topic"} & set(HEADS + KEYS) and not set(BBC_LABELS) & set(LABEL_WORDS)
    tok, arbitrary, ks = ByteCodec(), 0, set()
    for seed in range(30):
        enc, mask, dec, labels, align = icl_example(fams, 5, 64, 300, random.Random(seed), tok)
        assert enc.shape == mask.shape == (5, 64) and dec.shape == labels.shape == align.shape == (300,)
        k = int(mask.any(-1).sum())
        ks.add(k)
        assert mask[:k].any(-1).all() and not mask[k:].any()
        for row in mask[:k]:  # each chunk: one demonstration from its start
            assert row[: int(row.sum())].all()
        demos = [tok.decode(enc[j][mask[j]].tolist()) for j in range(k)]
        text = tok.decode(dec.tolist())
        seen: dict[str, str] = {}
        for d in demos + [text]:
            for head in HEADS:
                d = d.replace(f"{head}: ", "\x00")
            for part in d.split("\x00")[1:]:
                if not part.endswith("\n"):  # the decoder's last demonstration, cut at n
                    continue
                body, _, rest = part.partition("\n")
                key, _, label = rest.partition(": ")
                assert key in KEYS and body and set(body) == {body[0]}, part
                assert seen.setdefault(body[0], label.strip()) == label.strip(), (seed, part)
        assert len(set(seen.values())) == len(seen) >= 2
        arbitrary += any(w in LABEL_WORDS for w in seen.values())

        # attention targets: before every scored label token whose class has a demonstration in the
        # encoder, at the same token of the latest such demonstration's label; nowhere else
        def body_class(ids: list[int]) -> str:
            t = tok.decode(ids)
            for head in HEADS:
                t = t.replace(f"{head}: ", "\x00")
            return t.split("\x00")[-1][:1]

        bodies = [body_class(enc[j][mask[j]].tolist()) for j in range(k)]
        at = (align >= 0).nonzero()[:, 0]
        assert (labels[at + 1] != -100).all() and torch.equal(enc.reshape(-1)[align[at]], dec[at + 1])
        for t in range(299):
            if labels[t + 1] == -100:
                continue
            cls = body_class(dec[: t + 1].tolist())
            if cls not in bodies:
                assert align[t] == -1, (seed, t)
                continue
            assert align[t] >= 0 and int(align[t]) // 64 == max(j for j, b in enumerate(bodies) if b == cls)
        scored = tok.decode(dec[labels != -100].tolist()).split()
        assert scored and all(w in seen.values() for w in scored)
        again = icl_example(fams, 5, 64, 300, random.Random(seed), tok, scored=2)
        info: dict = {}
        icl_example(fams, 5, 64, 300, random.Random(seed), tok, info=info)  # the same example, described
        assert info["encoder_classes"][:k] == info["encoder_classes"] and len(info["encoder_classes"]) == k
        spans = [t for t in range(1, 300) if labels[t] != -100 and labels[t - 1] == -100]
        assert len(spans) == len(info["scored_classes"])
        for t, c in zip(spans, info["scored_classes"]):
            lab = info["label_ids"][c]
            assert dec[t : t + len(lab)].tolist() == lab
        named = icl_example(fams, 5, 64, 300, random.Random(seed), tok, arbitrary=1.0)
        assert all(w in LABEL_WORDS for w in tok.decode(named[2][named[3] != -100].tolist()).split())
        assert torch.equal(again[2], dec)  # the same example, fewer labels scored
        starts = (again[3] != -100).int().diff().eq(1).sum() + int(again[3][0] != -100)
        assert int(starts) == min(2, len(scored)) and set(again[3][again[3] != -100].tolist()) <= set(
            labels[labels != -100].tolist()
        )
    assert 5 < arbitrary < 25 and len(ks) >= 4


def _icl_stage() -> dict:
    """A tiny mixed stage with icl examples on synthetic data (byte vocabulary, 3 chunks of 64, 96 decoder
    tokens, 2 steps of 2)."""
    tiny = {**yaml.safe_load(open("configs/train/tiny/cepe.yaml"))["tiny_decoder"], "vocab_size": 256}
    return dict(
        tiny_decoder=tiny,
        data={"synthetic": "random"},
        tasks={"lm": 1, "icl": 3},
        chunk_length=64,
        n_chunks=3,
        n_decoder=96,
        steps=2,
        batch_size=2,
        micro_batch_size=2,
    )


def test_mixed_stage_trains_icl_examples(tmp_path):
    """icl in a mixed stage: synthetic classes on synthetic data, the CEPE shapes, labels scored, context
    at 0 for the online teacher, and a few training steps with the teacher's KL."""
    from cepe.training.data import example_task

    cfg = _mixed(tmp_path, align_coef=0.0, online_teacher=True, top_k=8, kl_coef=1.0, **_icl_stage())
    src = window_source(cfg, 256)
    kinds = set()
    for i in range(12):
        ex, kind = build_example(cfg, src[i], i, None), example_task(cfg, i)
        kinds.add(kind)
        assert ex["encoder_input_ids"].shape == (3, 64) and ex["input_ids"].shape == (96,)
        if kind == "icl":
            assert (ex["labels"] != -100).any() and int(ex["context_at"]) == 0
            assert ex["encoder_attention_mask"][0].any()
    assert kinds == {"lm", "icl"}
    out = train(cfg)
    rows = read_log(out)
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)


def test_icl_align_supervises_attention_on_labels(tmp_path):
    """icl_align: icl examples carry attention targets (the same label token in the encoder) and a run
    with them logs the attention loss; without align_coef the option is refused."""
    from cepe.training.data import example_task

    kw = _icl_stage()
    with pytest.raises(ValueError, match="icl_align .* align_coef"):
        _mixed(tmp_path, align_coef=0.0, icl_align=True, **kw)
    cfg = _mixed(tmp_path, align_coef=0.5, icl_align=True, icl_arbitrary=1.0, **kw)
    src = window_source(cfg, 256)
    targets = 0
    for i in range(12):
        ex = build_example(cfg, src[i], i, None)
        if example_task(cfg, i) != "icl":
            continue
        t = (ex["align_targets"] >= 0).nonzero()[:, 0]
        flat = ex["encoder_input_ids"].reshape(-1)
        assert torch.equal(flat[ex["align_targets"][t]], ex["input_ids"][t + 1])
        assert ex["encoder_attention_mask"].reshape(-1)[ex["align_targets"][t]].all()
        targets += t.numel()
    assert targets > 0
    rows = read_log(train(cfg))
    assert len(rows) == 2 and all("align" in r and r["align"] > 0 for r in rows)


def test_packed_positions_follow_pack_keys():
    """Attention targets given in the unpacked K·L layout point at the same states after key packing."""
    from cepe.modeling import pack_keys, packed_positions

    g = torch.Generator().manual_seed(0)
    for b in (1, 3):
        mask = torch.rand(b, 40, generator=g) < 0.6
        states = torch.arange(b * 40, dtype=torch.float32).view(b, 40, 1)
        pos = torch.full((b, 7), -1)
        for i in range(b):
            real = mask[i].nonzero()[:, 0]
            pos[i, :5] = real[torch.randint(0, real.numel(), (5,), generator=g)]
        packed, _ = pack_keys(states, mask, mask.sum(-1))
        new = packed_positions(mask, pos)
        assert (new[:, 5:] == -1).all()
        assert torch.equal(packed.gather(1, new[:, :5, None]), states.gather(1, pos[:, :5, None]))
    full = torch.ones(2, 40, dtype=torch.bool)
    full[1, 3] = False  # no packing when one example has no padding: positions unchanged
    assert torch.equal(packed_positions(full, pos[:1].repeat(2, 1)), pos[:1].repeat(2, 1))


def test_chunk_lengths_regroup_the_encoder_per_micro_batch(tmp_path):
    """chunk_lengths: the encoder's K·L tokens cut into chunks of another length (same tokens, masks and
    flat attention targets), the length drawn per micro-batch and seeded by the step (exact resume); a
    list holding only L changes nothing; other lengths change the losses."""
    from cepe.training.data import collate, regroup_chunks, step_chunk_length

    cfg = _mixed(tmp_path, chunk_lengths=[4, 16])
    src = window_source(cfg, 128)
    batch = collate([build_example(cfg, src[i], i, None) for i in range(3)])
    for length in (4, 16, 32):
        out = regroup_chunks(batch, length)
        assert out["encoder_input_ids"].shape == (3, 32 // length, length)
        assert torch.equal(out["encoder_input_ids"].reshape(3, -1), batch["encoder_input_ids"].reshape(3, -1))
        assert torch.equal(
            out["encoder_attention_mask"].reshape(3, -1), batch["encoder_attention_mask"].reshape(3, -1)
        )
        assert out["align_targets"] is batch["align_targets"] and out["input_ids"] is batch["input_ids"]
    with pytest.raises(ValueError, match="do not tile"):
        regroup_chunks(batch, 5)
    _assert_draws(tmp_path, cfg, step_chunk_length, {4, 16})
    for over, msg in (
        ({"chunk_lengths": [4, 12]}, "divisors of n_chunks"),
        ({"chunk_lengths": []}, "divisors"),
    ):
        with pytest.raises(ValueError, match=msg):
            _mixed(tmp_path, **over)
    with pytest.raises(ValueError, match="chunk_lengths regroups"):
        _cfg(tmp_path, chunk_lengths=[4])

    _assert_drawn_per_micro_batch(tmp_path, {"chunk_lengths": [8]}, {"chunk_lengths": [4, 16]})


def test_decoder_lengths_build_each_micro_batch_at_its_own_decoder_length(tmp_path):
    """decoder_lengths: a micro-batch's examples are built at a decoder length drawn per micro-batch
    (seeded by the step: exact resume) from the window's last K·L + n tokens, so encoder and decoder stay
    contiguous and recall ends at the shorter decoder's end; a list holding only n_decoder changes nothing."""
    from cepe.training.data import at_layout, step_decoder_length, step_layout
    from cepe.training.speed import step_flops

    cfg = _mixed(tmp_path, tasks={"lm": 1, "recall": 1}, chunk_noise=0.0, decoder_lengths=[20, 32])
    src = window_source(cfg, 128)
    kl = cfg.n_chunks * cfg.chunk_length
    for i in range(12):
        c, w = at_layout(cfg, src[i], 20)
        assert c.n_decoder == 20 and c.decoder_lengths is None and w.shape == (kl + 20,)
        ex = build_example(c, w, i, None)
        assert ex["input_ids"].shape == (20,) and ex["encoder_input_ids"].shape == (
            cfg.n_chunks,
            cfg.chunk_length,
        )
        window = torch.as_tensor(src[i])
        assert torch.equal(
            ex["encoder_input_ids"].flatten(), window[-(kl + 20) : -20]
        )  # contiguous with the decoder
        if int(ex["task"]) == 0:  # lm: the window's last 20 tokens
            assert torch.equal(ex["input_ids"], window[-20:])
        else:  # recall: the span ends at the decoder's end, its targets in the encoder
            al = ex["align_targets"]
            assert al[-2] >= 0 and al[-1] == -1
            assert ex["input_ids"][-1] == ex["encoder_input_ids"].flatten()[al[-2]]
    w0 = src[0]
    for n in (32, None):  # the full length: config and window as they are
        c, w = at_layout(cfg, w0, n)
        assert c is cfg and w is w0
    _assert_draws(tmp_path, cfg, step_decoder_length, {20, 32})
    assert {step_layout(cfg, s, 0) for s in range(20)} == {(20, None), (32, None)}
    assert step_flops(cfg, build_model(cfg))["decoder_tokens"] == cfg.batch_size * 26  # the mean length
    for over, msg in (
        ({"decoder_lengths": [20, 40]}, "from 1 to n_decoder = 32"),
        ({"decoder_lengths": []}, "non-empty"),
        ({"decoder_lengths": [8]}, "with 8 decoder tokens, recall_cue"),
    ):
        with pytest.raises(ValueError, match=msg):
            _mixed(tmp_path, **over)

    _assert_drawn_per_micro_batch(tmp_path, {"decoder_lengths": [32]}, {"decoder_lengths": [20, 32]})


def test_context_chunks_build_each_micro_batch_with_its_own_chunk_count(tmp_path):
    """context_chunks: a micro-batch's examples are built with an encoder chunk count drawn per
    micro-batch (seeded by the step: exact resume) from the window's last k·L + n tokens, so encoder and
    decoder stay contiguous and a shorter context is encoded at its own cost; drawn independently of
    decoder_lengths, regrouped by chunk_lengths; a list holding only n_chunks changes nothing."""
    from cepe.training.data import at_layout, step_context_chunks, step_layout
    from cepe.training.speed import step_flops

    cfg = _mixed(tmp_path, tasks={"lm": 1, "recall": 1}, chunk_noise=0.0, context_chunks=[2, 4])
    src = window_source(cfg, 128)
    n, length = cfg.n_decoder, cfg.chunk_length
    kinds = set()
    for i in range(12):
        c, w = at_layout(cfg, src[i], n_chunks=2)
        assert c.n_chunks == 2 and c.context_chunks is None and w.shape == (2 * length + n,)
        ex = build_example(c, w, i, None)
        assert ex["input_ids"].shape == (n,) and ex["encoder_input_ids"].shape == (2, length)
        window = torch.as_tensor(src[i])
        assert torch.equal(ex["encoder_input_ids"].flatten(), window[-(2 * length + n) : -n])
        kinds.add(int(ex["task"]))
        if int(ex["task"]) == 0:  # lm: the window's last n tokens
            assert torch.equal(ex["input_ids"], window[-n:])
        else:  # recall: its targets in the two chunks the example has
            al = ex["align_targets"]
            assert al[-2] >= 0 and al[-1] == -1 and int(al.max()) < 2 * length
            assert ex["input_ids"][-1] == ex["encoder_input_ids"].flatten()[al[-2]]
    assert kinds == {0, 2}
    both = _mixed(tmp_path, tasks={"lm": 1, "recall": 1}, decoder_lengths=[20, 32], context_chunks=[2, 4])
    c, w = at_layout(both, src[0], 20, 2)
    assert (c.n_decoder, c.n_chunks, c.decoder_lengths, c.context_chunks) == (20, 2, None, None)
    assert torch.equal(torch.as_tensor(w), torch.as_tensor(src[0])[-(2 * length + 20) :])
    w0 = src[0]
    for k in (4, None):  # the full count: config and window as they are
        c, w = at_layout(cfg, w0, None, k)
        assert c is cfg and w is w0
    _assert_draws(tmp_path, cfg, step_context_chunks, {2, 4})
    assert {step_layout(cfg, s, 0) for s in range(20)} == {(None, 2), (None, 4)}
    flops = step_flops(cfg, build_model(cfg))
    assert flops["encoder_tokens"] == cfg.batch_size * 3 * length  # the mean count
    assert flops["total"] < step_flops(_mixed(tmp_path), build_model(cfg))["total"]
    for over, msg in (
        ({"context_chunks": [2, 5]}, "from 1 to n_chunks = 4"),
        ({"context_chunks": []}, "non-empty"),
        ({"context_chunks": [1]}, "with 1 chunks and 32 decoder tokens, recall_cue"),
        ({"context_chunks": [3], "chunk_lengths": [16]}, "with 3 chunks .* chunk_lengths must be divisors"),
        (
            {"context_chunks": [2], "stage": "ceped", "tasks": None, "align_coef": 0.0},
            "context_chunks varies the encoder of the cepe stage",
        ),
    ):
        with pytest.raises(ValueError, match=msg):
            _mixed(tmp_path, **over)

    _assert_drawn_per_micro_batch(
        tmp_path, {"context_chunks": [4]}, {"context_chunks": [2, 4], "chunk_lengths": [8, 16]}
    )


def test_stop_after_ends_the_process_and_resumes_exactly(tmp_path):
    """stop_after: the run checkpoints and ends after that step with the schedule of ``steps`` (no
    artifact yet, status "stopped"); resumed without it, its losses are the uninterrupted run's."""
    from cepe.training.runctl import read_status

    whole = read_log(train(_cfg(tmp_path, steps=4, output_dir=str(tmp_path / "whole"))))
    part = _cfg(tmp_path, steps=4, stop_after=2, output_dir=str(tmp_path / "part"))
    assert part.fingerprint() == _cfg(tmp_path, steps=4).fingerprint()
    out = train(part)
    assert [r["step"] for r in read_log(out)] == [1, 2]
    assert read_status(out)["state"] == "stopped" and read_status(out)["step"] == 2
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002"]
    assert not (out / "adapter_model.safetensors").exists()
    assert [r["step"] for r in read_log(train(part, resume=True))] == [1, 2]  # nothing left before step 2
    rest = train(_cfg(tmp_path, steps=4, output_dir=str(tmp_path / "part")), resume=True)
    assert [r["loss"] for r in read_log(rest)] == [r["loss"] for r in whole]
    assert (rest / "adapter_model.safetensors").exists()
    with pytest.raises(ValueError, match="stop_after must be"):
        _cfg(tmp_path, stop_after=0)


def test_recall_foreign_trains(tmp_path):
    """The trainer hands recall examples their foreign window: a run with ``recall_foreign`` trains, and
    its recall losses differ from the same run's without it while its other kinds' match."""
    plain = read_log(train(_mixed(tmp_path, steps=2, output_dir=str(tmp_path / "plain"))))
    foreign = read_log(train(_mixed(tmp_path, steps=2, recall_foreign=1.0, output_dir=str(tmp_path / "f"))))
    first = [(a, b) for a, b in zip(plain, foreign)][0]
    assert "lm_recall" in first[0] and first[0]["lm_recall"] != first[1]["lm_recall"]
    assert first[0]["lm_lm"] == first[1]["lm_lm"]


def test_projection_fitted_to_the_training_split(tmp_path):
    """``projection_fit_tokens`` fits a new adapter's down-projection to the encoder's states on the start
    of the training split (not the weights-only init), and is refused where it cannot apply."""
    from cepe.data.tokenized import ShardWriter

    g = torch.Generator().manual_seed(0)
    with ShardWriter(tmp_path / "tok", eos_id=0, vocab_size=128, shard_tokens=64) as w:
        for d in range(4):
            w.add("train", f"doc{d}", "text", (torch.randint(1, 40, (100,), generator=g) * 3).tolist())
    over = dict(
        encoder_init="decoder",
        encoder={"num_hidden_layers": 1, "causal": True, "output_size": 16},
        cepe={"init_mode": "gate", "mirror_self_attention": True},
        data={"corpus": str(tmp_path / "tok")},
    )
    plain = build_model(_cfg(tmp_path, **over))
    fitted = build_model(_cfg(tmp_path, projection_fit_tokens=256, **over))
    assert plain.encoder.out_proj.weight.shape == (16, 64)
    assert not torch.allclose(plain.encoder.out_proj.weight, fitted.encoder.out_proj.weight, atol=1e-3)
    ids = torch.arange(1, 25).view(1, 3, 8)
    with torch.no_grad():  # no context, or zero gates: still exactly the decoder
        base = fitted.decoder(input_ids=ids[:, 0]).logits
        torch.testing.assert_close(fitted(ids[:, 0], encoder_input_ids=ids).logits, base, atol=0, rtol=0)
    assert (
        _cfg(tmp_path, **over).fingerprint()
        != _cfg(tmp_path, projection_fit_tokens=256, **over).fingerprint()
    )
    with pytest.raises(ValueError, match="output_size"):
        _cfg(tmp_path, projection_fit_tokens=256, **{**over, "encoder": {"num_hidden_layers": 1}})
    with pytest.raises(ValueError, match="data.corpus"):
        _cfg(tmp_path, projection_fit_tokens=256, **{**over, "data": {"synthetic": "random"}})


def test_mixed_stage_with_the_output_mixture_logs_each_kind_from_one_pass(tmp_path):
    """With ``output_mix`` the per-kind losses come from one pass over every scored position; each equals
    the mixture's loss over that kind's rows alone, and the training loss is their token-weighted mean."""
    from cepe.training.data import build_example, collate, window_source
    from cepe.training.models import StageModule, build_model
    from cepe.training.speed import lm_loss

    cfg = _mixed(tmp_path, cepe={"output_mix": True})
    model = build_model(cfg)
    with torch.no_grad():
        model.mix_head.weight.normal_(0, 0.1)
        for m in model.cross_attention_modules():
            m.o_proj.weight.normal_(0, 0.1)
    module = StageModule(model, cfg)
    src = window_source(cfg, 64)
    batch = collate([build_example(cfg, src[i], i, None) for i in range(6)])
    batch.pop("index")
    with torch.no_grad():
        loss, metrics = module(batch)
        module.release()
        ctx = model.prepare_context(batch["encoder_input_ids"], batch["encoder_attention_mask"])
        base = model.decoder.get_decoder()
        with model.use_context(ctx):
            hidden = base(input_ids=batch["input_ids"]).last_hidden_state
        alone = base(input_ids=batch["input_ids"]).last_hidden_state
    kinds = batch["task"]
    assert len(set(kinds.tolist())) > 1
    for i, name in enumerate(("lm", "copy", "recall")):
        rows = kinds == i
        if bool(rows.any()):
            want = lm_loss(model, hidden[rows], batch["labels"][rows], module._head, False, alone[rows])
            torch.testing.assert_close(metrics[f"lm_{name}"], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(metrics["lm"], loss - cfg.align_coef * metrics["align"], rtol=1e-5, atol=1e-5)


def test_a_steps_examples_do_not_depend_on_the_number_of_processes(tmp_path):
    """Each example's layout (decoder length, chunk count, chunk length) follows its micro-batch's place in
    the step, as its index does: two processes build what one builds (before, the draws were per
    process-local micro-batch, so two processes shared draws that one process drew apart)."""
    from cepe.training.trainer import example_maker, micro_batch

    cfg = _mixed(
        tmp_path, micro_batch_size=2, chunk_noise=0.0, decoder_lengths=[20, 32], context_chunks=[2, 4]
    )
    make = example_maker(cfg)

    def shapes(world: int) -> dict[int, tuple]:
        out = {}
        for step in range(6):
            for rank in range(world):
                for micro in range(cfg.batch_size // (cfg.micro_batch_size * world)):
                    b = micro_batch(cfg, make, step, micro, rank, world, keep_index=True)
                    for j, i in enumerate(b["index"].tolist()):
                        out[i] = (tuple(b["input_ids"][j].shape), tuple(b["encoder_input_ids"][j].shape))
        return out

    one = shapes(1)
    assert len(one) == 6 * cfg.batch_size and len(set(one.values())) > 1
    assert shapes(2) == one
