"""Loss of the default decoder with cross-attention at initialisation, `o_proj` copied (no gate), with and
without the encoder, for the released init and the mirrored one (docs/TRAINING.md, copy warmup ablation):
8 warmup windows of 128 tokens (2 chunks of 64), shuffled and natural. Needs `runs/data/mini`.

    python scripts/init_probe.py
"""

from __future__ import annotations

import torch

from cepe.compute import autocast
from cepe.training.config import load_config
from cepe.training.data import build_example, collate, window_source
from cepe.training.models import build_model

LATE = {"cross_attention_layers": list(range(4, 30))}
VARIANTS = {
    "released, bidirectional": ({"num_hidden_layers": 4}, {"init_mode": "copy"}),
    "released, causal": ({"num_hidden_layers": 4, "causal": True}, {"init_mode": "copy"}),
    "mirrored, causal": (
        {"num_hidden_layers": 4, "causal": True},
        {"init_mode": "copy", "mirror_self_attention": True},
    ),
    "mirrored, causal, layers 4-29": (
        {"num_hidden_layers": 4, "causal": True},
        {"init_mode": "copy", "mirror_self_attention": True, **LATE},
    ),
}


def main() -> None:
    for shuffle in (True, False):
        for name, (encoder, cepe) in VARIANTS.items():
            cfg = load_config(
                {
                    "stage": "warmup",
                    "output_dir": "runs/init_probe",
                    "encoder_init": "decoder",
                    "encoder": encoder,
                    "cepe": cepe,
                    "data": {"corpus": "runs/data/mini", "ratio": [1, 1], "shuffle": shuffle},
                    "warmup_tokens": 128,
                    "warmup_chunks": 2,
                    "bf16": "auto",
                }
            )
            model = build_model(cfg).eval()
            src = window_source(cfg, int(model.config.vocab_size))
            batch = collate([build_example(cfg, src[i], i, None) for i in range(8)])
            with torch.no_grad(), autocast("cpu"):
                ctx = model(
                    batch["input_ids"],
                    encoder_input_ids=batch["encoder_input_ids"],
                    encoder_attention_mask=batch["encoder_attention_mask"],
                    labels=batch["labels"],
                ).loss
                alone = model(batch["input_ids"], labels=batch["labels"]).loss
            order = "shuffled" if shuffle else "natural"
            print(
                f"{order:9s} {name:32s} with encoder {float(ctx):.2f}  without {float(alone):.2f}", flush=True
            )


if __name__ == "__main__":
    main()
