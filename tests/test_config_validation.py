"""``EncoderConfig`` / ``CepeConfig`` validation: every field a config file can get wrong fails at once with a
``ValueError`` that names it and what to give, instead of a ZeroDivisionError, a TypeError deep in a forward
pass, non-finite logits, or a silently different meaning (``True`` read as 1)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from cepe.config import CepeConfig, EncoderConfig

ROOT = Path(__file__).resolve().parents[1]


def _enc(**kw) -> EncoderConfig:
    return EncoderConfig(
        **{"vocab_size": 98, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, **kw}
    )


@pytest.mark.parametrize(
    "kw, said",
    [
        ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive whole number"),
        ({"num_key_value_heads": -2}, "num_key_value_heads must be a positive whole number"),
        ({"head_dim": 0}, "head_dim must be a positive whole number"),
        ({"head_dim": -2}, "head_dim must be a positive whole number"),
        ({"head_dim": 3}, "even for RoPE"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps must be a finite number > 0"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps must be a finite number > 0"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number > 0"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"rope_theta": -10000.0}, "rope_theta"),
        ({"rope_theta": "10000"}, "rope_theta"),
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive whole number"),
        ({"hidden_size": 32.5}, "hidden_size must be a positive whole number"),
        ({"num_hidden_layers": True}, "num_hidden_layers must be a positive whole number"),
        ({"intermediate_size": 0}, "intermediate_size must be a positive whole number"),
        ({"output_size": 8.0}, "output_size"),
    ],
)
def test_encoder_fields_are_checked(kw, said):
    with pytest.raises(ValueError, match=said):
        _enc(**kw)


def test_unknown_encoder_keys_are_named():
    """A saved config's ``encoder`` dict with a key no encoder has: a ValueError naming it (was a bare TypeError)."""
    base = CepeConfig(encoder=_enc()).to_dict()
    bad = {**base, "encoder": {**base["encoder"], "num_layers": 2}}
    with pytest.raises(ValueError, match=r"unknown EncoderConfig keys \['num_layers'\]; known keys are"):
        CepeConfig.from_dict(bad)
    with pytest.raises(ValueError, match="needs vocab_size"):
        CepeConfig.from_dict({**base, "encoder": {"hidden_size": 32}})
    with pytest.raises(ValueError, match="encoder must be an EncoderConfig"):
        CepeConfig(encoder=[1, 2])
    assert CepeConfig.from_dict(base) == CepeConfig(encoder=_enc())


@pytest.mark.parametrize(
    "kw, said",
    [
        ({"encoder_micro_batch": 2.5}, "encoder_micro_batch must be a positive whole number"),
        ({"encoder_micro_batch": 0}, "encoder_micro_batch must be a positive whole number"),
        ({"chunk_length": 7.5}, "chunk_length must be a positive whole number"),
        ({"chunk_length": 8.0}, "chunk_length must be a positive whole number"),
        ({"chunk_length": True}, "chunk_length must be a positive whole number"),
        ({"num_cross_attn_layers": True}, "num_cross_attn_layers must be a positive whole number"),
        ({"num_cross_attn_layers": 1.5}, "num_cross_attn_layers must be a positive whole number"),
        ({"num_cross_attn_layers": 0}, "num_cross_attn_layers must be a positive whole number"),
        ({"length_scale": True}, "length_scale must be a positive number"),
        ({"length_scale": 2048.0}, "length_scale must be a positive number"),
        ({"cross_attention_layers": []}, "cross_attention_layers is empty"),
        (
            {"cross_attention_layers": [0, 1.5]},
            "cross_attention_layers must be a list of decoder layer indices",
        ),
        (
            {"cross_attention_layers": [True]},
            "cross_attention_layers must be a list of decoder layer indices",
        ),
        ({"cross_attention_layers": 3}, "cross_attention_layers must be a list of decoder layer indices"),
        ({"context_scale": "1"}, "context_scale must be a finite number"),
        ({"context_scale": None}, "context_scale must be a finite number"),
        ({"context_scale": True}, "context_scale must be a finite number"),
        ({"context_scale": float("inf")}, "context_scale must be a finite number"),
        ({"train_context_tokens": 0.5}, "train_context_tokens must be a positive whole number"),
        ({"score_scaling": "yarn", "train_context_tokens": -3}, "train_context_tokens must be a positive"),
        ({"score_scaling": "yarn"}, "score_scaling needs train_context_tokens"),
        (
            {"output_mix": True, "mix_match": 2, "mix_length": True, "mix_length_cap": 8192.5},
            "mix_length_cap",
        ),
        ({"output_mix": True, "mix_match": 2, "mix_copy": True, "mix_copy_decay": "1"}, "mix_copy_decay"),
    ],
)
def test_cepe_fields_are_checked(kw, said):
    with pytest.raises(ValueError, match=said):
        CepeConfig(encoder=_enc(), **kw)


def test_valid_values_still_pass():
    """Whole numbers of any integer type (numpy's included), ints for float fields, and the None defaults."""
    c = CepeConfig(
        encoder=_enc(num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=500000, output_size=16),
        chunk_length=np.int64(64),
        encoder_micro_batch=8,
        cross_attention_layers=[0, np.int64(2)],
        context_scale=1,
        score_scaling="yarn",
        train_context_tokens=4096,
        length_scale=2048,
    )
    assert c.cross_attention_layers == [0, 2] and all(type(i) is int for i in c.cross_attention_layers)
    assert CepeConfig(encoder=_enc(), num_cross_attn_layers=2).num_cross_attn_layers == 2


def test_saved_configs_in_the_repository_load():
    """The shipped adapter's config (and any saved next to runs) still loads, field for field."""
    shipped = ROOT / "adapters" / "smollm2-135m-cepe" / "cepe_config.json"
    if not shipped.is_file():
        pytest.skip("no shipped adapter in this checkout")
    c = CepeConfig.load(shipped)
    assert c.chunk_length == 64 and c.mix_match == 8 and c.mix_length_cap == 8192 and c.mix_hash == "wrap"
    assert c.encoder.head_dim == 64 and c.encoder.num_key_value_heads == 4
    again = CepeConfig.from_dict(dataclasses.asdict(c))
    assert again == c
