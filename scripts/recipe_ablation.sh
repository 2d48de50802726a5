#!/usr/bin/env bash
# The copy-warmup recipe ablation of docs/TRAINING.md: each variant in configs/train/recipe/copy_*.yaml trains
# for the same steps on shuffled windows (resumable), then `cepe.training.probe` scores every variant on
# held-out windows with and without the encoder. Needs `cepe prepare-data ... --out runs/data/mini`.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
for cfg in "${@:-configs/train/recipe/copy_zero_bidir.yaml configs/train/recipe/copy_zero_causal_mirror.yaml configs/train/recipe/copy_gate_causal_mirror.yaml configs/train/recipe/copy_zero_causal_mirror_frozen.yaml configs/train/recipe/copy_zero_bidir_mirror.yaml configs/train/recipe/copy_zero_random.yaml}"; do
  for c in $cfg; do
    out=runs/recipe/$(basename "$c" .yaml)
    [ -f "$out/adapter_model.safetensors" ] && { echo "== $c: done"; continue; }
    resume=(); [ -d "$out/checkpoints" ] && resume=(--resume)
    echo "== $c"
    cepe train --stage warmup --config "$c" --output-dir "$out" --no-progress "${resume[@]}"
  done
done
