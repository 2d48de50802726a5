"""cepe: Context Expansion with Parallel Encoding for Hugging Face decoder-only language models."""

from .config import CepeConfig, EncoderConfig, default_encoder_config
from .cross_attention import CrossAttention, CrossContext
from .encoder import ContextEncoder, EncoderForMaskedLM
from .modeling import CepeForCausalLM
from .wrapping import DecoderFamily, register_family

__version__ = "0.1.0"

__all__ = [
    "CepeConfig",
    "CepeForCausalLM",
    "ContextEncoder",
    "CrossAttention",
    "CrossContext",
    "DecoderFamily",
    "EncoderConfig",
    "EncoderForMaskedLM",
    "default_encoder_config",
    "register_family",
]
