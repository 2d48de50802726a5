"""Adapter weight averaging (cepe.soup): the exact weighted mean, written as a loadable adapter, and clear
errors for adapters that cannot be averaged."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, random_context, randomize_cross, tiny_cepe_config, tiny_decoder

from cepe.modeling import CepeForCausalLM
from cepe.soup import average_adapters


def _adapter(tmp_path, name, seed, **cfg):
    model = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config(**cfg)).eval()
    randomize_cross(model, seed=seed)
    model.save_pretrained(tmp_path / name)
    return model


def test_average_is_the_weighted_mean_and_loads(tmp_path):
    a, b = _adapter(tmp_path, "a", 1), _adapter(tmp_path, "b", 2)
    out = average_adapters([tmp_path / "a", tmp_path / "b"], tmp_path / "avg", weights=[3, 1])
    avg = CepeForCausalLM.from_pretrained(out, decoder=tiny_decoder()).eval()
    sa, sb, sm = a.adapter_state_dict(), b.adapter_state_dict(), avg.adapter_state_dict()
    assert set(sm) == set(sa)
    for k in sa:
        torch.testing.assert_close(sm[k], 0.75 * sa[k] + 0.25 * sb[k])
    # weight 1 on one adapter gives that adapter's function exactly
    one = CepeForCausalLM.from_pretrained(
        average_adapters([tmp_path / "a", tmp_path / "b"], tmp_path / "one", weights=[1, 0]),
        decoder=tiny_decoder(),
    ).eval()
    ids, mask = random_context(1, 2)
    x = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        want = a(input_ids=x, encoder_input_ids=ids, encoder_attention_mask=mask).logits
        got = one(input_ids=x, encoder_input_ids=ids, encoder_attention_mask=mask).logits
    torch.testing.assert_close(got, want)


def test_average_refuses_what_cannot_be_averaged(tmp_path):
    _adapter(tmp_path, "a", 1)
    _adapter(tmp_path, "c", 1, chunk_length=4)
    with pytest.raises(ValueError, match=r"differ in \['chunk_length'\]"):
        average_adapters([tmp_path / "a", tmp_path / "c"], tmp_path / "x")
    with pytest.raises(ValueError, match="at least two adapters"):
        average_adapters([tmp_path / "a"], tmp_path / "x")
    with pytest.raises(ValueError, match="one non-negative weight per adapter"):
        average_adapters([tmp_path / "a", tmp_path / "a"], tmp_path / "x", weights=[1, -1])
    with pytest.raises(ValueError, match="not a cepe adapter directory"):
        average_adapters([tmp_path / "a", tmp_path / "nothing"], tmp_path / "x")


def test_average_takes_a_config_saved_before_a_field_existed(tmp_path):
    """An adapter whose ``cepe_config.json`` lacks a field added later (it loads with the default) is the
    same config as one that writes the default: before, the raw files were compared and the pair refused
    ("differ in ['run_bias']"), though both load to one config."""
    import json

    a, b = _adapter(tmp_path, "a", 1), _adapter(tmp_path, "b", 2)
    file = tmp_path / "b" / "cepe_config.json"
    raw = json.loads(file.read_text())
    assert raw.pop("run_bias") is False and raw.pop("context_scale") == 1.0
    file.write_text(json.dumps(raw))
    out = average_adapters([tmp_path / "a", tmp_path / "b"], tmp_path / "avg")
    avg = CepeForCausalLM.from_pretrained(out, decoder=tiny_decoder()).eval()
    sa, sb, sm = a.adapter_state_dict(), b.adapter_state_dict(), avg.adapter_state_dict()
    for k in sa:
        torch.testing.assert_close(sm[k], 0.5 * sa[k] + 0.5 * sb[k])
    _adapter(tmp_path, "c", 1, run_bias=True)  # a field that differs is still refused
    with pytest.raises(ValueError, match=r"differ in \['run_bias'\]"):
        average_adapters([tmp_path / "b", tmp_path / "c"], tmp_path / "x")


@pytest.mark.parametrize("weights", [[float("inf"), 1.0], [1e308, 1e308]])
def test_average_refuses_weights_that_are_not_finite(tmp_path, weights):
    """An infinite weight (or weights whose sum overflows) normalised to NaN or zero shares: before, an
    adapter of NaN (or zero) tensors was written without a word."""
    _adapter(tmp_path, "a", 1)
    _adapter(tmp_path, "b", 2)
    with pytest.raises(ValueError, match="one non-negative weight per adapter.*finite"):
        average_adapters([tmp_path / "a", tmp_path / "b"], tmp_path / "x", weights=weights)
    assert not (tmp_path / "x").exists()
