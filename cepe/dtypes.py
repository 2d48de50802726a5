"""The one map from dtype names to torch dtypes, for every command and config.

Both spellings used across the package are accepted: the short ones of the command line and the result
files (``fp32``, ``bf16``, ``fp16``) and torch's own (``float32``, ``bfloat16``, ``float16``, as in
``TrainConfig.decoder_dtype``). Which of them a setting allows is the setting's own choice (e.g. the bench
runs ``bf16`` / ``fp32`` only). Stdlib only: torch is imported when a dtype is asked for, so the command line
can name dtypes without loading torch.
"""

from __future__ import annotations

from typing import Any

# name -> torch attribute
DTYPE_NAMES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}


def torch_dtype(name: str) -> Any:
    """``torch.bfloat16`` for ``"bf16"`` or ``"bfloat16"`` (and so on); ``ValueError`` naming the choices."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(DTYPE_NAMES)}")
    import torch

    return getattr(torch, DTYPE_NAMES[name])
