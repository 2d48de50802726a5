#!/usr/bin/env bash
# Start or resume the long recipe run (configs/train/recipe/long_align.yaml) in the background; its log is
# runs/recipe/long_align.log. Needs the training data (`cepe prepare-data ... --out runs/data/mini`, as in
# scripts/train_mini.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
. scripts/fast_alloc.sh  # jemalloc where there is one
CFG=${CFG:-configs/train/recipe/long_align.yaml}
OUT=runs/recipe/$(basename "$CFG" .yaml)
[ -f runs/data/mini/summary.json ] || cepe prepare-data --corpora austen acl stdlib --seed 1 \
  --test-fraction 0.1 --retrieval-fraction 0.05 --out runs/data/mini --quiet
mkdir -p "$(dirname "$OUT")"
resume=(); [ -d "$OUT/checkpoints" ] && resume=(--resume)
nohup cepe train --config "$CFG" --output-dir "$OUT" --no-progress "${resume[@]}" \
  >> "$OUT.log" 2>&1 &
echo $! > "$OUT.pid"
echo "started $OUT (pid $(cat "$OUT.pid")), log $OUT.log"
