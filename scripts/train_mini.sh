#!/usr/bin/env bash
# The exact commands that train the shipped CEPE adapter for the default decoder (SmolLM2-135M-Instruct)
# on this CPU. Every stage checkpoints often; re-running this script resumes an interrupted stage
# exactly and skips finished ones. Data: austen + acl + stdlib, document split seed 1 (10% test,
# 5% retrieval held out; the essays and BBC News are never trained on).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
DATA=${DATA:-runs/data/mini}
RUNS=${RUNS:-runs/mini}
[ -f "$DATA/summary.json" ] || cepe prepare-data --corpora austen acl stdlib --seed 1 \
  --test-fraction 0.1 --retrieval-fraction 0.05 --out "$DATA" --quiet

stage() {  # stage NAME ARTIFACT COMMAND...
  local name=$1 artifact=$2; shift 2
  if [ -f "$artifact" ]; then echo "== $name: done ($artifact)"; return; fi
  local resume=()
  [ -d "$RUNS/$name/checkpoints" ] && resume=(--resume)
  echo "== $name: $* ${resume[*]}"
  "$@" "${resume[@]}" --set data.corpus="$DATA" --output-dir "$RUNS/$name" --no-progress
}
stage mlm "$RUNS/mlm/encoder_model.safetensors" cepe pretrain-encoder --config configs/train/mini/mlm.yaml
stage warmup "$RUNS/warmup/adapter_model.safetensors" cepe train --stage warmup --config configs/train/mini/warmup.yaml \
  --set init_encoder="$RUNS/mlm"
stage cepe "$RUNS/cepe/adapter_model.safetensors" cepe train --stage cepe --config configs/train/mini/cepe.yaml \
  --set init_adapter="$RUNS/warmup"
if [ "${SKIP_CEPED:-0}" != 1 ]; then
  cepe teacher --config configs/train/mini/ceped.yaml --set data.corpus="$DATA" --set init_adapter="$RUNS/cepe" \
    --set teacher_dir="$RUNS/teacher" --output-dir "$RUNS/ceped" --no-progress
  stage ceped "$RUNS/ceped/adapter_model.safetensors" cepe train --stage ceped --config configs/train/mini/ceped.yaml \
    --set init_adapter="$RUNS/cepe" --set teacher_dir="$RUNS/teacher"
fi
