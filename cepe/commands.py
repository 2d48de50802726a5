"""Core CLI commands: ``cepe generate`` (answer from a long context), ``cepe info`` and ``cepe export``.

Each command is a function of one dataclass (:func:`generate_text` of :class:`GenerateConfig`,
:func:`describe_model` of :class:`InfoConfig`, :func:`export_adapter` of :class:`ExportConfig`) whose fields
are the command's flags (:func:`cepe.configio.add_config_flags`); the model code they call is
:mod:`cepe.generation` and :mod:`cepe.modeling`, imported when a command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cepe.config import CACHE_MODES
from cepe.configio import add_config_flags, config_from_args


@dataclass
class GenerateConfig:
    """``cepe generate``: answer a prompt about a long context file.

    Attributes:
        prompt: the question or instruction.
        model: a CEPE adapter directory, a released checkpoint, or a decoder (then with an untrained
            encoder, announced on stderr).
        context: text file whose content goes to the encoder (default: no context).
        max_new_tokens: tokens generated (greedy).
        decoder_tokens: last context tokens kept in the decoder (before the prompt) instead of the encoder.
        cache: the cross-attention cache while decoding (default: the model's).
        chat: wrap the prompt in the tokenizer's chat template, when it has one.
    """

    prompt: str
    model: str = "default"
    context: str | None = None
    max_new_tokens: int = 64
    decoder_tokens: int = 0
    cache: str | None = field(default=None, metadata={"choices": CACHE_MODES})
    chat: bool = True


@dataclass
class InfoConfig:
    """``cepe info``: describe a CEPE model.

    Attributes:
        model: a CEPE adapter directory, a released checkpoint, or a decoder (then with an untrained encoder).
    """

    model: str = "default"


@dataclass
class ExportConfig:
    """``cepe export``: re-save an adapter (e.g. with int8 weight storage for shipping).

    Attributes:
        model: the CEPE adapter directory to read.
        out: the directory to write.
        quantize: weight storage of the written adapter (default: as loaded): ``int8`` (a scale per row) or
            ``int8-g64`` (a scale per 64 columns of a row; about 5 % larger, closer to the weights).
        decoder_name: decoder name to record in the adapter's config, e.g. ``default`` (default: keep the
            recorded one).
        drop_mixture: write the adapter without its output mixture and copy (``output_mix``, ``mix_copy``):
            the CEPE adapter they were trained over, whose decoder runs once per call.
    """

    model: str
    out: str
    quantize: str | None = field(default=None, metadata={"choices": ("int8", "int8-g64")})
    decoder_name: str | None = None
    drop_mixture: bool = False


def generate_text(cfg: GenerateConfig) -> str:
    """The answer of ``cepe generate`` (:func:`cepe.generation.generate_from_context` on the loaded model)."""
    from .generation import generate_from_context, load_model

    model, tok, fresh = load_model(cfg.model)
    if fresh:
        print("note: untrained CEPE encoder (no adapter given): the context cannot help yet", file=sys.stderr)
    context = Path(cfg.context).read_text() if cfg.context else ""
    return generate_from_context(
        model, tok, context, cfg.prompt, cfg.max_new_tokens, cfg.decoder_tokens, cfg.cache, chat=cfg.chat
    )


def describe_model(cfg: InfoConfig) -> dict[str, Any]:
    """What ``cepe info`` prints: decoder, cross-attention layers, encoder, chunk length, parameter counts,
    and the output mixture over them (None without one: the decoder runs once per call)."""
    from .generation import load_model

    model, _, fresh = load_model(cfg.model)
    n_train = sum(p.numel() for p in model.trainable_parameters())
    n_all = sum(p.numel() for p in model.parameters())
    c = model.cepe_config
    mixture = None
    if c.output_mix:
        mixture = {
            "suffix_match_orders": c.mix_match,
            "hidden_states_as_inputs": c.mix_hidden,
            "context_length_input": c.mix_length,
            "context_length_cap": c.mix_length_cap,
            "successor_agreements": c.mix_agree,
            "copy": c.mix_copy,
            "copy_probability_input": c.mix_copy_prob,
            "copy_recency_input": c.mix_copy_near,
            "copy_reader_sure_input": c.mix_copy_sure,
            "copy_top_share_input": c.mix_copy_top,
            "copy_reader_agreement_input": c.mix_copy_read,
            "copy_count_input": c.mix_copy_count,
            "copy_vote_decay": c.mix_copy_decay,
            "decoder_passes_per_call": 2,
        }
    return {
        "decoder": c.decoder_name_or_path,
        "decoder_layers_with_cross_attention": model.cross_layers,
        "encoder": c.encoder.__dict__,
        "chunk_length": c.chunk_length,
        "trainable_parameters": n_train,
        "total_parameters": n_all,
        "untrained_encoder": fresh,
        "output_mixture": mixture,
    }


def export_adapter(cfg: ExportConfig) -> Path:
    """Re-save the adapter ``cfg.model`` into ``cfg.out``; returns ``cfg.out``."""
    from .modeling import CepeForCausalLM

    model = CepeForCausalLM.from_pretrained(cfg.model)
    if cfg.decoder_name:
        model.cepe_config.decoder_name_or_path = cfg.decoder_name
    if cfg.drop_mixture:
        model.disable_output_mix()
    model.save_pretrained(cfg.out, quantize=cfg.quantize or stored_quantization(cfg.model))
    return Path(cfg.out)


def stored_quantization(adapter_dir: str | os.PathLike[str]) -> str | None:
    """The weight storage of a saved adapter (``int8``, ``int8-g64``; None: as computed): what its file's
    metadata records. Stored again the same way, int8 weights come back bit for bit (each row's largest
    value is its scale's 127 steps)."""
    from safetensors import safe_open

    from .modeling import ADAPTER_WEIGHTS
    from .quant import QUANT_MODES

    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        recorded = (f.metadata() or {}).get("cepe_quant")
    return {v: k for k, v in QUANT_MODES.items()}.get(recorded)


def _cmd_generate(args: argparse.Namespace) -> int:
    print(generate_text(config_from_args(GenerateConfig, args, "generate config")))
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    print(json.dumps(describe_model(config_from_args(InfoConfig, args, "info config")), indent=2))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from .modeling import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    out = export_adapter(config_from_args(ExportConfig, args, "export config"))
    size = sum((out / name).stat().st_size for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG))  # not other files
    print(f"wrote {out} ({size / 2**20:.1f} MiB)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``generate``, ``info`` and ``export`` to the ``cepe`` command."""
    for name, cls, func, help_text in (
        ("generate", GenerateConfig, _cmd_generate, "answer a prompt about a long context file"),
        ("export", ExportConfig, _cmd_export, "re-save an adapter (e.g. int8 weight storage for shipping)"),
        ("info", InfoConfig, _cmd_info, "describe a CEPE model"),
    ):
        desc = f"{help_text[0].upper()}{help_text[1:]}. Every {cls.__name__} field is a flag."
        p = sub.add_parser(name, help=help_text, description=desc)
        add_config_flags(p, cls)
        p.set_defaults(func=func)
