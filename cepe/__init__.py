"""cepe: Context Expansion with Parallel Encoding for Hugging Face decoder-only language models.

Names are imported lazily so that ``cepe --help`` (and any light submodule) does not pay for torch.
"""

from __future__ import annotations

from cepe.lazy import lazy_getattr

__version__ = "0.1.0"

_EXPORTS = {
    "CepeConfig": "config",
    "EncoderConfig": "config",
    "default_encoder_config": "config",
    "CrossAttention": "cross_attention",
    "CrossContext": "cross_attention",
    "ContextEncoder": "encoder",
    "EncoderForMaskedLM": "encoder",
    "CepeForCausalLM": "modeling",
    "DecoderFamily": "wrapping",
    "register_family": "wrapping",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)
