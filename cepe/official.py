"""Loading checkpoints in the released CEPE layout (``LlamaForCausalContextLM``).

A released directory holds a stock ``LlamaConfig`` with extra keys (``encoder_config``,
``num_cross_attn_layers``, ...) and the full weights (decoder + ``encoder.*`` + ``model.layers.{i}.cross_attn.*``)
as ``pytorch_model.bin``, sharded bins with an index, or safetensors. Pickled files load only with
``weights_only=True``. The decoder's causal/bidirectional behaviour never depends on ``is_decoder``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from .config import CepeConfig, EncoderConfig, is_adapter_key

# Keys the released config adds to LlamaConfig; they describe CEPE, not the decoder.
CEPE_CONFIG_KEYS = (
    "is_decoder",
    "do_cross_attention",
    "num_cross_attn_layers",
    "num_cross_attn_hidden_states",
    "encoder_is_model",
    "train_encoder",
    "encoder_hidden_size",
    "encoder_config",
    "encode_mode",
    "train_batch_mode",
    "offload_hidden_states",
    "lm_loss_cof",
    "kl_loss_cof",
    "kl_loss_mode",
    "architectures",
)
# Heads of the standalone masked-LM encoder; not part of the CEPE encoder.
MLM_HEAD_KEYS = ("lm_dense.", "lm_layer_norm.", "lm_head.", "lm_bias")


def load_state_dict_files(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory: safetensors (single or sharded) or ``pytorch_model*.bin``
    (single or sharded), pickles loaded with ``weights_only=True``."""
    path = Path(path)
    for index_name, loader in (
        ("model.safetensors.index.json", load_file),
        ("pytorch_model.bin.index.json", _load_bin),
    ):
        if (path / index_name).exists():
            with open(path / index_name) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            state: dict[str, torch.Tensor] = {}
            for name in files:
                state.update(loader(path / name))
            return state
    if (path / "model.safetensors").exists():
        return load_file(path / "model.safetensors")
    if (path / "pytorch_model.bin").exists():
        return _load_bin(path / "pytorch_model.bin")
    raise FileNotFoundError(
        f"no weights in {path}: expected model.safetensors, pytorch_model.bin, or a sharded index json"
    )


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    return torch.load(file, map_location="cpu", weights_only=True)


def cepe_config_from_official(raw: dict, decoder_name_or_path: str | None = None) -> CepeConfig:
    """Translate a released ``config.json`` into a :class:`CepeConfig`."""
    if "encoder_config" not in raw:
        raise ValueError("not a released CEPE config: it has no 'encoder_config'")
    _check_supported(raw)
    enc = raw["encoder_config"]
    heads = int(enc["num_attention_heads"])
    encoder = EncoderConfig(
        vocab_size=int(enc["vocab_size"]),
        hidden_size=int(enc["hidden_size"]),
        num_hidden_layers=int(enc["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(enc.get("num_key_value_heads") or heads),
        head_dim=enc.get("head_dim"),
        intermediate_size=int(enc["intermediate_size"]),
        rms_norm_eps=float(enc.get("rms_norm_eps", 1e-6)),
        rope_theta=float(enc.get("rope_theta", 10000.0)),
    )
    if int(raw.get("encoder_hidden_size", encoder.hidden_size)) != encoder.hidden_size:
        raise ValueError(
            f"encoder_hidden_size {raw['encoder_hidden_size']} disagrees with encoder_config.hidden_size "
            f"{encoder.hidden_size}"
        )
    n_cross = raw.get("num_cross_attn_layers")
    return CepeConfig(
        encoder=encoder,
        decoder_name_or_path=decoder_name_or_path,
        num_cross_attn_layers=int(n_cross) if n_cross is not None else None,
        init_mode="copy",
        extra={k: raw[k] for k in ("kl_loss_cof", "kl_loss_mode", "lm_loss_cof") if k in raw},
    )


def _check_supported(raw: dict) -> None:
    """Refuse released-config options that change the computation in ways this model does not implement
    (the weights would load and silently compute something else)."""
    hidden_states = raw.get("num_cross_attn_hidden_states", 1)
    if hidden_states not in (None, 1):
        raise ValueError(
            f"num_cross_attn_hidden_states {hidden_states!r}: cross-attention here reads only the encoder's last "
            "hidden state (num_cross_attn_hidden_states 1), so this checkpoint cannot be loaded"
        )
    mode = raw.get("encode_mode", "context_only")
    if mode not in (None, "context_only"):
        raise ValueError(
            f"encode_mode {mode!r}: the encoder here reads the context alone (encode_mode 'context_only'), "
            "so this checkpoint cannot be loaded"
        )
    if raw.get("encoder_is_model"):
        raise ValueError(
            "encoder_is_model is true: this checkpoint encodes the context with the decoder itself, which is "
            "not supported; only checkpoints with a separate encoder (encoder.* weights) load"
        )


def read_official(
    path: str | os.PathLike[str], decoder: nn.Module | str | None = None, dtype: torch.dtype | None = None
) -> tuple[nn.Module, CepeConfig, dict[str, torch.Tensor]]:
    """Read a released checkpoint directory: ``(decoder, cepe config, adapter state dict)``, from which
    :meth:`cepe.modeling.CepeForCausalLM.from_pretrained` builds the model (this module does not import
    :mod:`cepe.modeling`, so the two do not import each other).

    Args:
        path: directory with ``config.json`` and the weights.
        decoder: use this decoder instead of the one stored in the checkpoint.
        dtype: dtype of every part of the model (decoder, encoder, cross-attention); default: the given
            decoder's dtype (fp32 for one built from the checkpoint or loaded by name), the encoder fp32.

    Raises:
        ValueError: naming missing, unexpected or mis-shaped keys.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    with open(path / "config.json") as f:
        raw = json.load(f)
    cfg = cepe_config_from_official(raw, decoder_name_or_path=str(path) if decoder is None else None)
    state = load_state_dict_files(path)
    state = {k: v for k, v in state.items() if not k.startswith(tuple("encoder." + h for h in MLM_HEAD_KEYS))}
    adapter = {k: v for k, v in state.items() if is_adapter_key(k)}
    if decoder is None:
        dec_cfg = LlamaConfig(**{k: v for k, v in raw.items() if k not in CEPE_CONFIG_KEYS})
        decoder = LlamaForCausalLM(dec_cfg).to(dtype or torch.float32).eval()
        dec_state = {k: v for k, v in state.items() if not is_adapter_key(k)}
        expected = decoder.state_dict()
        shapes = [
            f"{k}: checkpoint {tuple(v.shape)} vs config {tuple(expected[k].shape)}"
            for k, v in dec_state.items()
            if k in expected and tuple(v.shape) != tuple(expected[k].shape)
        ]
        if shapes:  # (load_state_dict would raise a RuntimeError)
            raise ValueError(
                f"released checkpoint {path}: decoder weights do not fit its config.json: {'; '.join(shapes[:8])}"
            )
        result = decoder.load_state_dict(dec_state, strict=False)
        missing = [
            k for k in result.missing_keys if not (k == "lm_head.weight" and dec_cfg.tie_word_embeddings)
        ]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"released checkpoint {path}: decoder keys missing {missing[:8]}, unexpected "
                f"{result.unexpected_keys[:8]}"
            )
    elif not isinstance(decoder, nn.Module):
        from .assets import load_decoder_model

        cfg.decoder_name_or_path = str(decoder)
        decoder = load_decoder_model(decoder, dtype=dtype)
    return decoder, cfg, adapter
