#!/usr/bin/env bash
# The exact commands that train the shipped CEPE adapter for the default decoder (SmolLM2-135M-Instruct)
# on this CPU. Re-running this script resumes: an interrupted stage continues from its newest checkpoint
# (identical losses), or, with no checkpoint (a new machine), from its weights-only snapshot in $SNAP;
# finished stages are skipped. Every stage checkpoints at least every $SAVE_MINUTES minutes. To run it in
# the background (and pause / stop / watch it) use scripts/train_bg.sh. Data: austen + acl + stdlib,
# document split seed 1 (10% test, 5% retrieval held out; the essays and BBC News are never trained on).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
DATA=${DATA:-runs/data/mini}
RUNS=${RUNS:-runs/mini}
SNAP=${SNAP:-snapshots/mini}          # commit this directory to carry progress to a new machine
SAVE_MINUTES=${SAVE_MINUTES:-10}
[ -f "$DATA/summary.json" ] || cepe prepare-data --corpora austen acl stdlib --seed 1 \
  --test-fraction 0.1 --retrieval-fraction 0.05 --out "$DATA" --quiet

stage() {  # stage NAME ARTIFACT COMMAND...
  local name=$1 artifact=$2; shift 2
  if [ -f "$artifact" ]; then echo "== $name: done ($artifact)"; return; fi
  echo "== $name: $*"
  "$@" --resume --set data.corpus="$DATA" --output-dir "$RUNS/$name" --no-progress \
    --set save_every_minutes="$SAVE_MINUTES" --set snapshot_dir="$SNAP/$name"
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
