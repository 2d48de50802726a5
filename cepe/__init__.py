"""cepe: Context Expansion with Parallel Encoding for Hugging Face decoder-only language models."""

__version__ = "0.1.0"
