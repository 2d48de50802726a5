"""Scripts whose numbers the docs quote: medians over an even count of heads (length_exp_stats), swept
values as they were given (sweep_table), clear errors where a measurement has nothing to average
(train_speed), the fixed-target splits read the context in the evaluation's chunks (fixedppl_split,
fixedppl_parts), and the report scripts' result files written atomically."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import load_script
from safetensors.torch import save_file


def test_length_exp_stats_medians_are_the_mean_of_the_two_middle_values(tmp_path):
    """Four heads over two layers: the median of 0, 0.1, 0.2, 0.3 is 0.15 (not the lower middle 0.1)."""
    (tmp_path / "a").mkdir()
    state = {}
    for i, exps in enumerate(([0.0, 0.1], [0.2, 0.3])):
        layer = f"decoder.model.layers.{i}.cross_attn."
        state[layer + "length_exp"] = torch.tensor(exps)
        state[layer + "short_gate.weight"] = torch.ones(2, 4)
        state[layer + "short_gate.bias"] = torch.tensor([-1.0, 1.0]) * (i + 1)
    save_file(state, str(tmp_path / "a" / "adapter_model.safetensors"))
    res = load_script("length_exp_stats").stats(str(tmp_path / "a"), align_heads=1)
    assert res["length_exp"]["median"] == pytest.approx(0.15)
    assert res["length_exp"]["median_align_heads"] == pytest.approx(0.1)  # 0 and 0.2
    assert res["length_exp"]["median_other_heads"] == pytest.approx(0.2)  # 0.1 and 0.3
    assert res["short_gate"]["median_bias"] == pytest.approx(0.0)  # -2, -1, 1, 2


def _needle_json(path, cells):
    path.mkdir(parents=True)
    (path / "needle.json").write_text(
        json.dumps({"rows": [{"setting": {"total": t}, "value": v, "answer_nll": 0.5} for t, v in cells]})
    )


def test_sweep_table_shows_each_swept_value_as_given(tmp_path):
    """Chunk lengths of four digits stand in the table as given, not rounded to three digits."""
    mod = load_script("sweep_table")
    for n in (512, 1024, 2048):
        _needle_json(tmp_path / f"chunk_{n}" / "needle", [(2048, 100.0), (2048, 0.0)])
    mod.main(
        [str(tmp_path), "ADAPTER", "chunk_length", "chunk", "chunk_length", "title", "512", "1024", "2048"]
    )
    md = (tmp_path / "chunk_length.md").read_text().splitlines()
    assert [line.split("|")[1].strip() for line in md[4:]] == ["512", "1024", "2048"]
    rows = json.loads((tmp_path / "chunk_length.json").read_text())["rows"]
    assert [r["chunk_length"] for r in rows] == [512, 1024, 2048] and rows[0]["needle_2048"] == 50.0


@pytest.mark.parametrize("flag, value", [("--steps", "1"), ("--rounds", "0")])
def test_train_speed_refuses_runs_with_no_timed_step(monkeypatch, tmp_path, flag, value):
    """A run's first step is not timed: one step a run (or no round) leaves nothing to average."""
    mod = load_script("train_speed")
    called = []
    monkeypatch.setattr(mod, "one_run", lambda *a, **k: called.append(a))
    monkeypatch.setattr(sys, "argv", ["train_speed.py", flag, value, "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit) as err:
        mod.main()
    assert err.value.code == 2 and not called


def _fixed_case():
    """A tiny adapter (encoder chunks of 8) with non-zero cross-attention, a fixedppl config whose context
    pieces are 16 tokens (the evaluation splits each into two chunks), and one sequence."""
    from conftest import randomize_cross, tiny_cepe_config, tiny_decoder

    from cepe import CepeForCausalLM
    from cepe.eval.tasks.fixedppl import Config

    model = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config()).eval()
    randomize_cross(model)
    assert model.cepe_config.chunk_length == 8
    cfg = Config(contexts=[0, 40], decoder_window=24, eval_tokens=8, chunk_length=16)
    seq = torch.randint(1, 60, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    return model, cfg, seq


def _eval_request(cfg, seq, context):
    from cepe.eval.common import chunk_tail_aligned
    from cepe.eval.methods import standard_request

    w = cfg.decoder_window
    pieces = chunk_tail_aligned(seq[len(seq) - w - context : len(seq) - w], cfg.chunk_length)
    return standard_request("cepe", pieces, seq[-w:], cfg.eval_tokens)


def test_fixedppl_split_scores_the_tokens_as_the_evaluation_does(monkeypatch):
    """Each scored token's NLL is the one ``cepe eval fixedppl`` scores (its CEPE method's request and
    chunks), also where the config's pieces are longer than the adapter's chunks."""
    from cepe.eval.methods import CepeMethod

    monkeypatch.setenv("CEPE_BF16", "0")
    model, cfg, seq = _fixed_case()
    nll, _ = load_script("fixedppl_split").token_nll(model, seq, 40, cfg)
    want = -CepeMethod(model).score([_eval_request(cfg, seq, 40)])[0]
    torch.testing.assert_close(torch.tensor(nll), want, rtol=1e-5, atol=1e-5)


def test_fixedppl_parts_records_the_context_in_the_evaluations_chunks(monkeypatch):
    from cepe.eval.methods import CepeMethod

    mod = load_script("fixedppl_parts")
    model, cfg, seq = _fixed_case()
    seen = []
    monkeypatch.setattr(
        mod, "record_batch", lambda m, batch, bf16: seen.append(batch) or [0] * cfg.eval_tokens
    )
    mod.stats_at(model, seq, 40, cfg)
    ids, mask = CepeMethod(model).encoder_inputs([_eval_request(cfg, seq, 40)])
    assert torch.equal(seen[0]["encoder_attention_mask"], mask)
    assert torch.equal(seen[0]["encoder_input_ids"][mask], ids[mask])


def _replaced(monkeypatch) -> list[str]:
    """The names of the files ``os.replace`` puts in place (an atomic write's last move) from now on."""
    import os

    moved: list[str] = []
    real = os.replace

    def replace(src, dst, *a, **k):
        moved.append(os.path.basename(dst))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", replace)
    return moved


def test_result_files_are_written_aside_and_moved_in_place(monkeypatch, tmp_path):
    """Every result file of the report scripts is written to a temporary file and renamed over the old
    one: a reader, or a run stopped part-way, never finds a half-written table."""
    moved = _replaced(monkeypatch)
    _needle_json(tmp_path / "sw" / "s_1" / "needle", [(2048, 100.0)])
    load_script("sweep_table").main([str(tmp_path / "sw"), "A", "k", "s", "sweep", "title", "1"])
    assert {"sweep.json", "sweep.md"} <= set(moved)

    arms = tmp_path / "arms"
    (arms / "cepe_step10" / "lm_val").mkdir(parents=True)
    (arms / "cepe_step10" / "lm_val" / "lm.json").write_text(
        json.dumps({"rows": [{"setting": {"domain": "avg", "total": 1024}, "value": 20.0}]})
    )
    assert load_script("compare_arms").main([str(arms)]) == 0
    assert {"compare.json", "compare.md", "compare.png"} <= set(moved)

    runs, out = tmp_path / "runs", tmp_path / "recipe"
    (runs / "v").mkdir(parents=True)
    (runs / "v" / "log.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 5.0 - s / 10, "step_s": 2.0}) + "\n" for s in range(1, 4))
    )
    load_script("recipe_report").main(runs, out)
    assert {"recipe.json", "recipe.md", "recipe.png"} <= set(moved)

    speed = load_script("train_speed")
    run = {"step_s": 1.0, "decoder_tokens_per_s": 10.0, "encoder_tokens_per_s": 20.0, "peak_fraction": 0.1}
    monkeypatch.setattr(speed, "one_run", lambda *a, **k: {**run, "losses": [3.0, 2.9]})
    monkeypatch.setattr(
        sys, "argv", ["train_speed.py", "--stages", "warmup", "--out", str(tmp_path / "speed")]
    )
    assert speed.main() == 0
    assert {"train_speed.json", "train_speed.md"} <= set(moved)

    needle = load_script("needle_probe")
    layer = {"needle": 0.2, "best_head": 0.5, "null": 0.1, "by_token": [0.5]}
    row = {"total": 2048, "depth": 0.5, "encoder_tokens": 100, "uniform": 0.01, "layers": {3: layer}}
    row |= {"next": [["a", 0.5]], "alone": [["b", 0.4]]}
    monkeypatch.setattr(needle, "load_model", lambda adapter: (None, None, None))
    monkeypatch.setattr(needle, "probe", lambda *a, **k: [row])
    monkeypatch.setattr(sys, "argv", ["needle_probe.py", "ADAPTER", "--json", str(tmp_path / "np.json")])
    needle.main()
    assert {"np.json", "np.md"} <= set(moved)
    assert json.loads((tmp_path / "np.json").read_text())[0]["layers"]["3"] == layer
