"""An earlier CEPE adapter as the online CEPED teacher (``teacher_adapter``), and the teacher limited to
short contexts (``teacher_max_context``)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from test_train_online_teacher import _cfg as online_cfg
from test_train_online_teacher import assert_plain_kl_and_ce

from cepe.chunking import chunk_ids
from cepe.training.data import build_example, collate, window_source
from cepe.training.losses import teacher_topk
from cepe.training.models import StageModule, build_model, load_teacher, select_trainable
from cepe.training.online_teacher import adapter_teacher_topk, online_teacher_topk
from cepe.training.trainer import read_log, train


def _cfg(tmp_path, **over):
    """The online teacher tests' tiny config, without chunk noise (the student reads what it is given)."""
    return online_cfg(tmp_path, **{"chunk_noise": 0.0, **over})


def _open_gates(model, value: float = 0.5) -> None:
    with torch.no_grad():
        for m in model.cross_attention_modules():
            for name, p in m.named_parameters():
                if "gate" in name:
                    p.fill_(value)


def _saved(model, path, chunk_length: int | None = None):
    """``model`` saved as an adapter directory (with another chunk length where given)."""
    model = copy.deepcopy(model)
    if chunk_length is not None:
        model.cepe_config.chunk_length = chunk_length
    model.save_pretrained(path)
    return str(path)


def _teacher_args(batch):
    """The batch's arguments of the teacher functions, with k = 16."""
    keys = ("input_ids", "labels", "encoder_input_ids", "encoder_attention_mask")
    return (*(batch[k] for k in keys), 16)


def _batch(cfg, n: int = 4):
    src = window_source(cfg, 128)
    batch = collate([build_example(cfg, src[i], i, None) for i in range(n)])
    batch.pop("index")
    return batch


def test_adapter_teacher_reads_the_kept_context_in_its_own_chunks(tmp_path):
    """Row t of a selected example is the teacher adapter's own distribution of token t+1 when it reads
    exactly the encoder tokens the mask keeps, in order, cut into its own chunk length; unselected
    examples and unscored rows stay zeros."""
    cfg = _cfg(tmp_path)
    model = build_model(cfg)
    _open_gates(model)
    teacher = load_teacher(_cfg(tmp_path, teacher_adapter=_saved(model, tmp_path / "t", chunk_length=5)))
    assert teacher.cepe_config.chunk_length == 5
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (3, 12), generator=g)
    enc = torch.randint(0, 128, (3, 3, 8), generator=g)
    mask = torch.ones(3, 3, 8, dtype=torch.bool)
    mask[0, 1, 3:] = False  # a suffix of a chunk removed
    mask[1, :2] = False  # only the last chunk kept
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, :7] = -100
    select = torch.tensor([True, True, False])
    kept = []  # the positions the teacher's head ran on: those scored in some selected row (rows 2-10)
    run = teacher.forward

    def counted(*args, **kwargs):
        out = run(*args, **kwargs)
        kept.append(out.logits.shape[1])
        return out

    teacher.forward = counted
    probs, idx = adapter_teacher_topk(teacher, ids, labels, enc, mask, 16, select=select)
    del teacher.forward
    assert kept[0] == 9
    assert probs.shape == idx.shape == (3, 11, 16)
    assert not probs[2].any() and not idx[2].any()
    for i in range(2):
        chunks, cmask = chunk_ids(enc[i][mask[i]], 5)
        with torch.no_grad():
            logits = teacher(
                ids[i : i + 1], encoder_input_ids=chunks[None], encoder_attention_mask=cmask[None]
            )
        for t in range(11):
            if labels[i, t + 1] == -100:
                assert not probs[i, t].any()
                continue
            p, j = teacher_topk(logits.logits[0, t], 16)
            torch.testing.assert_close(probs[i, t], p, atol=2e-3, rtol=1e-2)
            assert torch.equal(idx[i, t, :4], j[:4].long())
    # the same tokens in the student's chunking give another function: the re-chunking is real
    with torch.no_grad():
        own = teacher(ids[:1], encoder_input_ids=enc[:1], encoder_attention_mask=mask[:1]).logits[0, 0]
    assert not torch.allclose(teacher_topk(own, 16)[0], probs[0, 0], atol=1e-3)


def test_kl_vanishes_when_the_teacher_is_the_student(tmp_path):
    """Taught by its own weights, read in the same chunks, the student's KL is only the fp16 rounding of
    the stored probabilities; taught by the same adapter with closed gates (the decoder alone), it is the
    context's real effect. The teacher is no part of the module's parameters or state."""
    cfg = _cfg(tmp_path)
    model = build_model(cfg)
    _open_gates(model)
    closed = copy.deepcopy(model)
    _open_gates(closed, 0.0)
    batch = _batch(cfg)
    same = _cfg(tmp_path, teacher_adapter=_saved(model, tmp_path / "same"))
    module = StageModule(model, same)
    loss, metrics = module(batch)
    module.release()
    assert float(metrics["kl"]) < 2e-3
    torch.testing.assert_close(loss, same.ce_coef * metrics["lm"] + same.kl_coef * metrics["kl"])
    other = StageModule(model, _cfg(tmp_path, teacher_adapter=_saved(closed, tmp_path / "closed")))
    _, m2 = other(batch)
    other.release()
    assert float(m2["kl"]) > 20 * float(metrics["kl"])
    plain = StageModule(model, _cfg(tmp_path))
    assert list(module.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in module.named_parameters()] == [n for n, _ in plain.named_parameters()]


def test_teacher_max_context_teaches_only_the_short_contexts(tmp_path):
    """teacher_max_context: the KL is the plain one over the scored rows of examples whose kept context is
    at most that long; the CE still covers every example; the decoder teacher obeys it too."""
    cfg = _cfg(tmp_path, context_drop=1.0)  # lm examples keep 1..4 chunks of 8
    model = build_model(cfg)
    _open_gates(model)
    batch = _batch(cfg, 8)
    kept = batch["encoder_attention_mask"].flatten(1).sum(-1)
    short = kept <= 16
    assert 0 < int(short.sum()) < 8, kept
    path = _saved(model, tmp_path / "t")
    _open_gates(model, 0.25)  # the student differs from its teacher
    capped = _cfg(tmp_path, context_drop=1.0, teacher_adapter=path, teacher_max_context=16)
    module = StageModule(model, capped)
    _, metrics = module(batch)
    module.release()
    args = _teacher_args(batch)
    probs, idx = adapter_teacher_topk(module._teacher[0], *args, select=short)
    kl = assert_plain_kl_and_ce(model, batch, probs, idx, short, capped.kl_form, metrics)
    assert float(kl) > 0.01
    uncapped = StageModule(model, _cfg(tmp_path, context_drop=1.0, teacher_adapter=path))
    _, every = uncapped(batch)
    uncapped.release()
    assert abs(float(every["kl"]) - float(kl)) > 1e-4
    # the decoder as the teacher, limited the same way: a different KL from the decoder teaching all
    dec_capped = StageModule(model, _cfg(tmp_path, context_drop=1.0, teacher_max_context=16))
    _, dc = dec_capped(batch)
    dec_capped.release()
    dec_all = StageModule(model, _cfg(tmp_path, context_drop=1.0))
    _, da = dec_all(batch)
    dec_all.release()
    assert abs(float(dc["kl"]) - float(da["kl"])) > 1e-4
    # CEPED: the KL over the same rows (the untaught examples' zero rows are no teacher)
    ceped = StageModule(model, _cfg(tmp_path, stage="ceped", context_drop=1.0, teacher_max_context=16))
    _, got = ceped(batch)
    ceped.release()
    dprobs, didx = online_teacher_topk(
        model.decoder,
        *_teacher_args(batch),
        batch.get("context_at"),
        short,
        model.decoder.config.max_position_embeddings,
    )
    assert_plain_kl_and_ce(model, batch, dprobs, didx, short, capped.kl_form, got, ce_key="ce")


def test_adapter_teacher_trains_and_resumes_exactly(tmp_path):
    model = build_model(_cfg(tmp_path))
    _open_gates(model)
    path = _saved(model, tmp_path / "t")
    cfg = _cfg(
        tmp_path, steps=4, save_every=2, teacher_adapter=path, teacher_max_context=24, context_drop=0.5
    )
    log = read_log(train(cfg))
    assert len(log) == 4 and all("kl" in r and "lm" in r for r in log)
    again = _cfg(
        tmp_path,
        steps=4,
        save_every=2,
        teacher_adapter=path,
        teacher_max_context=24,
        context_drop=0.5,
        output_dir=str(tmp_path / "again"),
    )
    train(again)
    import shutil

    shutil.rmtree(tmp_path / "again" / "checkpoints" / "step_000004")
    resumed = read_log(train(again, resume=True))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in log]


def test_teacher_drop_mixture_teaches_with_the_reader_alone(tmp_path):
    """A teacher with an output mixture teaches its mixture; with teacher_drop_mixture its reader alone,
    which is the adapter saved without the mixture."""
    cfg = _cfg(tmp_path)
    model = build_model(cfg)
    _open_gates(model)
    reader = _saved(model, tmp_path / "reader")
    mixed = copy.deepcopy(model)
    mixed.enable_output_mix(2, hidden=False)
    with torch.no_grad():
        mixed.mix_head.bias.fill_(1.0)  # the mixture leans on one side: it differs from the reader
    path = _saved(mixed, tmp_path / "mixed")
    batch = _batch(cfg)
    args = _teacher_args(batch)
    with_mix = load_teacher(_cfg(tmp_path, teacher_adapter=path))
    dropped = load_teacher(_cfg(tmp_path, teacher_adapter=path, teacher_drop_mixture=True))
    alone = load_teacher(_cfg(tmp_path, teacher_adapter=reader))
    assert with_mix.cepe_config.output_mix and not dropped.cepe_config.output_mix
    p_mix, _ = adapter_teacher_topk(with_mix, *args)
    p_drop, i_drop = adapter_teacher_topk(dropped, *args)
    p_alone, i_alone = adapter_teacher_topk(alone, *args)
    torch.testing.assert_close(p_drop, p_alone)
    assert torch.equal(i_drop, i_alone)
    assert not torch.allclose(p_mix, p_drop, atol=1e-3)


def test_adapter_teacher_config(tmp_path):
    base = _cfg(tmp_path)
    path = _saved(build_model(base), tmp_path / "t")
    taught = _cfg(tmp_path, teacher_adapter=path)
    assert taught.fingerprint() != base.fingerprint()
    assert (
        _cfg(tmp_path, teacher_adapter=path, teacher_drop_mixture=True).fingerprint() != taught.fingerprint()
    )
    assert _cfg(tmp_path, teacher_max_context=16).fingerprint() != base.fingerprint()
    for key in ("teacher_adapter", "teacher_drop_mixture", "teacher_max_context"):
        assert key not in base.to_dict() or base.fingerprint() == _cfg(tmp_path, **{key: None}).fingerprint()
    with pytest.raises(ValueError, match="need online_teacher: true"):
        _cfg(tmp_path, online_teacher=False, teacher_adapter=path)
    with pytest.raises(ValueError, match="need online_teacher: true"):
        _cfg(tmp_path, online_teacher=False, teacher_max_context=16)
    with pytest.raises(ValueError, match="it needs teacher_adapter"):
        _cfg(tmp_path, teacher_drop_mixture=True)
    for bad, said in ((0, "positive token count"), (-5, "positive token count"), (1.5, "must be an integer")):
        with pytest.raises(ValueError, match=said):
            _cfg(tmp_path, teacher_max_context=bad)
    with pytest.raises(FileNotFoundError, match="point it at a cepe adapter"):
        StageModule(build_model(base), _cfg(tmp_path, teacher_adapter=str(tmp_path / "no")))


def test_teacher_trained_over_another_decoder_is_refused(tmp_path):
    """A teacher adapter runs over the stage's decoder: one trained over a decoder of another vocabulary or
    another width is refused with what to do; one that records another name for a decoder of the same
    shapes loads with a warning that names both."""
    base = _cfg(tmp_path)
    tiny = dict(base.tiny_decoder)

    def teacher_over(name: str, **decoder):
        other = _cfg(tmp_path, tiny_decoder={**tiny, **decoder})
        return _saved(build_model(other), tmp_path / name)

    with pytest.raises(ValueError, match="256-token vocabulary, but this stage's decoder \\(tiny\\) has 128"):
        load_teacher(_cfg(tmp_path, teacher_adapter=teacher_over("vocab", vocab_size=256)))
    for name, decoder in (("wide", {"hidden_size": 128}), ("deep", {"num_hidden_layers": 3})):
        with pytest.raises(
            ValueError, match="does not fit this stage's decoder \\(tiny\\), so it was trained"
        ):
            load_teacher(_cfg(tmp_path, teacher_adapter=teacher_over(name, **decoder)))
    same = build_model(base)
    same.cepe_config.decoder_name_or_path = "another-decoder"
    with pytest.warns(UserWarning, match="records its decoder as 'another-decoder'.*decoder 'tiny'"):
        load_teacher(_cfg(tmp_path, teacher_adapter=_saved(same, tmp_path / "named")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_teacher(_cfg(tmp_path, teacher_adapter=_saved(build_model(base), tmp_path / "own")))


def test_cost_model_counts_the_adapter_teacher(tmp_path):
    """The adapter teacher costs one CEPE forward per taught example, less with a shorter context cap."""
    from cepe.training.speed import step_flops

    base = _cfg(tmp_path)
    model = build_model(base)
    path = _saved(model, tmp_path / "t")
    none = step_flops(_cfg(tmp_path, online_teacher=False), model)["forward"]
    whole = step_flops(_cfg(tmp_path, teacher_adapter=path), model)["forward"]
    capped = step_flops(_cfg(tmp_path, teacher_adapter=path, teacher_max_context=8), model)["forward"]
    assert none < capped < whole
    assert abs((whole - none) - none) < 0.05 * none  # about the student's own forward again


def test_cost_model_counts_the_teacher_adapter_in_its_own_shapes(tmp_path):
    """A teacher adapter shaped otherwise than its student (another encoder depth and width, with a
    down-projection, cross-attention in one layer of two) costs, per example, its own forward as the cost
    model counts it for that adapter, not the student's; one that keeps its output mixture adds its
    decoder run alone."""
    from cepe.training.speed import step_flops

    student = build_model(_cfg(tmp_path))
    other = _cfg(
        tmp_path,
        encoder_init="random",
        encoder={
            "hidden_size": 32,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 48,
            "output_size": 24,
        },
        cepe={"init_mode": "gate", "cross_attention_layers": [1]},
    )
    shaped = build_model(other)
    assert shaped.cepe_config.encoder.num_hidden_layers != student.cepe_config.encoder.num_hidden_layers
    path = _saved(shaped, tmp_path / "t")
    plain = _cfg(tmp_path, online_teacher=False)
    taught = _cfg(tmp_path, teacher_adapter=path)
    none = step_flops(plain, student)["forward"]
    whole = step_flops(taught, student)["forward"]
    assert whole - none == step_flops(plain, load_teacher(taught))["forward"]
    shaped.enable_output_mix(2, hidden=False)
    mixed = _saved(shaped, tmp_path / "mixed")
    with_mix = step_flops(_cfg(tmp_path, teacher_adapter=mixed), student)["forward"]
    dropped = step_flops(_cfg(tmp_path, teacher_adapter=mixed, teacher_drop_mixture=True), student)["forward"]
    assert dropped == whole
    mixing = 2 * (taught.n_decoder - 1) * shaped.mix_head.weight.shape[1]  # its mixing head, not counted
    assert (
        with_mix - none
        == step_flops(plain, load_teacher(_cfg(tmp_path, teacher_adapter=mixed)))["forward"]
        - taught.batch_size * mixing
    )


def test_taught_counts_are_the_rows_the_teacher_runs_for(tmp_path):
    """``taught_counts`` counts, kind by kind, the examples whose rows the stage module gives the teacher:
    one step's batch built as training builds it has as many teacher rows as it says."""
    from cepe.training.data import example_indices, step_layout
    from cepe.training.trainer import taught_counts

    mixed = {"tasks": {"lm": 2, "recall": 1}, "recall_cue": 4, "recall_span": [4, 12], "context_drop": 1.0}
    cfg = _cfg(
        tmp_path, teacher_tasks=["lm"], teacher_max_context=16, batch_size=8, micro_batch_size=8, **mixed
    )
    counts = taught_counts(cfg, 1)
    assert sum(n for n, _ in counts.values()) == 8 and set(counts) <= {"lm", "recall"}
    assert counts.get("recall", (0, 0))[1] == 0
    model = build_model(cfg)
    module = StageModule(model, cfg)
    src = window_source(cfg, 128)
    layout = step_layout(cfg, 0, 0)
    assert layout == (None, None)
    batch = collate([build_example(cfg, src[i], i, None) for i in example_indices(0, 8, 0, 8, 0, 1)])
    batch.pop("index")
    module._run_teacher(model, batch)
    assert int(batch["teacher_rows"].sum()) == counts["lm"][1]
    lm, taught = counts["lm"]
    assert 0 < taught < lm
    whole = taught_counts(_cfg(tmp_path, teacher_tasks=["lm"], batch_size=8, micro_batch_size=8, **mixed), 1)
    assert whole["lm"] == (lm, lm)
    with pytest.raises(ValueError, match="online_teacher: true"):
        taught_counts(_cfg(tmp_path, online_teacher=False))


def test_bf16_holds_the_teacher_decoders_linears_and_nothing_else(tmp_path):
    """On the bf16 fast path the teacher adapter's frozen decoder linears are held in bf16, as the
    student's are; its embeddings (a tied head's weight), encoder and cross-attention keep fp32, so it
    computes what the adapter computes on its own under autocast."""
    from cepe.training.trainer import _build_modules

    cfg = _cfg(tmp_path)
    model = build_model(cfg)
    _, _, module = _build_modules(
        _cfg(tmp_path, teacher_adapter=_saved(model, tmp_path / "t")), use_bf16=True
    )
    (teacher,) = module._teacher
    dec = teacher.decoder
    held = {n for n, p in teacher.named_parameters() if p.dtype == torch.bfloat16}
    linears = {
        f"decoder.{n}.weight"
        for n, m in dec.named_modules()
        if isinstance(m, torch.nn.Linear)
        and ".cross_attn" not in f".{n}"
        and m.weight is not dec.get_input_embeddings().weight
    }
    assert held == linears and len(linears) == 2 * 7  # q k v o gate up down per layer
    assert dec.get_output_embeddings().weight is dec.get_input_embeddings().weight  # tied: kept in fp32
    assert dec.get_input_embeddings().weight.dtype == torch.float32


def test_teacher_max_context_keeps_long_contexts_out_of_the_teachers_forward(tmp_path):
    """The cap skips the teacher's forward for the examples it leaves untaught, rather than running and
    discarding them: the teacher runs once per micro-batch on the taught examples alone, its encoder
    input only their kept tokens in its own chunks (a long context never enters it); with none taught it
    does not run, the KL is 0 and the cross-entropy is the student's alone."""
    cfg = _cfg(tmp_path, context_drop=1.0)  # lm examples keep 1..4 chunks of 8
    model = build_model(cfg)
    _open_gates(model)
    batch = _batch(cfg, 8)
    kept = batch["encoder_attention_mask"].flatten(1).sum(-1)  # (8,)
    short = kept <= 16
    assert 0 < int(short.sum()) < 8, kept
    path = _saved(model, tmp_path / "t", chunk_length=5)
    calls = []

    def recording(module):
        teacher = module._teacher[0]
        run = teacher.forward

        def counted(*args, **kwargs):
            calls.append((tuple(kwargs["input_ids"].shape), tuple(kwargs["encoder_input_ids"].shape)))
            return run(*args, **kwargs)

        teacher.forward = counted
        return module

    capped = recording(
        StageModule(model, _cfg(tmp_path, context_drop=1.0, teacher_adapter=path, teacher_max_context=16))
    )
    _, metrics = capped(batch)
    capped.release()
    longest = int(kept[short].max())
    assert calls == [((int(short.sum()), 32), (int(short.sum()), -(-longest // 5), 5))]
    assert float(metrics["kl"]) > 0 and torch.equal(metrics["kl_taught"], metrics["kl"])
    calls.clear()
    none = recording(
        StageModule(model, _cfg(tmp_path, context_drop=1.0, teacher_adapter=path, teacher_max_context=1))
    )
    _, untaught = none(batch)
    none.release()
    assert calls == [] and float(untaught["kl"]) == 0.0 and "kl_taught" not in untaught
    plain = StageModule(model, _cfg(tmp_path, context_drop=1.0, online_teacher=False))
    alone, _ = plain(batch)  # its loss: the cross-entropy alone
    plain.release()
    torch.testing.assert_close(untaught["lm"], alone.detach())


def test_bf16_teacher_is_the_adapter_under_autocast_and_aligned_with_its_student(tmp_path):
    """On the bf16 fast path the stage's teacher gives exactly the top-k that the adapter, loaded on its
    own with fp32 weights, gives under bf16 autocast; a student on that path taught by its own weights
    has a KL of fp16 rounding only (its rows and the teacher's are the same positions)."""
    from cepe.training.trainer import _build_modules

    model = build_model(_cfg(tmp_path))
    _open_gates(model)
    path = _saved(model, tmp_path / "t")
    cfg = _cfg(tmp_path, teacher_adapter=path, init_adapter=path)  # the student starts as its teacher
    student, _, module = _build_modules(cfg, use_bf16=True)
    batch = _batch(cfg)
    _, metrics = module(batch)
    module.release()
    assert abs(float(metrics["kl"])) < 2e-4
    taught = dict(batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        module._run_teacher(student, taught)
        alone = adapter_teacher_topk(load_teacher(cfg), *_teacher_args(batch)[:4], cfg.top_k)
    assert torch.equal(taught["teacher_probs"], alone[0]) and torch.equal(taught["teacher_indices"], alone[1])
    fp32 = adapter_teacher_topk(load_teacher(cfg), *_teacher_args(batch)[:4], cfg.top_k)
    assert not torch.equal(alone[0], fp32[0])  # autocast does change the teacher: the check above has teeth


def test_the_log_keeps_the_taught_micro_batches_kl_apart(tmp_path):
    """Where the teacher runs for some examples only, a step's ``kl`` is the mean of its micro-batches' KL
    terms, 0 for a micro-batch with no taught example; ``kl_taught`` is the mean over the micro-batches
    with one (absent from a step with none): the taught examples' KL, which the training loss is
    unchanged by."""
    from cepe.training.trainer import example_maker, micro_batch

    model = build_model(_cfg(tmp_path))
    _open_gates(model)
    path = _saved(model, tmp_path / "t")
    cfg = _cfg(
        tmp_path,
        steps=3,
        batch_size=8,
        micro_batch_size=2,
        teacher_adapter=path,
        teacher_max_context=8,
        context_drop=1.0,
    )
    make = example_maker(cfg)
    accum = cfg.batch_size // cfg.micro_batch_size
    taught = [  # micro-batches with a taught example, step by step
        sum(
            bool((micro_batch(cfg, make, s, m)["encoder_attention_mask"].flatten(1).sum(-1) <= 8).any())
            for m in range(accum)
        )
        for s in range(cfg.steps)
    ]
    assert any(0 < t < accum for t in taught), taught
    log = read_log(train(cfg))
    for record, t in zip(log, taught, strict=True):
        if t == 0:
            assert record["kl"] == 0.0 and "kl_taught" not in record
            continue
        assert record["kl_taught"] * t == pytest.approx(record["kl"] * accum, rel=1e-5)
        assert record["loss"] == pytest.approx(record["lm"] + cfg.kl_coef * record["kl"], rel=1e-5)
    every = _cfg(tmp_path, teacher_adapter=path, output_dir=str(tmp_path / "every"), steps=1)
    assert "kl_taught" not in read_log(train(every))[0]  # a teacher for every example: kl is its KL


def _mixing(model, seed: int) -> None:
    """Give ``model``'s output mixture and copy heads random weights (zero heads mix half and half)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for head in (model.mix_head, model.copy_head):
            head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 0.5)
            head.bias.fill_(0.3)


@pytest.mark.parametrize("reference", [False, True])
def test_a_mixture_student_is_taught_through_its_mixed_logits(tmp_path, reference):
    """With the output mixture (suffix matches and the copy) the student's CE and KL are those of the
    mixed logits the adapter's forward returns, on the fast and the reference path; with the reader's
    parts alone trainable the heads get no gradient and the reader does."""
    mix = {"output_mix": True, "mix_match": 3, "mix_copy": True}
    cepe = {"init_mode": "gate", "mirror_self_attention": True, **mix}
    cfg = _cfg(tmp_path, cepe=cepe, data={"synthetic": "motif"})
    model = build_model(cfg)
    _open_gates(model)
    _mixing(model, 0)
    other = copy.deepcopy(model)
    _open_gates(other, 0.2)
    _mixing(other, 1)
    taught = _cfg(
        tmp_path,
        cepe=cepe,
        data={"synthetic": "motif"},
        teacher_adapter=_saved(other, tmp_path / "t"),
        train_only=["encoder", "cross_attn"],
        reference_path=reference,
    )
    select_trainable(model, taught.train_only)
    batch = _batch(taught)
    probs, idx = adapter_teacher_topk(load_teacher(taught), *_teacher_args(batch))
    module = StageModule(model, taught)
    loss, metrics = module(batch)
    loss.backward()
    module.release()
    assert_plain_kl_and_ce(model, batch, probs, idx, torch.ones(4, dtype=torch.bool), taught.kl_form, metrics)
    torch.testing.assert_close(loss, taught.ce_coef * metrics["lm"] + taught.kl_coef * metrics["kl"])
    assert float(metrics["kl"]) > 1e-3
    with torch.no_grad():
        ctx = model.prepare_context(batch["encoder_input_ids"], batch["encoder_attention_mask"])
    assert ctx.suffix_inputs(batch["input_ids"], 0)[1].has.any()  # the copy proposes tokens here
    assert model.mix_head.weight.grad is None and model.copy_head.weight.grad is None
    grads = [p.grad for m in model.cross_attention_modules() for p in m.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads) and any(float(g.abs().sum()) > 0 for g in grads)
