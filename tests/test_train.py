"""Training stages on tiny configs (CPU, seconds): losses fall, resume is exact, the decoder stays frozen,
chunk noise and the distillation KL match their definitions, every shipped config loads."""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from cepe import CepeForCausalLM
from cepe.training.config import load_config
from cepe.training.data import chunk_noise_mask
from cepe.training.teacher import TeacherStore, run_teacher
from cepe.training.trainer import read_log, train

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "train" / "tiny"
SHIPPED = sorted((ROOT / "configs" / "train").rglob("*.yaml"))
# Recipe adapters made by a script rather than a stage (docs/TRAINING.md, "Each side of the pivot on its
# own"): output dir -> the stage (or derived) dirs it is made from, its base first.
DERIVED = {
    "runs/recipe/fast_direct_len6_half": ["runs/recipe/fast_direct_len6"],  # scale_length_exponents.py
    "runs/recipe/fast_direct_copyshort_up": [  # graft_length_exponents.py BASE DONOR
        "runs/recipe/fast_direct_copyshort",
        "runs/recipe/fast_direct_len6_half",
    ],
    "runs/recipe/shift_b-2_g0": ["runs/recipe/fast_direct_copyshort_up"],  # shift_match_gates.py --bias -2
}
# Averages of stages' adapters a later stage starts from (scripts/average_adapters.py OUT ADAPTER ...;
# docs/TRAINING.md, "A gentler continuation, and more averages"): output dir -> the adapters averaged.
SOUPS = {
    f"runs/soup/qa2_gates_break{route}": [  # scripts/rebuild_choice.sh, and with `run` the run-bias route
        f"runs/recipe/{s}{route}/checkpoints/step_000040/adapter"
        for s in ("fast_fold_qa2", "fast_fold_gates", "fast_fold_break_only")
    ]
    for route in ("", "_run")
}
# Stages' ends rebuilt on a lent accelerator and joined from its int8 export (scripts/device_kit.py join;
# docs/TRAINING.md, "A second lent H200"): the adapter -> the stage's checkpoint it stands in for.
GIVEN = {"runs/given/fast_soup_run3_h200": "runs/recipe/fast_soup_run3/checkpoints/step_000040/adapter"}
# The repository's adapter without its output mixture (`cepe export --model adapters/smollm2-135m-cepe --out
# runs/given/shipped_reader --drop-mixture`; docs/TRAINING.md, "The copy over the shipped adapter").
FROM_REPO = {"runs/given/shipped_reader": "adapters/smollm2-135m-cepe"}
SOUPS["runs/soup/linux_linux2"] = [  # fast_soup_ll_run's start ("All the kernel documentation, ...")
    f"runs/recipe/{s}/checkpoints/step_000040/adapter" for s in ("fast_soup_linux", "fast_soup_linux2")
]


def _cfg(name: str, out: Path, **over):
    items = [f"output_dir={out}", "progress=false", "num_threads=1"] + [f"{k}={v}" for k, v in over.items()]
    return load_config(TINY / f"{name}.yaml", items)


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_log(out)]


def _falls(losses: list[float], k: int = 4) -> bool:
    return sum(losses[-k:]) / k < sum(losses[:k]) / k


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """Run mlm -> warmup -> cepe on tiny configs once; later tests read the outputs."""
    root = tmp_path_factory.mktemp("stages")
    mlm = train(_cfg("mlm", root / "mlm", steps=30, save_every=15))
    warm = train(_cfg("warmup", root / "warmup", init_encoder=mlm, steps=20, save_every=10))
    cepe = train(_cfg("cepe", root / "cepe", init_adapter=warm, steps=24, save_every=12))
    return {"mlm": mlm, "warmup": warm, "cepe": cepe, "root": root}


def test_mlm_loss_falls_and_writes_encoder(stages):
    out = stages["mlm"]
    assert _falls(_losses(out))
    assert (out / "encoder_model.safetensors").is_file() and (out / "encoder_config.json").is_file()
    assert len(read_log(out)) == 30


def test_warmup_and_cepe_write_loadable_adapters(stages):
    for name in ("warmup", "cepe"):
        assert _falls(_losses(stages[name])), name
    cfg = _cfg("cepe", stages["root"] / "x")
    from cepe.training.data import build_example, collate, window_source
    from cepe.training.models import build_decoder

    # The saved adapter is the trained one: on the stage's own training examples it beats the adapter
    # the stage started from (the warmup's), loaded the same way.
    source = window_source(cfg, int(cfg.tiny_decoder["vocab_size"]))
    batch = collate([build_example(cfg, source[i], i, None) for i in range(16)])
    batch.pop("index")
    losses = {}
    for name in ("warmup", "cepe"):
        model = CepeForCausalLM.from_pretrained(stages[name], decoder=build_decoder(cfg)).eval()
        with torch.no_grad():
            losses[name] = model(**batch).loss.item()
    assert losses["cepe"] < losses["warmup"] - 0.05, losses
    # warmup started from the MLM encoder
    enc = load_file(stages["mlm"] / "encoder_model.safetensors")
    assert enc["embed_tokens.weight"].shape[0] == 129


def test_decoder_weights_untouched(tmp_path):
    from cepe.training.models import build_decoder

    cfg = _cfg("cepe", tmp_path / "c", init_adapter="null", steps=3)
    before = {k: v.clone() for k, v in build_decoder(cfg).state_dict().items()}
    import cepe.training.trainer as trainer_mod

    seen = {}
    orig = trainer_mod.build_model

    def spy(c):
        model = orig(c)
        seen["model"] = model
        return model

    trainer_mod.build_model = spy
    try:
        train(cfg)
    finally:
        trainer_mod.build_model = orig
    after = {k: v for k, v in seen["model"].decoder.state_dict().items() if ".cross_attn." not in k}
    assert set(after) == set(before)
    for k in before:  # in bf16 the frozen matmul weights are held in bf16: rounded once, never trained
        assert torch.equal(before[k].to(after[k].dtype), after[k]), k
    assert all(
        not p.requires_grad for n, p in seen["model"].decoder.named_parameters() if ".cross_attn." not in n
    )


def test_resume_reproduces_losses_exactly(tmp_path):
    straight = train(_cfg("cepe", tmp_path / "a", init_adapter="null", steps=6, save_every=3))
    cfg = _cfg("cepe", tmp_path / "b", init_adapter="null", steps=6, save_every=3)
    # a run killed after step 3: the same config, stopped early
    import cepe.training.trainer as trainer_mod

    class Killed(Exception):
        pass

    orig = trainer_mod.save_checkpoint

    def kill_after_first(*args, **kwargs):
        path = orig(*args, **kwargs)
        raise Killed(path)

    trainer_mod.save_checkpoint = kill_after_first
    try:
        with pytest.raises(Killed):
            train(cfg)
    finally:
        trainer_mod.save_checkpoint = orig
    assert len(read_log(tmp_path / "b")) == 3
    with pytest.raises(ValueError, match="--resume"):
        train(cfg)
    train(cfg, resume=True)
    assert _losses(tmp_path / "b") == _losses(straight)
    assert len(_losses(straight)) == 6
    a = load_file(straight / "adapter_model.safetensors")
    b = load_file(tmp_path / "b" / "adapter_model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_copy_warmup_learns_to_copy(tmp_path):
    """configs/train/tiny/copy.yaml from scratch: the copy loss falls from uniform (ln V = 4.16) to under a
    tenth of it within the config's 3000 steps (about 0.21 here, against a floor of about 0.13: the first
    token of the second chunk cannot be read from the chunk of the token before it)."""
    cfg = _cfg("copy", tmp_path / "copy", num_threads=2)
    assert cfg.stage == "warmup" and cfg.init_encoder is None and cfg.steps == 3000
    train(cfg)
    losses = _losses(tmp_path / "copy")
    uniform = math.log(cfg.tiny_decoder["vocab_size"])
    assert abs(losses[0] - uniform) < 0.1 * uniform  # starts at chance
    assert sum(losses[-5:]) / 5 < 0.1 * uniform, losses[-5:]


def test_resume_refuses_other_config(tmp_path):
    train(_cfg("mlm", tmp_path / "m", steps=2, save_every=1))
    with pytest.raises(ValueError, match="different configuration"):
        train(_cfg("mlm", tmp_path / "m", steps=2, save_every=1, **{"optim.lr": 0.5}), resume=True)


def test_resume_refuses_a_corpus_prepared_again(tmp_path):
    """A run resumed over a corpus directory prepared again (its index.json differs) would not continue the
    same examples: refused; the same corpus resumes."""
    from cepe.data.tokenized import ShardWriter

    def corpus(seed: int) -> str:
        g = torch.Generator().manual_seed(seed)
        with ShardWriter(tmp_path / "c", eos_id=1, vocab_size=100, shard_tokens=512) as w:
            for d in range(6):
                w.add("train", f"doc{d}", "toy", (torch.randint(2, 100, (300,), generator=g)).tolist())
        return str(tmp_path / "c")

    def cfg(stop: int | None):
        stops = {} if stop is None else {"stop_after": stop}
        c = _cfg("warmup", tmp_path / "w", init_encoder="null", steps=3, save_every=1, **stops)
        c.data.synthetic, c.data.corpus = None, str(tmp_path / "c")
        return c

    corpus(0)
    train(cfg(1))
    train(cfg(2), resume=True)  # the same corpus
    corpus(1)
    with pytest.raises(ValueError, match="trained on another corpus"):
        train(cfg(None), resume=True)


def _ceped_cfg(tmp_path: Path, **over):
    """The tiny CEPED stage from scratch, its offline teacher in ``tmp_path / "t"``, 4 examples a step."""
    return _cfg(
        "ceped", tmp_path / "d", init_adapter="null", teacher_dir=tmp_path / "t", batch_size=4, **over
    )


def test_ceped_teacher_and_training(tmp_path):
    cfg = _ceped_cfg(tmp_path, steps=16, teacher_examples_per_shard=16, **{"optim.lr": 5e-3})
    run_teacher(cfg, progress=False)
    store = TeacherStore(cfg)
    probs, idx = store.get(5)
    assert probs.dtype == torch.float16 and probs.shape == (cfg.n_decoder - 1, cfg.top_k)
    assert store.num_examples == 64
    # resumable: an existing shard is skipped, a missing one recomputed identically
    shard = tmp_path / "t" / "shard_000001.safetensors"
    first = load_file(shard)
    shard.unlink()
    run_teacher(cfg, progress=False)
    again = load_file(shard)
    assert torch.equal(first["probs"], again["probs"]) and torch.equal(first["indices"], again["indices"])
    out = train(cfg)
    log = read_log(out)
    assert {"ce", "kl"} <= set(log[0])
    assert _falls([r["loss"] for r in log], k=3)


def test_offline_teacher_reads_the_students_shuffled_windows(tmp_path):
    """With ``data.shuffle`` the student reads permuted windows; the offline teacher's distributions are the
    decoder's on the same permuted tokens (before, on the unpermuted ones); ``context_drop``, a CEPE-stage
    option, is refused for ceped (its teacher reads every chunk)."""
    from cepe.modeling import decoder_logits
    from cepe.training.data import build_example, window_source
    from cepe.training.losses import teacher_topk
    from cepe.training.models import build_decoder

    cfg = _ceped_cfg(tmp_path, teacher_examples_per_shard=8, **{"data.shuffle": 1.0, "chunk_noise": 0.0})
    run_teacher(cfg, progress=False, num_examples=8)
    store, dec, src = TeacherStore(cfg), build_decoder(cfg), window_source(cfg, 128)
    m = cfg.n_chunks * cfg.chunk_length
    for i in (0, 5):
        ex = build_example(cfg, src[i], i, None)
        ids = torch.cat([ex["encoder_input_ids"].flatten(), ex["input_ids"]])
        assert not torch.equal(ids, torch.as_tensor(src[i]))  # permuted
        with torch.no_grad():
            hidden = dec.get_decoder()(input_ids=ids[None]).last_hidden_state[0, m:-1]
        p, j = teacher_topk(decoder_logits(dec, hidden), cfg.top_k)
        probs, idx = store.get(i)
        assert torch.equal(idx[:, :3], j[:, :3].long())
        torch.testing.assert_close(probs.float(), p.float(), atol=2e-3, rtol=1e-2)
    with pytest.raises(ValueError, match="context_drop needs the cepe stage or the online teacher"):
        _cfg("ceped", tmp_path / "x", context_drop=0.3)


def test_offline_teacher_checks_its_shards_corpus_and_vocabulary(tmp_path, monkeypatch):
    """Training refuses a teacher pass with a shard missing among the examples it reads (a pass stopped
    early: the manifest counts them already) and one made over another corpus in the same directory
    (its index.json differs; a manifest written before digests is not compared); the pass refuses a
    teacher of another vocabulary; synthetic data beyond the decoder's vocabulary is refused."""
    import json

    import cepe.training.models as models
    from cepe.training.teacher import MANIFEST, _check_and_write_manifest

    cfg = _ceped_cfg(tmp_path, steps=2, teacher_examples_per_shard=4)
    run_teacher(cfg, progress=False)
    (tmp_path / "t" / "shard_000001.safetensors").unlink()
    with pytest.raises(ValueError, match=r"lacks 1 shard\(s\) .*shard_000001"):
        train(cfg)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "index.json").write_text('{"shards": 1}')
    ccfg = _cfg("ceped", tmp_path / "d2", init_adapter="null", teacher_dir=tmp_path / "t2")
    ccfg.data.synthetic, ccfg.data.corpus = None, str(corpus)  # the manifest alone: no corpus is read
    (tmp_path / "t2").mkdir()
    _check_and_write_manifest(ccfg, tmp_path / "t2", 8, write=True)
    TeacherStore(ccfg)  # the same corpus
    (corpus / "index.json").write_text('{"shards": 2}')  # prepared again into the same directory
    with pytest.raises(ValueError, match="data_digest"):
        TeacherStore(ccfg)
    manifest = tmp_path / "t2" / MANIFEST
    old = json.loads(manifest.read_text())
    del old["data_digest"]
    manifest.write_text(json.dumps(old))
    TeacherStore(ccfg)  # written before digests were recorded
    wide = models.build_decoder(cfg)
    wide.resize_token_embeddings(wide.config.vocab_size + 64)
    monkeypatch.setattr(models, "build_decoder", lambda *a, **k: wide)
    with pytest.raises(ValueError, match="must have the student's tokenizer and vocabulary size"):
        run_teacher(_ceped_cfg(tmp_path / "v", steps=2), progress=False)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="data.synthetic_vocab is 1000"):
        train(_cfg("warmup", tmp_path / "s", init_encoder="null", steps=1, **{"data.synthetic_vocab": 1000}))


def test_ceped_needs_teacher(tmp_path):
    cfg = _cfg("ceped", tmp_path / "d", init_adapter="null", teacher_dir=tmp_path / "none", steps=2)
    with pytest.raises(ValueError, match="cepe teacher"):
        train(cfg)


# ----------------------------------------------------------------------------- pure functions
def test_synthetic_distinct_windows():
    from cepe.training.data import SyntheticWindows

    src = SyntheticWindows("distinct", vocab_size=64, seq_length=16, seed=3)
    for i in range(20):
        w = src[i]
        assert w.shape == (16,) and len(set(w.tolist())) == 16 and 0 <= int(w.min()) and int(w.max()) < 64
        assert torch.equal(w, src[i])  # a pure function of the index
    with pytest.raises(ValueError, match="'distinct' windows of 65 tokens"):
        SyntheticWindows("distinct", vocab_size=64, seq_length=65)[0]


def test_chunk_noise_statistics():
    k, length, n = 16, 64, 4000
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(n, k, length, dtype=torch.bool)
    noisy = chunk_noise_mask(mask, 0.3, 0.1, g)
    kept = noisy.sum(-1).flatten()  # tokens left per chunk
    # masked tokens are always a suffix
    pos = torch.arange(length)
    assert torch.equal(noisy.flatten(0, 1), pos[None, :] < kept[:, None])
    noised = kept < length
    frac = noised.float().mean().item()
    assert abs(frac - 0.3) < 0.01  # P(noised) = 0.3 (a suffix always removes at least one token)
    whole = (kept == 0).float().mean().item()
    assert abs(whole - 0.03) < 0.003  # only whole-chunk removal empties a chunk: 0.3·0.1
    partial = length - kept[(kept > 0) & noised]  # suffix lengths t in 1..|C|-1, uniform (as released)
    assert int(partial.max()) <= length - 1
    counts = torch.bincount(partial, minlength=length)[1:length].float()
    assert counts.min() > 0 and (counts.max() - counts.min()) / counts.mean() < 0.6
    assert abs(partial.float().mean().item() - length / 2) < 1.5


def test_warmup_layout_and_noise_off_for_ceped(tmp_path):
    from cepe.training.data import build_example

    cfg = _cfg("warmup", tmp_path / "w", init_encoder="null")
    ex = build_example(cfg, torch.arange(32), 0, None)
    assert torch.equal(ex["encoder_input_ids"].flatten(), ex["input_ids"])
    assert ex["encoder_input_ids"].shape == (4, 8)
    ced = _cfg("ceped", tmp_path / "d", teacher_dir=tmp_path / "t")
    assert ced.chunk_noise == 0.0 and _cfg("cepe", tmp_path / "c").chunk_noise == 0.3


@functools.cache
def _configs_by_output(folder: Path) -> dict:
    """Every config of a folder by its output_dir, loaded once for all the parametrised cases below."""
    return {c.output_dir: c for c in map(load_config, sorted(folder.glob("*.yaml")))}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_configs_load(path):
    cfg = load_config(path)
    if path.parent.name == "recipe":  # named variants of the recipe ablation and its long run
        assert cfg.bf16 in (True, "auto") and cfg.stage == (
            "warmup" if path.stem.startswith(("copy_", "long_align", "fast_warmup")) else "cepe"
        )
        if cfg.stage == "warmup":
            assert cfg.encoder_init in ("decoder", "random") and cfg.data.shuffle > 0
        elif cfg.init_adapter in FROM_REPO:  # a stage over the repository's own adapter
            assert (ROOT / FROM_REPO[cfg.init_adapter] / "cepe_config.json").is_file()
        else:  # a later stage starts from a checkpoint of another shipped recipe run
            srcs = {o: c for o, c in _configs_by_output(path.parent).items() if o != cfg.output_dir}
            start = cfg.init_adapter
            if start.endswith("-fit/adapter"):  # heads `cepe fit-heads` fitted over a recipe's start
                start = srcs[start.removesuffix("-fit/adapter")].init_adapter
            for init in SOUPS.get(start, [GIVEN.get(start, start)]):
                out, kept = init.removesuffix("/adapter").split("/checkpoints/step_")
                assert init.endswith("/adapter")
                while out in DERIVED:  # an adapter a script made from stages' adapters (docs/TRAINING.md)
                    out, *others = DERIVED[out]
                    assert all(o in srcs or o in DERIVED for o in others), others
                assert out in srcs, out
                if path.stem.startswith("fast_"):  # the rebuild chain: its start survives rotation
                    src = srcs[out]
                    assert int(kept) == src.steps or int(kept) in src.keep_steps, (
                        kept,
                        src.steps,
                        src.keep_steps,
                    )
        return
    assert cfg.stage == ("warmup" if path.stem == "copy" else path.stem)  # the file name says the stage
    if path.parent.name == "tiny":
        assert cfg.bf16 is False and cfg.tiny_decoder is not None  # fp32 whatever the CPU
    if cfg.stage == "ceped":
        assert (cfg.kl_form, cfg.kl_coef, cfg.ce_coef, cfg.chunk_noise) == ("drop", 2.0, 1.0, 0.0)
    # each stage starts from the previous stage's output directory of the same tier
    previous = {"warmup": "mlm", "cepe": "warmup", "ceped": "cepe"}.get(cfg.stage)
    start = cfg.init_encoder if cfg.stage == "warmup" else cfg.init_adapter
    if previous and path.stem != "copy":
        prev = load_config(path.with_name(f"{previous}.yaml"))
        assert start == prev.output_dir, (start, prev.output_dir)


def test_keep_steps_survive_rotation(tmp_path):
    from cepe.training.checkpoint import checkpoint_dirs, save_checkpoint

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for step in (20, 40, 60, 80, 100, 120):
        save_checkpoint(tmp_path, step, model, opt, sched, {"step": step}, [{}], keep=2, keep_steps=(40,))
    assert [s for s, _ in checkpoint_dirs(tmp_path)] == [40, 100, 120]
    save_checkpoint(tmp_path, 140, model, opt, sched, {"step": 140}, [{}], keep=2)
    assert [s for s, _ in checkpoint_dirs(tmp_path)] == [120, 140]  # no keep_steps: plain rotation
    base = {"stage": "cepe", "output_dir": "x", "data": {"corpus": "c"}, "steps": 120, "save_every": 20}
    kept = load_config({**base, "keep_steps": [100, 120]})
    assert kept.keep_steps == (100, 120) and kept.fingerprint() == load_config(base).fingerprint()
    with pytest.raises(ValueError, match="keep_steps must lie in 1..steps"):
        load_config({**base, "keep_steps": [140]})
    with pytest.raises(ValueError, match="multiple of save_every"):
        load_config({**base, "keep_steps": [30]})


def test_bad_config_messages(tmp_path):
    with pytest.raises(ValueError, match="unknown config keys"):
        load_config({"stage": "cepe", "output_dir": "x", "data": {"synthetic": "random"}, "bogus": 1})
    with pytest.raises(ValueError, match="stage"):
        load_config(TINY / "mlm.yaml", stage="cepe")
    with pytest.raises(ValueError, match="data.corpus"):
        load_config({"stage": "cepe", "output_dir": "x"})


# ----------------------------------------------------------------------------- several processes
@pytest.mark.multiproc
@pytest.mark.parametrize("mixed", [False, True])
def test_two_processes_end_with_identical_weights(tmp_path, mixed):
    """Two processes train in step to identical weights; with mixed tasks too, where one process's
    micro-batches may hold kinds the other's do not (its metrics then differ in keys, and the processes
    must still run the same collectives)."""
    out = tmp_path / "ddp"
    config = TINY / "cepe.yaml"
    if mixed:
        d = yaml.safe_load(config.read_text())
        d.update(
            data={"synthetic": "distinct"},
            tasks={"lm": 1, "copy": 1, "recall": 1},
            recall_cue=4,
            recall_span=[4, 12],
            micro_batch_size=1,
        )
        config = tmp_path / "mixed.yaml"
        config.write_text(yaml.safe_dump(d))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        "29517",
        "-m",
        "cepe.training.cli",
        "train",
        "--stage",
        "cepe",
        "--config",
        str(config),
        "--output-dir",
        str(out),
        "--steps",
        "3",
        "--no-progress",
        "--set",
        "init_adapter=null",
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    digests = json.loads((out / "final_digests.json").read_text())
    assert len(digests) == 2 and digests[0] == digests[1]
    log = read_log(out)
    assert len(log) == 3
    if mixed:
        assert all({"lm_lm", "lm_copy", "lm_recall"} <= set(row) for row in log)


def test_fsdp_on_cpu_is_refused_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="FSDP was requested .* no GPU"):
        train(_cfg("warmup", tmp_path / "f", init_encoder="null", steps=1))


def test_gradient_checkpointing_same_losses(tmp_path):
    plain = train(_cfg("cepe", tmp_path / "p", init_adapter="null", steps=3, save_every=3))
    ckpt = train(
        _cfg(
            "cepe", tmp_path / "g", init_adapter="null", steps=3, save_every=3, gradient_checkpointing="true"
        )
    )
    assert _losses(plain) == pytest.approx(_losses(ckpt), rel=1e-4)


def test_cepe_train_takes_the_stage_from_the_config_file(tmp_path):
    """``cepe train --config FILE`` without ``--stage`` runs the file's ``stage`` (through ``extends:``);
    ``--stage`` still wins; a file without one, or with a stage ``cepe train`` does not run, is refused."""
    from cepe.training.cli import train_stage

    (tmp_path / "base.yaml").write_text("stage: warmup\nsteps: 3\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\nsteps: 4\n")
    (tmp_path / "none.yaml").write_text("steps: 4\n")
    (tmp_path / "mlm.yaml").write_text("stage: mlm\n")
    assert train_stage(None, str(tmp_path / "child.yaml")) == "warmup"
    assert train_stage("cepe", str(tmp_path / "child.yaml")) == "cepe"
    assert train_stage(None, str(ROOT / "configs/train/recipe/fast_soup_dec_mixed.yaml")) == "cepe"
    with pytest.raises(ValueError, match="needs --stage, or --config FILE with a `stage:` key"):
        train_stage(None, str(tmp_path / "none.yaml"))
    with pytest.raises(ValueError, match="needs --stage"):
        train_stage(None, None)
    with pytest.raises(ValueError, match="says stage: 'mlm'"):
        train_stage(None, str(tmp_path / "mlm.yaml"))


def test_recipe_configs_keep_the_fingerprints_of_their_runs():
    """Each recipe config trains what its recorded run trained (tests/recipe_fingerprints.json): most
    configs extend another, so an edit to one can change others; this says which. A new config gets its
    line; a changed one is a new stage (a new name), since its results and checkpoints are the old one's."""
    recorded = json.loads((ROOT / "tests" / "recipe_fingerprints.json").read_text())
    configs = sorted((ROOT / "configs" / "train" / "recipe").glob("*.yaml"))
    missing = [p.stem for p in configs if p.stem not in recorded]
    assert not missing, f"record these new configs in tests/recipe_fingerprints.json: {missing}"
    changed = [p.stem for p in configs if load_config(p).fingerprint() != recorded[p.stem]]
    assert not changed, f"these configs no longer train what their runs trained: {changed}"
    assert sorted(recorded) == [p.stem for p in configs], (
        "tests/recipe_fingerprints.json names a config that is gone"
    )


def test_read_log_leaves_out_a_half_written_last_record_and_refuses_other_damage(tmp_path):
    """The record a running trainer is appending (or a killed one left) is not whole JSON yet: it is left
    out, so a reader mid-run or a resume after ``kill -9`` does not fail on it; damage before it is refused."""
    (tmp_path / "log.jsonl").write_text(
        '{"step": 1, "loss": 2.0}\n\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo'
    )
    assert read_log(tmp_path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    (tmp_path / "log.jsonl").write_text(
        '{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n'
    )
    with pytest.raises(ValueError, match=r"log.jsonl:2: not a JSON record"):
        read_log(tmp_path)
    assert read_log(tmp_path / "nowhere") == []
