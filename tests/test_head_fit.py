"""``cepe fit-heads`` (:mod:`cepe.training.head_fit`): the recorded statistics give the training loss of
the output mixture's heads exactly; the full-batch fit converges (zero gradient in the raw weights) and
lowers the loss; the job resumes from its records, scores other adapters' heads, and refuses recipes it
cannot fit."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from cepe.config import COPY_HEAD_INPUTS
from cepe.training.config import load_config
from cepe.training.head_fit import (
    HeadFitConfig,
    Heads,
    TokenStats,
    check_recipe,
    fit,
    fit_device,
    head_names,
    head_nll,
    record_batch,
    run_head_fit,
)

HEADS_ONLY = {
    "output_mix": True,
    "mix_match": 2,
    "mix_hidden": False,
    "mix_length": True,
    "mix_length_cap": 4096,
    "mix_agree": True,
    "mix_copy": True,
    "mix_copy_near": True,
    "mix_copy_sure": True,
    "mix_copy_top": True,
    "mix_copy_read": True,
    "mix_copy_count": True,
}

NO_COPY = {**HEADS_ONLY, "mix_copy": False, **{name: False for name in COPY_HEAD_INPUTS}}  # the mixture alone


def _recipe(tmp_path, **over) -> dict:
    d = yaml.safe_load(open("configs/train/tiny/cepe.yaml"))
    d.pop("init_adapter")
    d.update(
        output_dir=str(tmp_path / "heads"),
        steps=3,
        batch_size=4,
        micro_batch_size=2,
        progress=False,
        data={"synthetic": "random"},
        encoder_init="decoder",
        encoder={"num_hidden_layers": 1},
        tasks={"lm": 1, "copy": 1, "recall": 1},
        recall_cue=4,
        recall_span=[4, 12],
        context_drop=0.25,
        cepe=dict(HEADS_ONLY),
        train_only=["mix_head", "copy_head"],
    )
    d.update(over)
    return d


def _reader(tmp_path, **over):
    """A tiny adapter that reads (random o_proj) with random heads, saved as the recipes' init_adapter
    (``over``: recipe fields of its own)."""
    from cepe.training.models import build_model

    model = build_model(load_config(_recipe(tmp_path, **over)))
    torch.manual_seed(3)
    with torch.no_grad():
        for m in model.cross_attention_modules():
            m.o_proj.weight.normal_(0, 0.2)
        model.mix_head.weight.normal_(0, 0.5)
        model.copy_head.weight.normal_(0, 0.5)
        model.copy_head.bias.fill_(-1.0)
    path = tmp_path / "reader"
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("cap", [None, 3.0])
def test_recorded_stats_give_the_training_loss(tmp_path, cap):
    """The mean of ``head_nll`` over a batch's records with the model's own heads is the training loss
    of that batch (``StageModule``), fp32, and its gradient in the heads is the loss's; with a soft-capped
    output head (Gemma's ``final_logit_softcapping``; the training loss then takes the reference path) too."""
    from cepe.training.data import build_example, collate, window_source
    from cepe.training.models import StageModule, build_model

    cfg = load_config(_recipe(tmp_path, init_adapter=str(_reader(tmp_path))))
    model = build_model(cfg)
    model.decoder.config.final_logit_softcapping = cap
    src = window_source(cfg, 128)
    batch = collate([build_example(cfg, src[i], i, None) for i in range(6)])
    stats = record_batch(model, batch, use_bf16=False)
    assert stats is not None and set(stats.task.tolist()) == {0, 1, 2}
    assert bool(stats.has.any()) and not bool(stats.has.all())
    assert not torch.equal(stats.lp_ctx, stats.lp_dec)  # the reader reads
    assert stats.x_copy.shape[1] == stats.x_mix.shape[1] + 5  # recency, certainty, top, agreement, count
    assert (stats.x_copy[stats.has, -4] < 0).all() and (stats.x_copy[~stats.has, -4] == 0).all()
    q = stats.x_copy[:, -2]  # the reader's probability of the copy's tokens, log / 8
    assert (q[stats.has] <= 0).all() and (q[stats.has] < -0.05).any() and (q[~stats.has] == 0).all()
    c = stats.x_copy[:, -1]  # log(1 + occurrences) / 4
    assert (c[stats.has] >= math.log(2) / 4 - 1e-6).all() and (c[~stats.has] == 0).all()
    top = stats.x_copy[:, -3]
    assert (top[stats.has] > 0).all() and (top[stats.has] <= 1).all() and (top[~stats.has] == 0).all()
    module = StageModule(model, cfg)
    trained = {k: v for k, v in batch.items() if k != "index"}
    loss, _ = module(trained)
    loss.backward()
    module.release()
    heads = Heads.of(model)
    for t in (heads.w_mix, heads.b_mix, heads.w_copy, heads.b_copy):
        t.requires_grad_(True)
    mine = head_nll(stats, heads).mean()
    mine.backward()
    torch.testing.assert_close(mine.float(), loss.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(heads.w_mix.grad.float(), model.mix_head.weight.grad[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        heads.w_copy.grad.float(), model.copy_head.weight.grad[0], rtol=1e-4, atol=1e-5
    )
    torch.testing.assert_close(heads.b_copy.grad.float(), model.copy_head.bias.grad[0], rtol=1e-4, atol=1e-5)


def _synthetic(n: int, seed: int) -> TokenStats:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, generator=g) * torch.tensor([1.0, 10.0, 0.01]) + torch.tensor([0.0, 5.0, 0.0])
    lp_ctx = -torch.rand(n, generator=g) * 6
    lp_dec = -torch.rand(n, generator=g) * 6 + x[:, 0]  # the decoder is better where input 0 is high
    has = torch.rand(n, generator=g) < 0.5
    p = torch.where(has, torch.rand(n, generator=g), torch.zeros(n))
    xc = torch.cat([x, torch.rand(n, 1, generator=g)], dim=1)
    zero = torch.zeros(n, dtype=torch.long)
    return TokenStats(x, xc, lp_ctx, lp_dec.clamp_max(0), p, has, zero, torch.arange(n))


def test_the_fit_converges_in_the_raw_weights():
    """The fit works on standardised inputs (scales 0.01 to 10 here) and folds them back: the returned
    heads are a stationary point of the objective over the raw inputs, below where they started."""
    stats = _synthetic(4000, 0)
    start = Heads(
        torch.zeros(3, dtype=torch.float64),
        torch.tensor(0.0, dtype=torch.float64),
        torch.zeros(4, dtype=torch.float64),
        torch.tensor(-4.0, dtype=torch.float64),
    )
    got, history = fit(stats, start, 200)
    assert history[-1] < history[0] - 0.05
    ts = [got.w_mix, got.b_mix, got.w_copy, got.b_copy]
    for t in ts:
        t.requires_grad_(True)
    head_nll(stats, got).mean().backward()
    assert max(float(t.grad.abs().max()) for t in ts) < 1e-4
    assert abs(float(head_nll(stats, got).mean().detach()) - history[-1]) < 1e-12
    assert float(got.w_mix[0].detach()) < 0  # λ falls where the decoder alone is better

    keep = [torch.tensor([True, False, False]), torch.tensor([False, False, False, True])]
    start.w_mix[0], start.w_copy[3] = 0.3, -0.2
    held, _ = fit(stats, start, 200, l2=1e-3, fixed=keep)
    assert float(held.w_mix[0]) == pytest.approx(0.3, abs=1e-12)
    assert float(held.w_copy[3]) == pytest.approx(-0.2, abs=1e-12)
    assert float(held.w_mix[1]) != 0.0
    with pytest.raises(ValueError, match="mask has 2 entries for 3 weights"):
        fit(stats, start, 5, fixed=[torch.tensor([True, False])])


def test_fit_heads_job_writes_resumes_and_compares(tmp_path, monkeypatch):
    """The job records each step once (a rerun reads the records), holds out every n-th example, and
    writes an adapter with the fitted heads that scores below its start held out; another adapter's heads
    are scored on the same tokens, and an adapter whose heads take other inputs is refused."""
    import cepe.training.head_fit as hf
    from cepe.modeling import load_adapter_file
    from cepe.training.models import build_model

    reader = _reader(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(tmp_path, init_adapter=str(reader))))
    out = tmp_path / "fit"
    cfg = HeadFitConfig(
        recipe=str(recipe), output_dir=str(out), held_out_every=3, compare=[str(reader)], progress=False
    )
    purged = []  # jemalloc's kept pages are returned after each step recorded (cepe.alloc.purge)
    monkeypatch.setattr(hf, "purge", lambda: purged.append(1) or True)
    got = run_head_fit(cfg)
    assert len(purged) == 3
    assert sorted(p.name for p in (out / "stats").glob("*.pt")) == [f"step_{s:06d}.pt" for s in range(3)]
    assert got["examples"]["held_out"] == 4 and got["examples"]["fit"] == 8  # 12 examples, 0 3 6 9 held
    held = got["held_out"]
    assert held["fitted"]["nll"] < held["start"]["nll"]
    assert held[f"compare:{reader}"]["nll"] == pytest.approx(held["start"]["nll"])  # the same heads
    assert set(held["fitted"]["by_task"]) <= {"lm", "copy", "recall"}
    assert json.loads((out / "fit.json").read_text())["iterations"] == got["iterations"]
    assert "Held-out NLL" in (out / "fit.md").read_text() and (out / "fit.png").is_file()
    assert "over this reader's records, not that adapter's reader" in (out / "fit.md").read_text()
    saved = Heads.from_state(load_adapter_file(out / "adapter" / "adapter_model.safetensors"))
    assert json.loads((out / "adapter" / "cepe_config.json").read_text())["mix_length_cap"] == 4096
    w = got["weights"]["mix_head"]
    assert float(saved.b_mix) == pytest.approx(w["bias"], abs=1e-6)
    assert saved.w_copy.tolist() == pytest.approx(
        list(got["weights"]["copy_head"]["weights"].values()), rel=1e-5, abs=1e-5
    )

    q = hf.int8_heads(saved)  # what an int8 export of the adapter holds
    m8 = tmp_path / "int8"
    fitted = build_model(load_config(_recipe(tmp_path, init_adapter=str(out / "adapter"))))
    fitted.save_pretrained(m8, quantize="int8")
    back = Heads.from_state(load_adapter_file(m8 / "adapter_model.safetensors"))
    torch.testing.assert_close(back.w_copy, q.w_copy)
    torch.testing.assert_close(back.w_mix, q.w_mix)
    assert held["fitted, int8"]["nll"] == pytest.approx(held["fitted"]["nll"], rel=0.05)

    def no_model(*a, **k):
        raise AssertionError("a recorded step was computed again")

    monkeypatch.setattr(hf, "record_batch", no_model)
    again = run_head_fit(
        HeadFitConfig(recipe=str(recipe), output_dir=str(out), held_out_every=3, progress=False)
    )
    assert len(purged) == 3  # steps read back from their records allocate nothing to return
    assert again["held_out"]["fitted"]["nll"] == pytest.approx(held["fitted"]["nll"], abs=1e-9)
    shared = run_head_fit(  # another fit over the same records, in another folder
        HeadFitConfig(
            recipe=str(recipe),
            output_dir=str(tmp_path / "fit_n"),
            records=str(out / "stats"),
            held_out_every=3,
            fixed=["copy_head:n"],
            progress=False,
        )
    )
    first = Heads.from_state(load_adapter_file(reader / "adapter_model.safetensors"))  # [m1 m2 n a1 a2 (r)]
    assert shared["weights"]["mix_head"]["weights"]["n"] != pytest.approx(float(first.w_mix[2]), abs=1e-3)
    assert shared["weights"]["copy_head"]["weights"]["n"] == pytest.approx(float(first.w_copy[2]), abs=1e-6)
    assert not (tmp_path / "fit_n" / "stats").exists()
    monkeypatch.undo()
    seeded = tmp_path / "seeded.yaml"
    seeded.write_text(
        yaml.safe_dump(_recipe(tmp_path, init_adapter=str(reader), data={"synthetic": "random", "seed": 5}))
    )
    with pytest.raises(ValueError, match="holds the records of .* not of this recipe"):
        run_head_fit(HeadFitConfig(recipe=str(seeded), records=str(out / "stats"), progress=False))

    with pytest.raises(
        ValueError, match=r"fixed: \['mix_head:r', 'zz'\] are no inputs of this recipe's heads"
    ):
        run_head_fit(
            HeadFitConfig(
                recipe=str(recipe),
                output_dir=str(out),
                fixed=["n", "zz", "copy_head:r", "mix_head:r"],
                progress=False,
            )
        )
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(_recipe(tmp_path, init_adapter=str(reader), steps=1)))
    plain, wide = tmp_path / "plain", tmp_path / "wide"  # heads without the recency input, and widened
    m = build_model(load_config(_recipe(tmp_path, cepe={**HEADS_ONLY, "mix_copy_near": False})))
    with torch.no_grad():
        m.copy_head.weight.normal_(0, 0.5)
        m.mix_head.weight.normal_(0, 0.5)
    m.save_pretrained(plain)
    for cap in (2048, None):  # a recipe over an adapter sets its heads' length cap, or lifts it
        over = build_model(
            load_config(
                _recipe(tmp_path, init_adapter=str(plain), cepe={**HEADS_ONLY, "mix_length_cap": cap})
            )
        )
        assert over.cepe_config.mix_length_cap == cap
    m.enable_output_copy(near=True)
    assert m.copy_head.weight.shape[1] == len(head_names(m.cepe_config, 64)["copy_head"]) == 10
    m.save_pretrained(wide)
    both = run_head_fit(
        HeadFitConfig(
            recipe=str(other),
            output_dir=str(tmp_path / "f2"),
            compare=[str(plain), str(wide)],
            progress=False,
        )
    )["held_out"]
    assert both[f"compare:{plain}"]["nll"] == pytest.approx(both[f"compare:{wide}"]["nll"], abs=1e-9)
    assert both[f"compare:{plain}"]["nll"] != pytest.approx(both["start"]["nll"], abs=1e-3)
    none = tmp_path / "none"
    build_model(load_config(_recipe(tmp_path, cepe=NO_COPY, train_only=["mix_head"]))).save_pretrained(none)
    with pytest.raises(ValueError, match="copy_head of .* takes nothing .* the recipe's 10 inputs"):
        run_head_fit(
            HeadFitConfig(
                recipe=str(other), output_dir=str(tmp_path / "f3"), compare=[str(none)], progress=False
            )
        )


@pytest.mark.parametrize(
    "over, message",
    [
        ({"train_only": None}, "trains more than the heads"),
        ({"train_only": ["mix_head", "o_proj"]}, "trains more than the heads"),
        ({"cepe": {**HEADS_ONLY, "mix_hidden": True}}, "hidden states"),
        ({"cepe": {**HEADS_ONLY, "mix_copy_prob": True}}, "mix_copy_prob"),
        ({"cepe": {}}, "no output mixture"),
        ({"align_coef": 1.0}, "more than the mixture's next-token loss"),
    ],
)
def test_recipes_it_cannot_fit_are_refused(tmp_path, over, message):
    with pytest.raises(ValueError, match=message):
        check_recipe(load_config(_recipe(tmp_path, **over)))


def test_a_decay_sweep_reuses_the_records(tmp_path, monkeypatch):
    """``copy_decays``: the copy's probabilities made again from the examples equal the recorded ones at
    the recipe's own decay, and at another decay what a recording with that decay holds; each sweep row is
    the fit a recipe with that decay gets, without running the reader again."""
    import cepe.training.head_fit as hf
    from cepe.training.models import build_model

    own = {**HEADS_ONLY, "mix_copy_read": False, "mix_copy_count": False}
    reader = _reader(tmp_path, cepe=own)
    recipe, decayed = tmp_path / "recipe.yaml", tmp_path / "decayed.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(tmp_path, init_adapter=str(reader), cepe=own)))
    d = _recipe(tmp_path, init_adapter=str(reader), cepe={**own, "mix_copy_decay": 1.5})
    d["output_dir"] = str(tmp_path / "decayed")
    decayed.write_text(yaml.safe_dump(d))
    got = run_head_fit(
        HeadFitConfig(
            recipe=str(recipe), output_dir=str(tmp_path / "f"), copy_decays=[0, 1.5], progress=False
        )
    )["held_out"]
    assert got["decay 0"]["nll"] == pytest.approx(got["fitted"]["nll"], abs=1e-9)
    own = run_head_fit(HeadFitConfig(recipe=str(decayed), progress=False))["held_out"]
    assert own["fitted"]["nll"] == pytest.approx(got["decay 1.5"]["nll"], abs=1e-7)
    assert own["fitted"]["nll"] != pytest.approx(got["fitted"]["nll"], abs=1e-5)  # the decay moved the copy
    stats = [
        TokenStats(**x)
        for s in range(3)
        for x in torch.load(tmp_path / "decayed-fit" / "stats" / f"step_{s:06d}.pt")
    ]
    cfg = load_config(str(decayed))
    model = build_model(cfg)
    monkeypatch.setattr(hf, "record_batch", None)  # the reader is not run
    for decay, want in ((1.5, True), (0.0, False)):
        again, top = hf.recopy(cfg, model, 3, decay)
        recorded = TokenStats.cat(stats)
        assert torch.equal(again, recorded.p_copy) == want
        assert torch.equal(top, recorded.x_copy[:, -1]) == want  # the top share (last here), recorded in fp32
    monkeypatch.undo()
    plain = _recipe(tmp_path, cepe=NO_COPY, train_only=["mix_head"])  # a fresh reader with the mixture alone
    none = tmp_path / "nocopy.yaml"
    none.write_text(yaml.safe_dump(plain))
    with pytest.raises(ValueError, match="this recipe has no copy"):
        run_head_fit(HeadFitConfig(recipe=str(none), copy_decays=[1.0], progress=False))
    reads = tmp_path / "reads.yaml"
    reads.write_text(yaml.safe_dump(_recipe(tmp_path, init_adapter=str(reader))))  # the recipe adds the input
    with pytest.raises(ValueError, match="moves with the decay"):
        run_head_fit(HeadFitConfig(recipe=str(reads), copy_decays=[1.0], progress=False))


def test_task_weights_reweigh_the_fit(tmp_path):
    """``task_weights``: a kind of weight 0 is left out of the objective (the heads are those fitted on the
    other kinds' tokens alone), equal weights are no weights, the held-out scores stay unweighted; unknown
    kinds and negative weights are refused."""
    reader = _reader(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(tmp_path, init_adapter=str(reader))))
    out = tmp_path / "fit"
    base = dict(recipe=str(recipe), output_dir=str(out), held_out_every=3, progress=False)
    from cepe.modeling import load_adapter_file
    from cepe.training.config import TASK_KINDS

    def heads_written() -> Heads:
        return Heads.from_state(load_adapter_file(out / "adapter" / "adapter_model.safetensors"))

    plain = run_head_fit(HeadFitConfig(**base))
    h_plain = heads_written()
    same = run_head_fit(HeadFitConfig(**base, task_weights={"lm": 2.0, "copy": 2.0, "recall": 2.0}))
    assert same["held_out"]["fitted"]["nll"] == pytest.approx(plain["held_out"]["fitted"]["nll"], abs=1e-6)
    no_copy = run_head_fit(HeadFitConfig(**base, task_weights={"copy": 0.0}))
    h_no_copy = heads_written()
    stats = TokenStats.cat(
        [TokenStats(**x) for s in range(3) for x in torch.load(out / "stats" / f"step_{s:06d}.pt")]
    )
    rest = stats.select((stats.example % 3 != 0) & (stats.task != TASK_KINDS.index("copy")))
    copies = stats.select((stats.example % 3 != 0) & (stats.task == TASK_KINDS.index("copy")))
    assert len(rest) and len(copies)
    # the fit without the copy examples is better on the rest and worse on the copy examples
    assert head_nll(rest, h_no_copy).mean() < head_nll(rest, h_plain).mean()
    assert head_nll(copies, h_no_copy).mean() > head_nll(copies, h_plain).mean()
    assert no_copy["objective"]["fitted"] == pytest.approx(float(head_nll(rest, h_no_copy).mean()), abs=1e-5)
    with pytest.raises(ValueError, match=r"task_weights: \['prose'\] are no example kinds"):
        run_head_fit(HeadFitConfig(**base, task_weights={"prose": 1.0}))
    with pytest.raises(ValueError, match="task_weights are numbers ≥ 0"):
        HeadFitConfig(recipe="x.yaml", task_weights={"lm": -1.0})


def test_a_recipe_over_an_adapter_adds_each_copy_input(tmp_path):
    """Every copy-head input a recipe names reaches a model built over an adapter without it (the head
    widened with a zero weight, the function unchanged), not only a model built from scratch."""
    from cepe.training.models import build_model

    bare = {**HEADS_ONLY, **{name: False for name in COPY_HEAD_INPUTS}}
    base = build_model(load_config(_recipe(tmp_path, cepe=bare)))
    with torch.no_grad():
        base.copy_head.weight.normal_(0, 0.5)
    path = tmp_path / "bare"
    base.save_pretrained(path)
    for name in COPY_HEAD_INPUTS:
        if name == "mix_copy_prob":  # fit-heads refuses it; the model takes it all the same
            continue
        over = build_model(load_config(_recipe(tmp_path, init_adapter=str(path), cepe={**bare, name: True})))
        assert getattr(over.cepe_config, name), name
        names = head_names(over.cepe_config, 64)["copy_head"]
        assert over.copy_head.weight.shape[1] == len(names) == base.copy_head.weight.shape[1] + 1, name
        assert over.copy_head.weight[0, -1] == 0 and torch.equal(
            over.copy_head.weight[0, :-1], base.copy_head.weight[0]
        )


def test_config_checks():
    with pytest.raises(ValueError, match="copy_decays are finite numbers"):
        HeadFitConfig(recipe="x.yaml", copy_decays=[1.0, -2.0])
    with pytest.raises(ValueError, match="held_out_every"):
        HeadFitConfig(recipe="x.yaml", held_out_every=1)
    with pytest.raises(ValueError, match="steps"):
        HeadFitConfig(recipe="x.yaml", steps=0)


def test_the_recording_device_defaults_to_cuda_when_there_is_one(monkeypatch):
    assert fit_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="not a device torch knows"):
        fit_device("gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fit_device(None) == torch.device("cpu")
    with pytest.raises(ValueError, match="sees no CUDA device"):
        fit_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert fit_device(None) == torch.device("cuda")
    assert fit_device("cuda:1") == torch.device("cuda", 1)


def test_recorded_stats_and_heads_come_back_in_cpu_memory():
    g = torch.Generator().manual_seed(0)
    stats = TokenStats(
        torch.randn(3, 2, generator=g),
        None,
        *(torch.randn(3, generator=g) for _ in range(3)),
        torch.tensor([True, False, True]),
        torch.zeros(3, dtype=torch.long),
        torch.arange(3),
    )
    back = stats.cpu()
    assert back.x_copy is None
    for k, v in stats.__dict__.items():
        if v is not None:
            assert getattr(back, k).device.type == "cpu" and torch.equal(getattr(back, k), v)
    heads = Heads.from_state({"mix_head.weight": torch.ones(1, 2), "mix_head.bias": torch.zeros(1)})
    assert heads.w_mix.dtype == torch.float64 and heads.w_mix.device.type == "cpu"


def test_held_out_scores_by_kind_and_context_length():
    """The report's breakdown: by example kind, and the continuation examples by the context length the
    length input encodes (log(1 + n / 1024)); a side alone scores its own log-probabilities."""
    from cepe.mixture import length_feature
    from cepe.training.head_fit import _breakdown, _scores

    stats = _synthetic(600, 1)
    ctx = torch.tensor([100, 1500, 3000, 5000, 6500, 8192]).repeat(100)
    stats.x_mix[:, 1] = length_feature(ctx)
    stats.task = (torch.arange(600) >= 480).long()  # lm, then copy
    heads = Heads(torch.tensor([0.5, -0.1, 2.0], dtype=torch.float64), torch.tensor(0.3, dtype=torch.float64))
    got = _scores(stats, heads, length_col=1)
    nll = head_nll(stats, heads)
    lm = stats.task == 0
    assert got["by_task"]["copy"] == pytest.approx(float(nll[~lm].mean()))
    assert list(got["lm_by_length"]) == ["0K-1K", "1K-2K", "2K-4K", "4K-6K", "6K-7K", "7K+"]
    assert got["lm_by_length"]["4K-6K"] == pytest.approx(float(nll[lm & (ctx == 5000)].mean()))
    alone = _breakdown(stats, -stats.lp_dec, 1)
    assert alone["by_task"]["lm"] == pytest.approx(float(-stats.lp_dec[lm].double().mean()), rel=1e-9)
    assert alone["lm_by_length"]["7K+"] == pytest.approx(
        float(-stats.lp_dec[lm & (ctx == 8192)].double().mean()), rel=1e-9
    )


def test_records_of_the_old_suffix_hash_are_not_fitted_for_the_new(tmp_path):
    """Records hold the suffix inputs: a records folder written before the hash fix (its note says no
    ``mix_hash``: the old hash) is refused for heads that will run on the exact hash; dropping a mixture
    and adding one anew hashes exactly; a store's fingerprint leaves out the hash a config saved before
    the field loads with."""
    from cepe.config import CepeConfig
    from cepe.store import fingerprint_config
    from cepe.training.head_fit import RECORDS_FILE
    from cepe.training.models import build_model

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(tmp_path, init_adapter=str(_reader(tmp_path)))))
    cfg = load_config(str(recipe))
    stats = tmp_path / "stats"
    stats.mkdir()
    note = {"recipe": cfg.output_dir, "fingerprint": cfg.fingerprint(), "bf16": False}
    (stats / RECORDS_FILE).write_text(json.dumps(note))
    with pytest.raises(ValueError, match="suffix hash unknown .*suffix hash exact"):
        run_head_fit(HeadFitConfig(recipe=str(recipe), records=str(stats), progress=False))
    model = build_model(cfg)
    model.cepe_config.mix_hash = "wrap"
    model.disable_output_mix()
    assert model.cepe_config.mix_hash == "exact"
    model.cepe_config.mix_hash = "wrap"  # a reader dropped from a wrap adapter before the fix
    model.enable_output_mix(3, False)
    assert model.cepe_config.mix_hash == "exact"
    saved = {k: v for k, v in model.cepe_config.to_dict().items() if k != "mix_hash"}  # before the field
    assert "mix_hash" not in fingerprint_config(CepeConfig.from_dict(saved))  # loads as wrap: left out
    assert fingerprint_config(CepeConfig.from_dict({**saved, "mix_hash": "exact"}))["mix_hash"] == "exact"
    model.disable_output_mix()  # no mixture: the hash does nothing and is left out
    assert "mix_hash" not in fingerprint_config(model.cepe_config)
