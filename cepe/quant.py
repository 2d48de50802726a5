"""Weight-only int8 storage for adapter files (optional; for shipping adapters under a size budget).

Every 2-D weight ``W (R, C)`` is stored as ``int8`` values ``q`` and per-row fp32 scales ``s (R,)`` with
``W ≈ q · s`` (symmetric absmax: ``s = max|W_r| / 127``, so the error per element is at most ``s_r / 2``);
1-D weights (norms) stay fp32. Loading dequantizes back to the model's dtype: the model then computes with
exactly the dequantized weights, which is what any result obtained from such a file used.
"""

from __future__ import annotations

import torch

SCALE_SUFFIX = ".int8_row_scale"
QUANT_METADATA = "int8-rowwise"


def quantize_int8_rowwise(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Quantize the 2-D tensors of ``state`` (see module docstring); others are stored in fp32."""
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        w = w.detach().float()
        if w.dim() != 2:
            out[name] = w.contiguous()
            continue
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # (R,)
        out[name] = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        out[name + SCALE_SUFFIX] = scale.contiguous()
    return out


def dequantize_int8_rowwise(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`quantize_int8_rowwise` (fp32 tensors under the original names)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        if scale is None:
            out[name] = t
        else:
            if t.dtype != torch.int8:
                raise ValueError(f"{name}: expected int8 values next to its row scales, got {t.dtype}")
            out[name] = t.float() * scale.float()[:, None]
    return out
