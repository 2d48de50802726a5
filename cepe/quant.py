"""Weight-only int8 storage for adapter files (optional; for shipping adapters under a size budget).

``int8`` (per row): every 2-D weight ``W (R, C)`` is stored as ``int8`` values ``q`` and per-row fp32
scales ``s (R,)`` with ``W ≈ q · s`` (symmetric absmax: ``s = max|W_r| / 127``, so the error per element is
at most ``s_r / 2``). ``int8-g64`` (per group): a scale for each group of 64 consecutive columns of a row,
``s (R, C / 64)``, so one large weight no longer coarsens its whole row; the scales add 4 bytes per 64
values (about 6 % over per row). A weight whose columns do not split into groups of 64 keeps per-row
scales. 1-D weights (norms) and 2-D tensors of fewer than :data:`MIN_COLUMNS` columns (per-head
statistics and weights such as a match gate's standardisation ``(H, 4)``, whose columns differ by orders of
magnitude and would share one scale) stay fp32. Loading dequantizes back to the model's dtype: the model
then computes with exactly the dequantized weights, which is what any result obtained from such a file used.
"""

from __future__ import annotations

import torch

SCALE_SUFFIX = ".int8_row_scale"
GROUP_SCALE_SUFFIX = ".int8_group_scale"
QUANT_METADATA = "int8-rowwise"
GROUP_QUANT_METADATA = "int8-groupwise"
GROUP_SIZE = 64
MIN_COLUMNS = 32  # narrower 2-D tensors are stored in fp32: they are small and their columns unlike
QUANT_MODES = {"int8": QUANT_METADATA, "int8-g64": GROUP_QUANT_METADATA}  # export choice -> file metadata


def quantize_int8_rowwise(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Quantize the 2-D tensors of ``state`` of at least :data:`MIN_COLUMNS` columns with a scale per row
    (see module docstring); others are stored in fp32."""
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        w = w.detach().float()
        if w.dim() != 2 or w.shape[1] < MIN_COLUMNS:
            out[name] = w.contiguous()
            continue
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # (R,)
        out[name] = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        out[name + SCALE_SUFFIX] = scale.contiguous()
    return out


def quantize_int8_groupwise(
    state: dict[str, torch.Tensor], group: int = GROUP_SIZE
) -> dict[str, torch.Tensor]:
    """Quantize the 2-D tensors of ``state`` with a scale per ``group`` consecutive columns of each row
    (per row where the columns do not split into such groups; none under :data:`MIN_COLUMNS` columns);
    others are stored in fp32."""
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        w = w.detach().float()
        if w.dim() != 2 or w.shape[1] < MIN_COLUMNS or w.shape[1] % group:
            out.update(quantize_int8_rowwise({name: w}))
            continue
        r, c = w.shape
        g = w.reshape(r, c // group, group)
        scale = g.abs().amax(dim=2).clamp(min=1e-12) / 127.0  # (R, C / group)
        q = torch.round(g / scale[:, :, None]).clamp(-127, 127).to(torch.int8)
        out[name] = q.reshape(r, c).contiguous()
        out[name + GROUP_SCALE_SUFFIX] = scale.contiguous()
    return out


def quantize_int8(state: dict[str, torch.Tensor], mode: str) -> tuple[dict[str, torch.Tensor], str]:
    """``(tensors, metadata value)`` of ``state`` stored as ``mode`` (a key of :data:`QUANT_MODES`)."""
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {sorted(QUANT_MODES)}")
    tensors = quantize_int8_rowwise(state) if mode == "int8" else quantize_int8_groupwise(state)
    return tensors, QUANT_MODES[mode]


def dequantize_int8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`quantize_int8_rowwise` and :func:`quantize_int8_groupwise` (fp32 tensors under the
    original names; each weight by the scales stored next to it)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith((SCALE_SUFFIX, GROUP_SCALE_SUFFIX)):
            continue
        row, group = tensors.get(name + SCALE_SUFFIX), tensors.get(name + GROUP_SCALE_SUFFIX)
        if row is None and group is None:
            out[name] = t
            continue
        if t.dtype != torch.int8:
            raise ValueError(f"{name}: expected int8 values next to its scales, got {t.dtype}")
        if row is not None:
            out[name] = t.float() * row.float()[:, None]
            continue
        r, c = t.shape
        n = group.shape[1]
        if group.shape[0] != r or n < 1 or c % n:
            raise ValueError(f"{name}: group scales {tuple(group.shape)} do not fit a weight of {(r, c)}")
        out[name] = (t.float().reshape(r, n, c // n) * group.float()[:, :, None]).reshape(r, c)
    return out
