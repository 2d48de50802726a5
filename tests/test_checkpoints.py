"""Adapter save/load, the released checkpoint layout, and refusal of bad checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import VOCAB, random_context, randomize_cross, tiny_cepe_config, tiny_decoder
from safetensors.torch import load_file, save_file

from cepe import CepeForCausalLM
from cepe.modeling import ADAPTER_WEIGHTS


def _expected_keys(model: CepeForCausalLM) -> set[str]:
    keys = {f"encoder.{k}" for k in model.encoder.state_dict()}
    for i in model.cross_layers:
        for name in ("layernorm.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"):
            keys.add(f"model.layers.{i}.cross_attn.{name}")
    return keys


def test_save_load_round_trip(tmp_path):
    dec_dir = tmp_path / "decoder"
    tiny_decoder().save_pretrained(dec_dir)
    model = CepeForCausalLM.from_decoder(str(dec_dir), tiny_cepe_config()).eval()
    randomize_cross(model)
    model.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    assert set(saved) == _expected_keys(model)
    assert not any(
        k.startswith("model.embed_tokens") or ".mlp." in k and not k.startswith("encoder.") for k in saved
    )
    cfg = json.loads((tmp_path / "adapter" / "cepe_config.json").read_text())
    assert cfg["decoder_name_or_path"] == str(dec_dir)
    loaded = CepeForCausalLM.from_pretrained(tmp_path / "adapter").eval()  # decoder from the config
    ids = torch.randint(0, VOCAB, (2, 9))
    enc_ids, enc_mask = random_context(2, 3)
    with torch.no_grad():
        a = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        b = loaded(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert torch.equal(a, b)
    assert not list((tmp_path / "adapter").glob(".tmp-*"))
    from cepe.fileio import umask

    for f in (tmp_path / "adapter").iterdir():  # readable as `open` would create them (not 0600)
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask(), f.name


def test_load_refuses_bad_adapters(tmp_path):
    model = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config())
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / ADAPTER_WEIGHTS)
    bad = dict(state)
    bad.pop("model.layers.0.cross_attn.q_proj.weight")
    bad["encoder.extra.weight"] = torch.zeros(1)
    bad["encoder.norm.weight"] = torch.zeros(7)
    with pytest.raises(ValueError) as err:
        model.load_adapter_state_dict(bad)
    msg = str(err.value)
    assert (
        "model.layers.0.cross_attn.q_proj.weight" in msg
        and "encoder.extra.weight" in msg
        and "encoder.norm.weight" in msg
    )
    with pytest.raises(FileNotFoundError, match="neither a cepe adapter"):
        CepeForCausalLM.from_pretrained(tmp_path / "nothing")


def _write_official(tmp_path, fmt: str):
    """A released-layout checkpoint written from the documented names with random weights."""
    dec = tiny_decoder(seed=5)
    enc_hidden, n_cross = 32, 2
    g = torch.Generator().manual_seed(7)
    state = {k: v.clone() for k, v in dec.state_dict().items()}
    d, hd, heads, kv = 64, 16, 4, 2
    for i in range(3 - n_cross, 3):
        p = f"model.layers.{i}.cross_attn."
        state[p + "q_proj.weight"] = torch.randn(heads * hd, d, generator=g) * 0.1
        state[p + "k_proj.weight"] = torch.randn(kv * hd, enc_hidden, generator=g) * 0.1
        state[p + "v_proj.weight"] = torch.randn(kv * hd, enc_hidden, generator=g) * 0.1
        state[p + "o_proj.weight"] = torch.randn(d, heads * hd, generator=g) * 0.1
        state[p + "layernorm.weight"] = 1 + 0.1 * torch.randn(d, generator=g)
    enc_inter = 48
    state["encoder.embed_tokens.weight"] = torch.randn(VOCAB, enc_hidden, generator=g) * 0.1
    state["encoder.norm.weight"] = torch.ones(enc_hidden)
    for j in range(2):
        p = f"encoder.layers.{j}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[p + f"self_attn.{n}.weight"] = torch.randn(enc_hidden, enc_hidden, generator=g) * 0.1
        state[p + "mlp.gate_proj.weight"] = torch.randn(enc_inter, enc_hidden, generator=g) * 0.1
        state[p + "mlp.up_proj.weight"] = torch.randn(enc_inter, enc_hidden, generator=g) * 0.1
        state[p + "mlp.down_proj.weight"] = torch.randn(enc_hidden, enc_inter, generator=g) * 0.1
        state[p + "input_layernorm.weight"] = torch.ones(enc_hidden)
        state[p + "post_attention_layernorm.weight"] = torch.ones(enc_hidden)
    config = dec.config.to_dict()
    config.update(
        architectures=["LlamaForCausalContextLM"],
        is_decoder=True,
        do_cross_attention=True,
        num_cross_attn_layers=n_cross,
        num_cross_attn_hidden_states=1,
        encoder_is_model=False,
        train_encoder=True,
        encoder_hidden_size=enc_hidden,
        encode_mode="context_only",
        train_batch_mode="none",
        offload_hidden_states=False,
        lm_loss_cof=1.0,
        encoder_config={
            "model_type": "llama",
            "is_decoder": False,
            "vocab_size": VOCAB,
            "hidden_size": enc_hidden,
            "intermediate_size": enc_inter,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
        },
    )
    out = tmp_path / "official"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    if fmt == "bin":
        torch.save(state, out / "pytorch_model.bin")
    elif fmt == "sharded-bin":
        keys = sorted(state)
        half = len(keys) // 2
        parts = {
            "pytorch_model-00001-of-00002.bin": keys[:half],
            "pytorch_model-00002-of-00002.bin": keys[half:],
        }
        for name, ks in parts.items():
            torch.save({k: state[k] for k in ks}, out / name)
        index = {"weight_map": {k: name for name, ks in parts.items() for k in ks}}
        (out / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors")
    return out, state, dec


@pytest.mark.parametrize("fmt", ["bin", "sharded-bin", "safetensors"])
def test_official_layout_load(tmp_path, fmt):
    path, state, dec = _write_official(tmp_path, fmt)
    model = CepeForCausalLM.from_pretrained(path)
    assert model.cross_layers == [1, 2]
    for k, v in model.adapter_state_dict().items():
        assert torch.equal(v, state[k]), k
    for k, v in model.decoder.state_dict().items():
        if ".cross_attn." not in k:
            assert torch.equal(v, state[k]), k
    ids = torch.randint(0, VOCAB, (1, 7))
    enc_ids, enc_mask = random_context(1, 2)
    with torch.no_grad():
        out = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        ref = dec(ids).logits
    assert (out - ref).abs().max() > 1e-4  # the context is used
    assert torch.isfinite(out).all()


def test_official_layout_refuses_bad_shapes(tmp_path):
    path, state, _ = _write_official(tmp_path, "safetensors")
    state["model.layers.2.cross_attn.k_proj.weight"] = torch.zeros(3, 3)
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
    with pytest.raises(ValueError, match="mismatched shapes.*model.layers.2.cross_attn.k_proj.weight"):
        CepeForCausalLM.from_pretrained(path)


def test_pickles_load_weights_only(tmp_path, monkeypatch):
    path, _, _ = _write_official(tmp_path, "bin")
    seen = {}
    real = torch.load

    def spy(*args, **kwargs):
        seen["weights_only"] = kwargs.get("weights_only")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    CepeForCausalLM.from_pretrained(path)
    assert seen["weights_only"] is True


def _random_adapter(tmp_path):
    """A tiny CEPE model over a saved tiny decoder, its cross-attention random (a zero o_proj is no test)."""
    dec_dir = tmp_path / "decoder"
    tiny_decoder().save_pretrained(dec_dir)
    model = CepeForCausalLM.from_decoder(str(dec_dir), tiny_cepe_config()).eval()
    randomize_cross(model)
    return model


def test_int8_adapter_storage(tmp_path):
    from cepe.quant import SCALE_SUFFIX

    model = _random_adapter(tmp_path)
    model.save_pretrained(tmp_path / "q", quantize="int8")
    raw = load_file(tmp_path / "q" / ADAPTER_WEIGHTS)
    assert raw["encoder.embed_tokens.weight"].dtype == torch.int8
    assert {k for k in raw if not k.endswith(SCALE_SUFFIX)} == _expected_keys(model)
    loaded = CepeForCausalLM.from_pretrained(tmp_path / "q").eval()
    for k, v in model.adapter_state_dict().items():
        w = loaded.adapter_state_dict()[k]
        bound = v.abs().amax(dim=-1, keepdim=True) / 254 + 1e-7 if v.dim() == 2 else 0.0
        assert ((w - v).abs() <= bound).all(), k
    ids = torch.randint(0, VOCAB, (1, 9))
    enc_ids, enc_mask = random_context(1, 3)
    with torch.no_grad():
        a = model(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
        b = loaded(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert (a - b).abs().max().item() < 0.05 * a.abs().max().item()
    with pytest.raises(ValueError, match="quantize must be"):
        model.save_pretrained(tmp_path / "x", quantize="int4")


def test_int8_group_storage(tmp_path):
    """int8-g64: a scale per 64 columns; each element within half its group's step, never worse than per
    row, weights whose columns do not split into groups keep per-row scales, and a saved adapter loads."""
    from cepe.quant import (
        GROUP_SCALE_SUFFIX,
        SCALE_SUFFIX,
        dequantize_int8,
        quantize_int8,
        quantize_int8_groupwise,
        quantize_int8_rowwise,
    )

    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 256, generator=g)
    w[2, 5] = 40.0  # one outlier coarsens its whole row under per-row scales, one group under groups
    state = {"big": w, "odd": torch.randn(4, 100, generator=g), "norm": torch.randn(7, generator=g)}
    q = quantize_int8_groupwise(state)
    assert q["big"].dtype == torch.int8 and q["big" + GROUP_SCALE_SUFFIX].shape == (6, 4)
    assert "odd" + SCALE_SUFFIX in q and "odd" + GROUP_SCALE_SUFFIX not in q  # 100 columns: per row
    back = dequantize_int8(q)
    assert set(back) == set(state) and torch.equal(back["norm"], state["norm"])
    step = w.reshape(6, 4, 64).abs().amax(-1, keepdim=True) / 127
    assert ((back["big"] - w).reshape(6, 4, 64).abs() <= step / 2 + 1e-6).all()
    row = dequantize_int8(quantize_int8_rowwise(state))
    err_g, err_r = (back["big"] - w).abs(), (row["big"] - w).abs()
    assert err_g[2].max() <= err_r[2].max() + 1e-6 and err_g[2, 64:].max() < err_r[2, 64:].max() / 10
    assert torch.equal(back["odd"], row["odd"])
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_int8(state, "int4")
    bad = dict(q)
    bad["big" + GROUP_SCALE_SUFFIX] = q["big" + GROUP_SCALE_SUFFIX][:, :3]
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_int8(bad)

    model = _random_adapter(tmp_path)
    model.save_pretrained(tmp_path / "g", quantize="int8-g64")
    raw = load_file(tmp_path / "g" / ADAPTER_WEIGHTS)
    names = {k for k in raw if not k.endswith((SCALE_SUFFIX, GROUP_SCALE_SUFFIX))}
    assert names == _expected_keys(model)
    loaded = CepeForCausalLM.from_pretrained(tmp_path / "g").eval()
    want = dequantize_int8(quantize_int8_groupwise(model.adapter_state_dict()))
    for k, v in loaded.adapter_state_dict().items():
        assert torch.equal(v, want[k].to(v.dtype)), k


@pytest.mark.parametrize("mode", ["int8", "int8-g64"])
def test_int8_storage_keeps_narrow_tensors_exact(tmp_path, mode):
    """A match gate's standardisation ``(H, 4)`` (μ_m, σ_m, μ_κ, σ_κ), whose columns differ by orders of
    magnitude, is stored in fp32: one int8 scale per row would round σ_κ to 0 and the logits to NaN."""
    from cepe.quant import MIN_COLUMNS

    dec_dir = tmp_path / "decoder"
    tiny_decoder().save_pretrained(dec_dir)
    model = CepeForCausalLM.from_decoder(str(dec_dir), tiny_cepe_config(match_gate=True)).eval()
    randomize_cross(model)
    with torch.no_grad():
        for m in model.cross_attention_modules():
            m.match_norm.copy_(torch.tensor([5.0, 1.0, 0.3, 0.015]).repeat(m.num_heads, 1))
            m.match_gate.normal_(0, 1.0, generator=torch.Generator().manual_seed(1))
    model.save_pretrained(tmp_path / "q", quantize=mode)
    raw = load_file(tmp_path / "q" / ADAPTER_WEIGHTS)
    narrow = [k for k, v in model.adapter_state_dict().items() if v.dim() == 2 and v.shape[1] < MIN_COLUMNS]
    assert any(k.endswith("match_norm") for k in narrow)
    assert all(raw[k].dtype == torch.float32 for k in narrow)
    loaded = CepeForCausalLM.from_pretrained(tmp_path / "q").eval()
    for k in narrow:
        assert torch.equal(loaded.adapter_state_dict()[k].float(), model.adapter_state_dict()[k].float()), k
    ids = torch.randint(0, VOCAB, (1, 9))
    enc_ids, enc_mask = random_context(1, 3)
    with torch.no_grad():
        logits = loaded(ids, encoder_input_ids=enc_ids, encoder_attention_mask=enc_mask).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("mode", ["int8", "int8-g64"])
def test_export_keeps_the_weight_storage_it_read(tmp_path, mode):
    """``cepe export`` without ``quantize`` stores the weights as the adapter it read stored them: an int8
    adapter stays int8, its file bit for bit the same tensors (it wrote fp32, four times the size)."""
    from cepe.commands import ExportConfig, export_adapter, stored_quantization

    model = _random_adapter(tmp_path)
    model.save_pretrained(tmp_path / "q", quantize=mode)
    assert stored_quantization(tmp_path / "q") == mode
    export_adapter(ExportConfig(model=str(tmp_path / "q"), out=str(tmp_path / "again")))
    before, after = (
        load_file(tmp_path / "q" / ADAPTER_WEIGHTS),
        load_file(tmp_path / "again" / ADAPTER_WEIGHTS),
    )
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    model.save_pretrained(tmp_path / "f")
    assert stored_quantization(tmp_path / "f") is None


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("num_cross_attn_hidden_states", 2, "num_cross_attn_hidden_states 2"),
        ("encode_mode", "with_query-64", "encode_mode 'with_query-64'"),
        ("encoder_is_model", True, "encoder_is_model is true"),
    ],
)
def test_official_layout_refuses_what_it_would_compute_otherwise(tmp_path, key, value, message):
    """A released config whose cross-attention reads several encoder layers, whose encoder also reads the
    query, or whose encoder is the decoder: the weights have the same names and shapes, so before they
    loaded and the model silently computed something else (or failed on missing encoder keys)."""
    path, _, _ = _write_official(tmp_path, "safetensors")
    raw = json.loads((path / "config.json").read_text())
    raw[key] = value
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message):
        CepeForCausalLM.from_pretrained(path)


def test_group_quantization_keeps_narrow_tensors_fp32_for_any_group():
    """``quantize_int8_groupwise`` with a group narrower than :data:`MIN_COLUMNS` stored a ``(H, 4)``
    standardisation as int8 (one scale per group of 4 columns of unlike size), against its docstring; a
    ``(R, 0)`` tensor was stored in a form that could not be loaded back."""
    from cepe.quant import MIN_COLUMNS, dequantize_int8, quantize_int8_groupwise

    norm = torch.tensor([[5.0, 1.0, 0.3, 0.015]]).repeat(3, 1)
    q = quantize_int8_groupwise({"norm": norm, "empty": torch.zeros(2, 0)}, group=4)
    assert set(q) == {"norm", "empty"} and q["norm"].dtype == torch.float32
    back = dequantize_int8(q)
    assert torch.equal(back["norm"], norm) and back["empty"].shape == (2, 0)
    wide = torch.randn(3, 2 * MIN_COLUMNS)
    assert quantize_int8_groupwise({"w": wide}, group=4)["w"].dtype == torch.int8  # still quantized


def test_official_layout_refuses_decoder_weights_that_do_not_fit_the_config(tmp_path):
    """A decoder weight whose shape disagrees with ``config.json`` ended in torch's RuntimeError from
    ``load_state_dict``, though ``read_official`` documents a ValueError naming the mis-shaped keys (the
    command line turns only that into a clear error)."""
    path, state, _ = _write_official(tmp_path, "safetensors")
    state["model.norm.weight"] = torch.ones(7)
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"do not fit its config\.json: model\.norm\.weight: checkpoint \(7,\)"
    ):
        CepeForCausalLM.from_pretrained(path)
