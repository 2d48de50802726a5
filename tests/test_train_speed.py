"""Training speed paths and run control on tiny configs (CPU, seconds): the fast paths compute the losses
of the reference path, the compute dtype is decided once and recorded, a killed or signalled run resumes
with identical losses, snapshots carry a stage to a new machine, status and profile are written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cepe.training.config import load_config
from cepe.training.runctl import read_status
from cepe.training.speed import chunked_head_cross_entropy, hold_frozen_linears, step_flops
from cepe.training.trainer import read_log, train

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "train" / "tiny"


def _cfg(name: str, out: Path, **over):
    items = [f"output_dir={out}", "progress=false", "num_threads=1", "peak_seconds=0"]
    items += [f"{k}={v}" for k, v in over.items()]
    return load_config(TINY / f"{name}.yaml", items)


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_log(out)]


# ----------------------------------------------------------------------------- chunked head loss
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_head_loss_matches_full_logits_fp32(chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(23, 16, generator=g, requires_grad=True)
    w = torch.randn(300, 16, generator=g)
    y = torch.randint(0, 300, (23,), generator=g)
    ref = F.cross_entropy(h @ w.t(), y)
    (gref,) = torch.autograd.grad(ref * 3.0, h)
    got = chunked_head_cross_entropy(h, w, y, chunk=chunk)
    (ggot,) = torch.autograd.grad(got * 3.0, h)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    # fp32 round-off of 300-term sums: a one-row chunk takes another matmul kernel on some CPUs (1.5e-7
    # seen on a Zen 4 core), far below the gradient's scale (about 1e-2)
    assert float(gref.abs().max()) > 1e-3
    torch.testing.assert_close(ggot, gref, rtol=1e-5, atol=1e-6)


def test_chunked_head_loss_matches_autocast_bf16():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(40, 32, generator=g, requires_grad=True)
    w = torch.randn(500, 32, generator=g)
    y = torch.randint(0, 500, (40,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(h, w).float(), y)
    (gref,) = torch.autograd.grad(ref, h)
    got = chunked_head_cross_entropy(h, w.bfloat16(), y, chunk=9)
    (ggot,) = torch.autograd.grad(got, h)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ggot, gref, rtol=2e-2, atol=1e-4)  # one bf16 rounding of the grad


def test_chunked_head_loss_refuses_trainable_head_and_empty_batch():
    h = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(ValueError, match="frozen"):
        chunked_head_cross_entropy(h, torch.randn(5, 4, requires_grad=True), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="-100"):
        chunked_head_cross_entropy(h[:0], torch.randn(5, 4), torch.zeros(0, dtype=torch.long))


# ----------------------------------------------------------------------------- frozen weights in bf16
def test_frozen_linears_in_bf16_give_the_same_autocast_outputs():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        before = model(ids).logits
    n = hold_frozen_linears(model, torch.bfloat16)
    assert n == 2 * 7  # q, k, v, o, gate, up, down per layer; the tied head stays with the embedding
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert model.model.norm.weight.dtype == torch.float32
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        after = model(ids).logits
    assert torch.equal(before, after)


# ----------------------------------------------------------------------------- tiny runs: same losses
@pytest.mark.parametrize("bf16", ["false", "true"])
@pytest.mark.parametrize("stage", ["warmup", "cepe"])
def test_fast_paths_keep_the_tiny_loss_curve(tmp_path, stage, bf16):
    init = {"init_encoder": "null"} if stage == "warmup" else {"init_adapter": "null"}
    # lr 1e-3: at the configs' 3e-3 these random-init runs are chaotic and amplify rounding differences
    kw = {"steps": 6, "save_every": 6, "bf16": bf16, "optim.lr": "1e-3", **init}
    ref = train(_cfg(stage, tmp_path / "ref", reference_path="true", **kw))
    fast = train(_cfg(stage, tmp_path / "fast", **kw))
    a, b = _losses(ref), _losses(fast)
    assert len(a) == 6 and max(a) - min(a) > 0.1  # the weights move
    # fp32: the same losses to 1e-5. bf16: on CPUs without bf16 units the emulated kernels round the two
    # paths' different op orders differently, and six steps amplify it (7.5e-5 measured on an AVX2 CPU).
    assert b == pytest.approx(a, rel=1e-5 if bf16 == "false" else 1e-3, abs=0), (a, b)


def test_attention_supervision_fast_path_keeps_the_tiny_loss_curve(tmp_path):
    """align_coef in a mixed stage: the attention loss over the supervised positions alone (fast) keeps
    the reference's losses (every position's scores), the alignment term logged the same."""
    kw = {
        "steps": 6,
        "save_every": 6,
        "optim.lr": "1e-3",
        "init_adapter": "null",
        "tasks": "{lm: 2, copy: 1, recall: 1}",
        "recall_cue": "4",
        "recall_span": "[4, 12]",
        "align_coef": "1.0",
        "micro_batch_size": "2",
    }
    ref = read_log(train(_cfg("cepe", tmp_path / "ref", reference_path="true", **kw)))
    fast = read_log(train(_cfg("cepe", tmp_path / "fast", **kw)))
    assert [r["loss"] for r in fast] == pytest.approx([r["loss"] for r in ref], rel=1e-5, abs=0)
    aligns = [r.get("align", 0.0) for r in ref]
    assert [r.get("align", 0.0) for r in fast] == pytest.approx(aligns, rel=1e-5, abs=1e-7)
    assert max(aligns) > 0.1  # supervised positions were there


@pytest.mark.parametrize(
    "match", [{}, {"cepe.mix_match": "3"}, {"cepe.mix_match": "3", "cepe.mix_copy": "true"}]
)
def test_output_mix_fast_path_keeps_the_tiny_loss_curve(tmp_path, match):
    """The mixture's loss from each side's target log-probability alone (fast) is the cross-entropy of
    the mixed logits (reference): for the whole adapter, then for the heads alone (``train_only``) over
    the adapter that trained, which learn; also with the suffix-match inputs (``mix_match``) and the
    copy (``mix_copy``)."""
    from cepe import CepeForCausalLM
    from cepe.training.models import build_decoder

    kw = {"steps": 6, "save_every": 6, "optim.lr": "1e-3", "init_adapter": "null", "cepe.output_mix": "true"}
    kw.update(match)
    whole = tmp_path / "whole"
    for first in (True, False):
        ref = train(_cfg("cepe", tmp_path / f"ref{first}", reference_path="true", **kw))
        fast = train(_cfg("cepe", whole if first else tmp_path / "head", **kw))
        a, b = _losses(ref), _losses(fast)
        assert len(a) == 6 and max(a) - min(a) > 1e-3
        assert b == pytest.approx(a, rel=1e-5, abs=0), (a, b)
        heads = "[mix_head, copy_head]" if "cepe.mix_copy" in match else "[mix_head]"
        kw.update({"init_adapter": str(whole), "train_only": heads, "optim.lr": "1e-2"})
    tiny = _cfg("cepe", tmp_path / "x")
    before = CepeForCausalLM.from_pretrained(whole, decoder=build_decoder(tiny))
    after = CepeForCausalLM.from_pretrained(tmp_path / "head", decoder=build_decoder(tiny))
    assert after.cepe_config.output_mix and not torch.equal(after.mix_head.weight, before.mix_head.weight)
    for (name, x), y in zip(before.adapter_state_dict().items(), after.adapter_state_dict().values()):
        assert name.startswith(("mix_head.", "copy_head.")) or torch.equal(x, y), name  # only heads trained
    if match:  # the match weights learned (the last 3 inputs)
        assert after.cepe_config.mix_match == 3 and after.mix_head.weight[0, -3:].abs().min() > 0
    if "cepe.mix_copy" in match:  # and the copy's head
        assert not torch.equal(after.copy_head.weight, before.copy_head.weight)


def test_output_mix_is_taught_in_stage_cepe_and_refused_by_ceped(tmp_path):
    """A mixture student takes a teacher in stage cepe (its mixed logits are taught); stage ceped scores
    the reader alone and refuses it."""
    assert _cfg("cepe", tmp_path, **{"cepe.output_mix": "true", "online_teacher": "true"}).online_teacher
    with pytest.raises(ValueError, match="stage ceped scores the reader alone"):
        _cfg("ceped", tmp_path, **{"cepe.output_mix": "true"})


def test_run_control_fields_leave_the_fingerprint_alone(tmp_path):
    base = _cfg("cepe", tmp_path / "a")
    other = _cfg(
        "cepe",
        tmp_path / "b",
        reference_path="true",
        save_every_minutes=3,
        snapshot_dir="snap",
        profile_steps=2,
        peak_seconds=1,
    )
    assert base.fingerprint() == other.fingerprint()
    # the value on main before these fields existed (runs written then must still resume; the released
    # KL default, kl_form "drop", had already changed it from 167ae0c1d2d0fd60)
    assert load_config(TINY / "cepe.yaml").fingerprint() == "bd2f6329eb803b83"


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"cepe.output_mix": "true"},
        {"cepe.output_mix": "true", "train_only": "[mix_head]"},
        {"cepe.output_mix": "true", "cepe.mix_match": "3"},
        {"cepe.output_mix": "true", "cepe.mix_match": "3", "cepe.mix_copy": "true"},
        {
            "cepe.output_mix": "true",
            "cepe.mix_match": "3",
            "cepe.mix_copy": "true",
            "cepe.mix_copy_prob": "true",
        },
        {"encoder.output_size": "16"},
    ],
)
def test_cost_model_counts_what_the_step_multiplies(tmp_path, extra):
    """The cost model against torch's FLOP counter on one tiny step (the counter sees the ``aten.mm`` of
    projections, MLPs and the head; the fused CPU attention kernel is not counted), also with the output
    mixture, whole adapter or mixing head alone, and with the encoder's down-projection (``output_size``)."""
    from torch.utils.flop_counter import FlopCounterMode

    from cepe.training.data import build_example, collate, window_source
    from cepe.training.models import StageModule, build_model

    over = dict(batch_size=4, micro_batch_size=4, bf16="false", chunk_noise=0)  # noise drops whole chunks
    cfg = _cfg("cepe", tmp_path / "f", init_adapter="null", **over, **extra)
    model = build_model(cfg)
    module = StageModule(model, cfg)
    src = window_source(cfg, 128)
    batch = collate([build_example(cfg, src[i], i, None) for i in range(4)])
    batch.pop("index")
    with FlopCounterMode(display=False) as counter:
        loss, _ = module(batch)
        loss.backward()
    module.release()
    counted = counter.get_total_flops()
    est = step_flops(cfg, model)
    assert est["total"] == est["forward"] + est["backward"] and est["attention"] > 0
    assert counted == pytest.approx(est["total"] - est["attention"], rel=1e-3), (est, counted)


# ----------------------------------------------------------------------------- compute dtype
def _stop_after_first_checkpoint(monkeypatch, writer: str = "save_checkpoint"):
    import cepe.training.trainer as trainer_mod

    class Killed(Exception):
        pass

    orig = getattr(trainer_mod, writer)

    def kill(*args, **kwargs):
        orig(*args, **kwargs)
        raise Killed

    monkeypatch.setattr(trainer_mod, writer, kill)
    return Killed, lambda: monkeypatch.setattr(trainer_mod, writer, orig)


def test_auto_dtype_is_recorded_and_kept_on_resume(tmp_path, monkeypatch):
    import cepe.compute

    kw = dict(init_adapter="null", steps=4, save_every=2, bf16="auto")  # tiny configs pin fp32
    monkeypatch.setenv("CEPE_BF16", "0")
    straight = train(_cfg("cepe", tmp_path / "a", **kw))
    cfg = _cfg("cepe", tmp_path / "b", **kw)
    killed, undo = _stop_after_first_checkpoint(monkeypatch)
    with pytest.raises(killed):
        train(cfg)
    undo()
    state = json.loads((tmp_path / "b" / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["compute_dtype"] == "float32"
    # the forced other dtype is refused, naming both
    monkeypatch.setenv("CEPE_BF16", "1")
    with pytest.raises(ValueError, match="trained in float32 .* bfloat16 .*--allow-dtype-change"):
        train(cfg, resume=True)
    # "auto" on a machine whose timing now says bf16: the run keeps float32 and its losses
    monkeypatch.delenv("CEPE_BF16")
    monkeypatch.setattr(cepe.compute, "bf16_is_fast", lambda device="cpu": True)
    train(cfg, resume=True)
    assert _losses(tmp_path / "b") == _losses(straight)
    status = read_status(tmp_path / "b")
    assert status["compute_dtype"] == "float32" and status["state"] == "done"


def test_dtype_change_needs_the_override(tmp_path, monkeypatch):
    kw = dict(init_adapter="null", steps=4, save_every=2, bf16="auto")
    monkeypatch.setenv("CEPE_BF16", "0")
    cfg = _cfg("cepe", tmp_path / "b", **kw)
    killed, undo = _stop_after_first_checkpoint(monkeypatch)
    with pytest.raises(killed):
        train(cfg)
    undo()
    monkeypatch.setenv("CEPE_BF16", "1")
    train(cfg, resume=True, allow_dtype_change=True)
    final = json.loads((tmp_path / "b" / "checkpoints" / "step_000004" / "trainer_state.json").read_text())
    assert final["compute_dtype"] == "bfloat16"


def test_dtype_decided_once_per_run(tmp_path, monkeypatch):
    import cepe.compute

    calls = []

    def fast(device="cpu"):
        calls.append(1)
        return False

    monkeypatch.delenv("CEPE_BF16", raising=False)
    monkeypatch.setattr(cepe.compute, "bf16_is_fast", fast)
    train(_cfg("cepe", tmp_path / "c", init_adapter="null", steps=3, save_every=3, bf16="auto"))
    assert len(calls) == 1


# ----------------------------------------------------------------------------- snapshots, status, profile
def test_snapshot_continues_a_stage_on_a_new_machine(tmp_path, monkeypatch):
    kw = dict(init_adapter="null", steps=6, save_every=3, bf16="false")
    straight = train(_cfg("cepe", tmp_path / "a", **kw))
    snap = tmp_path / "committed" / "cepe"
    cfg = _cfg("cepe", tmp_path / "b", snapshot_dir=snap, **kw)
    killed, undo = _stop_after_first_checkpoint(monkeypatch, "save_snapshot")
    with pytest.raises(killed):
        train(cfg)
    undo()
    assert json.loads((snap / "snapshot.json").read_text())["step"] == 3
    import shutil

    shutil.rmtree(tmp_path / "b")  # a new machine: only the committed snapshot survives
    train(cfg, resume=True)
    log = read_log(tmp_path / "b")
    assert [r["step"] for r in log] == [4, 5, 6]
    # step 4 runs on exactly the weights of step 3; later steps use a fresh optimizer state
    assert log[0]["loss"] == _losses(straight)[3]
    assert log[0]["lr"] == read_log(straight)[3]["lr"]
    assert (tmp_path / "b" / "adapter_model.safetensors").is_file()
    # a snapshot of another stage or config is refused
    other = _cfg("cepe", tmp_path / "c", snapshot_dir=snap, **{**kw, "optim.lr": 0.5})
    with pytest.raises(ValueError, match="snapshot"):
        train(other, resume=True)


def test_snapshot_save_killed_between_its_renames_keeps_the_previous_one(tmp_path, monkeypatch):
    """A save killed after moving the previous snapshot aside and before putting the new one in place
    leaves the previous one, which reading and the next save put back (before: no snapshot, and a resume
    on a new machine started at step 0)."""
    from cepe.training.models import build_model
    from cepe.training.runctl import load_snapshot, read_snapshot, save_snapshot

    model = build_model(_cfg("cepe", tmp_path / "m", init_adapter="null"))
    snap = tmp_path / "snap"
    save_snapshot(snap, model, {"step": 3})
    real = os.replace

    def killed_second(a, b):  # the new snapshot's rename into place, after the previous one moved aside
        if Path(b) == snap and Path(a).name.startswith(".snap.tmp-"):
            raise KeyboardInterrupt("killed between the renames")
        real(a, b)

    monkeypatch.setattr("cepe.training.runctl.os.replace", killed_second)
    with pytest.raises(KeyboardInterrupt):
        save_snapshot(snap, model, {"step": 6})
    monkeypatch.undo()
    assert not snap.exists()
    assert read_snapshot(snap) == {"step": 3}
    load_snapshot(snap, model)
    save_snapshot(snap, model, {"step": 6})
    assert read_snapshot(snap) == {"step": 6} and not (tmp_path / ".snap.old").exists()


def test_a_stage_says_done_only_once_its_output_is_saved(tmp_path, monkeypatch):
    """A run killed after its last step but before the stage's own output is written is not "done" (the
    chain would skip it for good); the status says "done" last."""
    import cepe.training.trainer as trainer

    def killed(run):
        raise KeyboardInterrupt("killed before the output")

    monkeypatch.setattr(trainer, "_save_artifact", killed)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg("warmup", tmp_path / "w", init_encoder="null", steps=2, save_every=2))
    assert read_status(tmp_path / "w")["state"] == "running"
    with pytest.raises(KeyboardInterrupt):  # killed again after resuming at the last step: still not done
        train(_cfg("warmup", tmp_path / "w", init_encoder="null", steps=2, save_every=2), resume=True)
    assert read_status(tmp_path / "w")["state"] == "running"
    monkeypatch.undo()
    out = train(_cfg("warmup", tmp_path / "w", init_encoder="null", steps=2, save_every=2), resume=True)
    assert read_status(out)["state"] == "done" and (out / "final_digests.json").is_file()


def test_status_and_profile(tmp_path, capsys):
    from cepe.training.cli import show_status

    out = train(_cfg("warmup", tmp_path / "w", init_encoder="null", steps=4, save_every=4, profile_steps=2))
    st = read_status(out)
    assert st["state"] == "done" and st["step"] == 4 and st["decoder_tokens_seen"] == 4 * 8 * 32
    assert st["decoder_tokens_per_s"] > 0 and st["loss_recent"] == pytest.approx(
        sum(_losses(out)) / 4, rel=1e-6
    )
    capsys.readouterr()
    assert show_status([str(out)]) == 0
    line = capsys.readouterr().out
    assert "warmup done" in line and "step 4/4" in line and "tok/s" in line
    table = (out / "profile.txt").read_text()
    assert "2 optimizer step(s)" in table and "aten::" in table
    rec = read_log(out)[-1]
    assert rec["decoder_tokens_per_s"] > 0 and rec["encoder_tokens_per_s"] > 0


# ----------------------------------------------------------------------------- other processes, signals
def _cli(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "cepe.training.cli",
        "train",
        "--stage",
        "cepe",
        "--config",
        str(TINY / "cepe.yaml"),
        "--output-dir",
        str(out),
        "--no-progress",
        "--set",
        "init_adapter=null",
        "--set",
        "bf16=false",
        "--set",
        "peak_seconds=0",
        "--set",
        "steps=30",
        "--set",
        "save_every=4",
        *extra,
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _wait(pred, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("the training process did not get there in time")
        time.sleep(0.05)


@pytest.mark.multiproc
def test_killed_run_resumes_in_a_new_shell_with_identical_losses(tmp_path):
    straight = subprocess.run(_cli(tmp_path / "a"), env=_env(), capture_output=True, text=True, timeout=300)
    assert straight.returncode == 0, straight.stderr[-2000:]
    out = tmp_path / "b"
    proc = subprocess.Popen(_cli(out), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(lambda: len(read_log(out)) >= 6)  # mid-run, after a checkpoint, between two others
        proc.kill()  # SIGKILL: no handler runs
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(read_log(out)) < 30
    res = subprocess.run(_cli(out, "--resume"), env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert _losses(out) == _losses(tmp_path / "a")


@pytest.mark.multiproc
def test_pause_resume_and_stop_by_signal(tmp_path):
    out = tmp_path / "s"
    proc = subprocess.Popen(
        _cli(out), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait(lambda: len(read_log(out)) >= 2)
        proc.send_signal(signal.SIGUSR1)
        _wait(lambda: (read_status(out) or {}).get("state") == "paused")
        step = read_status(out)["step"]
        time.sleep(1.0)
        assert len(read_log(out)) == step  # no step while paused
        proc.send_signal(signal.SIGUSR2)
        _wait(lambda: len(read_log(out)) >= step + 2)
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stdout[-2000:]
    st = read_status(out)
    assert st["state"] == "stopped"
    from cepe.training.checkpoint import checkpoint_dirs

    assert checkpoint_dirs(out)[-1][0] == st["step"] == len(read_log(out))  # the last step is kept
    res = subprocess.run(_cli(out, "--resume"), env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    straight = train(
        load_config(
            TINY / "cepe.yaml",
            [
                f"output_dir={tmp_path / 'a'}",
                "progress=false",
                "init_adapter=null",
                "bf16=false",
                "peak_seconds=0",
                "steps=30",
                "save_every=4",
                "num_threads=1",
            ],
        )
    )
    assert _losses(out) == _losses(straight)


def test_signal_sent_while_the_models_load_is_kept_for_the_first_step(tmp_path, monkeypatch):
    """A stop (or pause) sent during set-up is handled at the first step boundary: the handlers are in
    place before the models load, where SIGUSR1's default action would have ended the process."""
    import cepe.training.trainer as trainer
    from cepe.training.checkpoint import checkpoint_dirs
    from cepe.training.runctl import Stopped

    real, seen = trainer._setup, []

    def setup_then_signal(*args, **kwargs):
        seen.append(signal.getsignal(signal.SIGUSR1))
        if seen[-1] not in (signal.SIG_DFL, signal.SIG_IGN, None):  # installed: safe to send
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "_setup", setup_then_signal)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped) as info:
        train(_cfg("cepe", tmp_path / "s", init_adapter="null", bf16="false", steps=10, save_every=5))
    assert seen and seen[0] not in (signal.SIG_DFL, signal.SIG_IGN, None)
    assert info.value.step == 1 and checkpoint_dirs(tmp_path / "s")[-1][0] == 1
    assert signal.getsignal(signal.SIGTERM) == before  # restored


def test_status_of_a_run_without_status_file(tmp_path, capsys):
    """Runs of the trainer before status.json existed: the status comes from the config and the log."""
    from cepe.training.cli import show_status

    cfg = _cfg("cepe", tmp_path / "old", steps=10)
    (tmp_path / "old").mkdir()
    cfg.save(tmp_path / "old" / "train_config.json")
    log = [{"step": s, "loss": 5.0 - 0.1 * s, "step_s": 2.0} for s in range(1, 5)]
    (tmp_path / "old" / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    st = read_status(tmp_path / "old")
    assert st["stage"] == "cepe" and st["step"] == 4 and st["state"] == "running (from log)"
    assert st["decoder_tokens_seen"] == 4 * 8 * 32 and st["encoder_tokens_seen"] == 4 * 8 * 4 * 8
    assert st["decoder_tokens_per_s"] == pytest.approx(8 * 32 / 2.0) and st["eta_s"] == pytest.approx(12.0)
    assert st["loss_recent"] == pytest.approx(4.75)
    assert show_status([str(tmp_path / "old")]) == 0
    assert "ETA 0m12s" in capsys.readouterr().out


def test_status_says_running_as_soon_as_a_paused_run_resumes(tmp_path):
    """After SIGUSR2 the status file says ``running`` at once, not only when the next step ends (a
    step can take minutes, and a status still saying ``paused`` looks like a resume that did not take)."""
    import threading
    from types import SimpleNamespace

    from cepe.training.runctl import Signals
    from cepe.training.trainer import _after_step

    class Run(SimpleNamespace):
        def status(self, state, done):
            return {"state": state, "step": done}

    run = Run(main=True, out=tmp_path, cfg=SimpleNamespace(steps=10, stage="cepe"))
    signals = Signals()
    signals.paused = True
    spent: list[float] = []
    t = threading.Thread(target=lambda: spent.append(_after_step(run, signals, 3)))
    t.start()
    _wait(lambda: (read_status(tmp_path) or {}).get("state") == "paused", timeout=10)
    signals._on_resume(signal.SIGUSR2, None)
    t.join(timeout=10)
    assert not t.is_alive() and spent and spent[0] > 0
    st = read_status(tmp_path)
    assert (st["state"], st["step"]) == ("running", 3)
