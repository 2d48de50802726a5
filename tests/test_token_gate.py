"""Per-token head strengths (``CepeConfig.token_gate``): head h's output times 2·σ(w_h·RMSNorm(h_t) + b_h).

The cache modes agree with token gates: ``tests/test_model.py::test_cache_modes_agree``."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, heads_scaled, random_context, randomize_cross, tiny_cepe_config, tiny_decoder

from cepe import CepeForCausalLM


def _ids(b: int = 2, t: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(5))


def _gated(seed: int = 3, **kw) -> CepeForCausalLM:
    model = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(token_gate=True, **kw)).eval()
    randomize_cross(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.cross_attention_modules():
            m.token_gate.weight.copy_(torch.randn(m.token_gate.weight.shape, generator=g))
            m.token_gate.bias.copy_(torch.randn(m.token_gate.bias.shape, generator=g))
    return model


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_layer_output_by_hand(impl):
    model = _gated(attn_implementation=impl)
    enc_ids, enc_mask = random_context(2, 3)
    ctx = model.prepare_context(enc_ids, enc_mask, cross_attention_cache="states")
    m = model.cross_attention_modules()[0]
    hidden = torch.randn(2, 5, m.q_proj.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = m(hidden, ctx)
        gate, m.token_gate = m.token_gate, None
        want = heads_scaled(m, hidden, ctx, 2 * torch.sigmoid(gate(m.layernorm(hidden))))  # (B, T, H)
        m.token_gate = gate
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "gate,base", [("token_gate", {}), ("match_gate", {}), ("match_gate", {"token_gate": True})]
)
def test_zero_gates_are_exactly_the_adapter_without_them(gate, base):
    """Fresh (zero) token or match gates give 2·σ(0) = 1: the same logits as the same weights without them,
    and enable_token_gate / enable_match_gate add them to a trained adapter without changing its function."""
    plain = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(**base)).eval()
    randomize_cross(plain)
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    enable = getattr(plain, f"enable_{gate}")
    with torch.no_grad():
        before = plain(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        enable()
        enable()  # idempotent
        after = plain(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert getattr(plain.cepe_config, gate)
    assert torch.equal(before, after)
    fresh = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(**{gate: True}, init_mode="gate"))
    for m in fresh.cross_attention_modules():
        g = getattr(m, gate)
        assert not any(w.any() for w in (g.parameters() if isinstance(g, torch.nn.Module) else [g]))


def test_gate_changes_the_function_and_invariants_hold():
    model = _gated()
    ids = _ids()
    enc_ids, enc_mask = random_context(2, 3)
    with torch.no_grad():
        a = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        ref = tiny_decoder()(ids).logits
        assert torch.equal(model(ids).logits, ref)  # no context: exactly the decoder
        for m in model.cross_attention_modules():
            m.token_gate.weight.zero_()
            m.token_gate.bias.zero_()
        b = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert (a - b).abs().max().item() > 1e-3


def test_token_gate_saves_and_loads(tmp_path):
    model = _gated()
    model.save_pretrained(tmp_path)
    loaded = CepeForCausalLM.from_pretrained(tmp_path, decoder=tiny_decoder()).eval()
    assert loaded.cepe_config.token_gate
    for a, b in zip(model.cross_attention_modules(), loaded.cross_attention_modules()):
        assert torch.equal(a.token_gate.weight, b.token_gate.weight) and torch.equal(
            a.token_gate.bias, b.token_gate.bias
        )
    with pytest.raises(ValueError):  # an adapter with token gates does not fit a model without them
        CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config()).load_adapter_state_dict(
            model.adapter_state_dict()
        )


@pytest.mark.parametrize(
    "cepe,attr,extra,parts",
    [
        ({"token_gate": True}, "token_gate", {}, (".token_gate.",)),
        ({"match_gate": True}, "match_gate", {}, (".match_gate", ".match_norm")),
        ({"match_gate": True}, "match_gate", {"match_gate_calibrate": 2}, (".match_gate", ".match_norm")),
        ({"length_scale": 7}, "length_exp", {}, (".length_exp",)),
        ({"length_scale": 7, "length_scale_above": True}, "length_exp_above", {}, (".length_exp_above",)),
        ({"length_scale": 7, "short_gate": True}, "short_gate", {}, (".short_gate.",)),
        ({"length_scale": 7, "long_gate": True}, "long_gate", {}, (".long_gate.",)),
        ({"induction_gate": True}, "induction_gate", {}, (".induction_gate",)),
        ({"run_bias": True}, "run_bias", {}, (".run_bias",)),
    ],
)
def test_a_stage_adds_gates_and_trains_only_them(tmp_path, cepe, attr, extra, parts):
    """``cepe: {token_gate: true}`` (or ``match_gate``, its norms calibrated or not, or ``length_scale``,
    with or without the exponents above the pivot) over an ``init_adapter`` trained without, with
    ``train_only`` naming the new weights: zero weights that train, every other adapter weight unchanged
    (new ones left out of ``train_only`` stay zero)."""
    import yaml

    from cepe.training.config import load_config
    from cepe.training.models import build_decoder
    from cepe.training.trainer import train

    d = yaml.safe_load(open("configs/train/tiny/cepe.yaml"))
    d.pop("init_adapter")
    d.update(steps=2, progress=False, encoder_init="decoder", encoder={"num_hidden_layers": 1})
    d["cepe"] = {**(d.get("cepe") or {}), "init_mode": "copy"}
    first = train(load_config({**d, "output_dir": str(tmp_path / "first")}))
    dec = lambda: build_decoder(load_config({**d, "output_dir": "unused"}))  # noqa: E731
    start = CepeForCausalLM.from_pretrained(first, decoder=dec())
    option = next(iter(cepe))
    assert not getattr(start.cepe_config, option)
    cfg = load_config(
        {
            **d,
            "output_dir": str(tmp_path / "run"),
            "init_adapter": str(first),
            "cepe": cepe,
            "train_only": [attr],
            "optim": {"lr": 1e-2},
            **extra,
        }
    )
    trained = CepeForCausalLM.from_pretrained(train(cfg), decoder=dec())
    assert all(getattr(trained.cepe_config, k) == v for k, v in cepe.items())
    before = start.adapter_state_dict()
    after = trained.adapter_state_dict()
    moved = {
        k for k in after if (after[k].any() if k not in before else not torch.equal(before[k], after[k]))
    }
    assert moved and all(any(p in k for p in parts) for k in moved)
    if extra.get("match_gate_calibrate"):  # means and spreads of real statistics, not (0, 1, 0, 1)
        norms = torch.stack([m.match_norm for m in trained.cross_attention_modules()])
        assert torch.isfinite(norms).all() and (norms[..., 1::2] > 0).all()
        assert (norms[..., 0] != 0).all() and (norms[..., 2] > 0).all() and (norms[..., 2] < 1).all()
    gates = [getattr(m, attr) for m in trained.cross_attention_modules()]
    weights = [w for g in gates for w in (g.parameters() if isinstance(g, torch.nn.Module) else [g])]
    assert any(w.abs().sum() > 0 for w in weights)


def test_match_gate_calibration_reads_the_drawn_layouts(tmp_path):
    """``match_gate_calibrate`` standardises the statistics of the micro-batches training builds, at their
    drawn layouts (``context_chunks``): one chunk of context gives other norms than the full four."""
    import yaml

    from cepe.training.config import load_config
    from cepe.training.trainer import train

    d = yaml.safe_load(open("configs/train/tiny/cepe.yaml"))
    d.pop("init_adapter")
    d.update(steps=1, progress=False, match_gate_calibrate=2)
    d["cepe"] = {**(d.get("cepe") or {}), "match_gate": True}

    def norms(**over) -> torch.Tensor:
        from cepe.training.models import build_decoder

        cfg = load_config({**d, "output_dir": str(tmp_path / str(len(over))), **over})
        model = CepeForCausalLM.from_pretrained(train(cfg), decoder=build_decoder(cfg))
        return torch.stack([m.match_norm for m in model.cross_attention_modules()])

    full, one = norms(), norms(context_chunks=[1])
    assert not torch.allclose(full, one)
