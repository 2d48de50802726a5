"""Shared tiny random models for the tests (CPU, seconds)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from cepe import CepeConfig, CepeForCausalLM, EncoderConfig
from cepe.tiny import random_decoder

VOCAB = 97


@pytest.fixture(autouse=True)
def _markers_say_what_a_test_does(request, monkeypatch):
    """``slow`` and ``multiproc`` are enforced, so ``-m "not slow and not multiproc"`` (the quick tier of
    ``scripts/test.sh``) really leaves out every test that loads the real default decoder or starts other
    Python processes: an unmarked test that does either fails and says which marker it needs."""
    if request.node.get_closest_marker("slow") is None:
        import cepe.assets

        def refuse(*args, **kwargs):
            raise RuntimeError("this test loads the real default decoder: mark it @pytest.mark.slow")

        monkeypatch.setattr(cepe.assets, "default_decoder_dir", refuse)
        monkeypatch.setattr(cepe.assets, "default_decoder_gguf", refuse)
    if request.node.get_closest_marker("multiproc") is None:
        monkeypatch.setattr(subprocess, "Popen", _NoPythonPopen)


class _NoPythonPopen(subprocess.Popen):
    """``subprocess.Popen`` that refuses to start the Python interpreter (other programs run)."""

    def __init__(self, args, *rest, **kwargs):
        program = args[0] if isinstance(args, (list, tuple)) else str(args).split()[0]
        if os.path.realpath(str(program)) == os.path.realpath(sys.executable):
            raise RuntimeError("this test starts Python processes: mark it @pytest.mark.multiproc")
        super().__init__(args, *rest, **kwargs)


def tiny_decoder(family: str = "llama", seed: int = 0, **overrides):
    """A 3-layer random decoder of the given family (fp32, eval mode), built by :func:`cepe.tiny.random_decoder`."""
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if family in ("gemma2", "gemma3_text", "qwen3"):
        kw["head_dim"] = 16
    kw.update(overrides)
    return random_decoder(family, seed, **kw)


def tiny_cepe_config(**overrides) -> CepeConfig:
    enc = EncoderConfig(
        vocab_size=VOCAB + 1, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mask_token_id=VOCAB
    )
    kw = dict(encoder=enc, chunk_length=8)
    kw.update(overrides)
    return CepeConfig(**kw)


def randomize_cross(model: CepeForCausalLM, seed: int = 1, std: float = 0.2) -> None:
    """Give every cross-attention non-trivial weights (o_proj is zero after init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.cross_attention_modules():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if p.dim() == 1 else 0.0))


def heads_scaled(m, hidden: torch.Tensor, ctx, strength: torch.Tensor) -> torch.Tensor:
    """A cross-attention layer's update with head h's output times ``strength[..., h]`` ``(B, T, H)``, made
    by hand: ``o_proj`` is linear, so the layer (its gates removed by the caller) runs one head at a time."""
    w = m.o_proj.weight.clone()
    hd = m.head_dim
    out = 0
    with torch.no_grad():
        for h in range(m.num_heads):
            m.o_proj.weight.zero_()
            m.o_proj.weight[:, h * hd : (h + 1) * hd] = w[:, h * hd : (h + 1) * hd]
            out = out + m(hidden, ctx) * strength[..., h : h + 1]
        m.o_proj.weight.copy_(w)
    return out


@pytest.fixture
def tiny_model() -> CepeForCausalLM:
    model = CepeForCausalLM.from_decoder(tiny_decoder(), tiny_cepe_config()).eval()
    randomize_cross(model)
    return model


def random_context(b: int, k: int, length: int = 8, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, k, length), generator=g)
    mask = torch.ones(b, k, length, dtype=torch.bool)
    return ids, mask


def load_script(name: str):
    """The module of ``scripts/<name>.py`` (scripts are not a package), with ``scripts/`` on the path as
    when the script is run, so that it can import its neighbours."""
    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
    if scripts not in sys.path:
        sys.path.append(scripts)
    path = os.path.join(scripts, f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
