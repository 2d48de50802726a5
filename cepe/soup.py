"""Weight averaging of CEPE adapters ("model soup"): adapters trained from one start along one route, whose
weights are close enough that their average is itself a model worth scoring (for example two checkpoints
that trade validation perplexity against the long reading).

The average is taken in fp32 over every tensor of ``adapter_model.safetensors``; the adapters must share
their ``cepe_config.json`` (the same decoder, encoder, layers and options), or the average means nothing.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from .config import CepeConfig
from .modeling import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_adapter_file, write_adapter_dir


def _config(path: Path) -> dict:
    """The adapter's config as loaded (fields its file omits at their defaults), so that adapters saved
    before a field existed compare equal to those that write it."""
    file = path / ADAPTER_CONFIG
    if not file.is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"{path} is not a cepe adapter directory ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})")
    return CepeConfig.load(file).to_dict()


def average_adapters(
    adapters: list[str | os.PathLike[str]], out: str | os.PathLike[str], weights: list[float] | None = None
) -> Path:
    """Write the weighted average of ``adapters`` to the adapter directory ``out`` (atomically).

    Args:
        adapters: two or more adapter directories with identical configs.
        out: the new adapter directory (its config is the adapters' own).
        weights: one non-negative weight per adapter (normalised to sum 1); default: equal.

    Raises:
        ValueError: fewer than two adapters, bad weights, configs that differ (the differing keys are
            named) or tensors that do not match in names or shapes.
    """
    paths = [Path(a) for a in adapters]
    if len(paths) < 2:
        raise ValueError(f"averaging needs at least two adapters, got {len(paths)}")
    w = [1.0] * len(paths) if weights is None else [float(x) for x in weights]
    if len(w) != len(paths) or any(not 0 <= x < math.inf for x in w) or not 0 < sum(w) < math.inf:
        raise ValueError(
            f"give one non-negative weight per adapter ({len(paths)}), finite and not all zero; got {weights}"
        )
    w = [x / sum(w) for x in w]
    configs = [_config(p) for p in paths]
    for p, c in zip(paths[1:], configs[1:]):
        diff = sorted(k for k in set(c) | set(configs[0]) if c.get(k) != configs[0].get(k))
        if diff:
            raise ValueError(
                f"{p} and {paths[0]} differ in {diff}: only adapters of one config can be averaged"
            )
    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for i, (p, wi) in enumerate(zip(paths, w)):
        tensors = load_adapter_file(p / ADAPTER_WEIGHTS)
        if i == 0:
            dtypes = {k: t.dtype for k, t in tensors.items()}
            total = {k: torch.zeros(t.shape, dtype=torch.float32) for k, t in tensors.items()}
        elif set(tensors) != set(total) or any(tensors[k].shape != total[k].shape for k in total):
            raise ValueError(f"{p} holds other tensors than {paths[0]} (names or shapes differ)")
        for k, t in tensors.items():
            total[k] += wi * t.float()
    tensors = {k: v.to(dtypes[k]).contiguous() for k, v in total.items()}
    return write_adapter_dir(out, tensors, CepeConfig.load(paths[0] / ADAPTER_CONFIG))
