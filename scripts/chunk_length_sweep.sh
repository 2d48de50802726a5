#!/usr/bin/env bash
# How well does an adapter read its context as a function of the encoder's chunk length? The validation
# needle with its answer's teacher-forced NLL (configs/eval/needle_val_nll.yaml: Austen's test split, its own
# needle), the same haystacks and depths cut into chunks of each length. Validation data only.
# Usage: bash scripts/chunk_length_sweep.sh ADAPTER_DIR OUT_DIR [LENGTH ...]   (default 64 128 256)
# Writes OUT_DIR/chunk_L/needle/ and OUT_DIR/chunk_length.{json,md}. Pause a training run first.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
ADAPTER=$1; OUT=$2; shift 2
LENGTHS=("$@"); [ ${#LENGTHS[@]} -gt 0 ] || LENGTHS=(64 128 256)
for n in "${LENGTHS[@]}"; do
  d=$OUT/chunk_$n/needle
  [ -f "$d/needle.json" ] || cepe eval needle --model "$ADAPTER" --config configs/eval/needle_val_nll.yaml \
    --set "chunk_length=$n" --methods cepe --autocast auto --no-progress --out "$d" > /dev/null
  echo "chunk length $n done"
done
python scripts/sweep_table.py "$OUT" "$ADAPTER" chunk_length chunk chunk_length "Validation needle by chunk length" "${LENGTHS[@]}"
