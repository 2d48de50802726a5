"""Training review: the online teacher's row at the token after an inserted context, match-gate calibration
with several processes, and configs whose values would train something else than asked."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from cepe.training import trainer
from cepe.training.config import load_config
from cepe.training.losses import teacher_topk
from cepe.training.models import build_decoder
from cepe.training.online_teacher import online_teacher_topk


def _tiny(tmp_path, **over) -> dict:
    d = yaml.safe_load(Path("configs/train/tiny/cepe.yaml").read_text())
    d.pop("init_adapter")
    d.update(output_dir=str(tmp_path / "run"), progress=False, data={"synthetic": "distinct"})
    d.update(over)
    return d


def test_online_teacher_predicts_the_token_after_the_context_from_the_context_end(tmp_path):
    """With the context inserted before decoder position ``a`` (``context_at``), decoder token ``a`` stands
    after the context: row ``a - 1`` (which predicts it) is the teacher's distribution at the context's last
    position, not at decoder position ``a - 1`` (which, in the teacher's window, predicts the context's
    first token)."""
    cfg = load_config(_tiny(tmp_path))
    dec = build_decoder(cfg)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (1, 10), generator=g)
    enc = torch.randint(0, 128, (1, 2, 4), generator=g)
    mask = torch.ones(1, 2, 4, dtype=torch.bool)
    a = 3
    probs, idx = online_teacher_topk(dec, ids, ids.clone(), enc, mask, 8, torch.tensor([a]))
    ctx = enc[0].reshape(-1)
    full = torch.cat([ids[0, :a], ctx, ids[0, a:]])[None]
    with torch.no_grad():
        logits = dec(full).logits[0]
    for t in range(ids.shape[1] - 1):  # row t: the distribution of decoder token t + 1
        pos = t if t + 1 < a else t + ctx.numel()
        assert int(full[0, pos + 1]) == int(ids[0, t + 1])  # that position predicts that token
        p, j = teacher_topk(logits[pos], 8)
        torch.testing.assert_close(probs[0, t], p, msg=f"row {t}")
        assert torch.equal(idx[0, t], j.long())


def test_match_gate_calibration_reads_the_first_micro_batches_with_several_processes(tmp_path, monkeypatch):
    """``match_gate_calibrate: N`` standardises on the stage's first N micro-batches in training order,
    the same whatever the number of processes: with 2 processes (half the accumulation per process) the
    first 4 micro-batches of a 4-micro-batch step are still step 0's 0..3, not steps 0 and 1's first two."""
    cfg = load_config(
        _tiny(tmp_path, batch_size=4, micro_batch_size=1, match_gate_calibrate=4, cepe={"match_gate": True})
    )
    seen = []

    def fake_micro_batch(cfg_, make, step, micro, rank=0, world=1, keep_index=False):
        seen.append((step, micro))
        return {}

    class FakeModel:
        cepe_config = SimpleNamespace(match_gate=True)

        def cross_attention_modules(self):
            return []

        def eval(self):
            return self

        def calibrate_match_gate(self, forward):
            forward()
            return {0: torch.zeros(2, 4)}

    monkeypatch.setattr(trainer, "micro_batch", fake_micro_batch)
    run = SimpleNamespace(
        cfg=cfg,
        inner=FakeModel(),
        make=None,
        accum=2,  # 4 micro-batches a step over 2 processes
        module=lambda batch: None,
        stage_module=SimpleNamespace(release=lambda: None),
        acc=SimpleNamespace(device=torch.device("cpu")),
        main=False,
    )
    trainer._calibrate_match_gate(run)
    assert seen == [(0, 0), (0, 1), (0, 2), (0, 3)]


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"optim": {"lr": 1e-3, "max_grad_norm": -1.0}}, "optim.max_grad_norm must be"),
        ({"kl_coef": -1.0}, "kl_coef must be >= 0"),
        ({"ce_coef": -0.5}, "ce_coef must be >= 0"),
        ({"kl_smoothing": 1.5}, "kl_smoothing must be in"),
        ({"context_drop": 1.5}, r"context_drop must be in \[0, 1\]"),
        ({"context_drop": -0.5}, r"context_drop must be in \[0, 1\]"),
        ({"teacher_examples_per_shard": 0}, "teacher_examples_per_shard must be positive"),
        ({"tasks": {"lm": 1, "recall": 1}, "recall_span": [8]}, r"recall_span must be \[min, max\]"),
        ({"tasks": {"lm": 1, "recall": 1}, "recall_span": [2, 3, 4]}, r"recall_span must be \[min, max\]"),
    ],
)
def test_config_refuses_values_that_would_train_something_else(tmp_path, over, message):
    """A negative clipping norm flips every gradient (torch scales by max_norm / norm), a negative loss
    coefficient maximises its loss, a smoothing >= 1 makes the teacher's probabilities negative, a
    ``context_drop`` outside [0, 1] is silently 0 or 1 on a plain CEPE stage, ``teacher_examples_per_shard: 0``
    divides by zero in the teacher pass, and a ``recall_span`` of another length failed to unpack: each is
    refused by name when the config loads."""
    with pytest.raises(ValueError, match=message):
        load_config(_tiny(tmp_path, **over))


def test_config_still_takes_the_limits(tmp_path):
    """The bounds themselves stay valid: no clipping (null or 0), zero coefficients, no smoothing, context
    drop 0 and 1."""
    for over in (
        {"optim": {"max_grad_norm": None}},
        {"optim": {"max_grad_norm": 0.0}},
        {"kl_coef": 0.0, "ce_coef": 0.0, "kl_smoothing": 0.0},
        {"context_drop": 1.0},
        {"context_drop": 0.0},
    ):
        load_config(_tiny(tmp_path, **over))


@pytest.mark.parametrize("when", ["rewrite", "rotation"])
def test_a_kill_while_deleting_a_checkpoint_leaves_no_partial_step_directory(tmp_path, monkeypatch, when):
    """A checkpoint is renamed out of the ``step_*`` names before it is deleted. Deleted in place, a kill
    part-way left a ``step_*`` directory with its state file and without its weights, which
    ``checkpoint_dirs`` lists as complete (a resume would then fail or read the wrong weights)."""
    import shutil

    from cepe.training.checkpoint import checkpoint_dirs, save_checkpoint

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for step in (20, 40):
        save_checkpoint(tmp_path, step, model, opt, sched, {"step": step}, [{}], keep=2)
    real = shutil.rmtree

    def killed_part_way(path, *args, **kw):  # deletes the weights, then the process is gone
        for weights in Path(path).rglob("model.safetensors"):
            weights.unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed_part_way)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(
            tmp_path, 40 if when == "rewrite" else 60, model, opt, sched, {"step": 0}, [{}], keep=2
        )
    monkeypatch.setattr(shutil, "rmtree", real)
    listed = checkpoint_dirs(tmp_path)
    assert listed and all((p / "mlm" / "model.safetensors").is_file() for _, p in listed), listed
    save_checkpoint(tmp_path, 80, model, opt, sched, {"step": 80}, [{}], keep=2)  # the next save tidies up
    assert all((p / "mlm" / "model.safetensors").is_file() for _, p in checkpoint_dirs(tmp_path))
    assert not list((tmp_path / "checkpoints").glob(".old-*"))
