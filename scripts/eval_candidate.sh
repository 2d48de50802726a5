#!/usr/bin/env bash
# The reported held-out evaluations of a candidate adapter, for the decision to replace the shipped one:
# the needle from the encoder (configs/eval/needle_encoder.yaml), in-context learning with 2 demonstrations
# in the decoder and 4 / 8 more in the encoder (icl.yaml), QA with 2 passages in the decoder and the rest in
# the encoder (qa.yaml), and the main job (perplexity, needle, copy probe, fixed-target curve, generation).
# Usage: bash scripts/eval_candidate.sh ADAPTER_DIR OUT_DIR   (pause any training run on the same cores)
# METHODS=cepe scores the adapter alone (the baselines do not depend on it); MAIN=0 skips the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
ADAPTER=$1; OUT=$2
METHODS=${METHODS:-cepe,truncated,full}
mkdir -p "$OUT"
cepe eval needle --model "$ADAPTER" --config configs/eval/needle_encoder.yaml --methods cepe \
  --autocast auto --out "$OUT/needle_encoder" > "$OUT/needle_encoder.log" 2>&1
cepe eval icl --model "$ADAPTER" --config configs/eval/icl.yaml --methods "$METHODS" \
  --autocast auto --batch-size 1 --out "$OUT/icl" > "$OUT/icl.log" 2>&1
cepe eval qa --model "$ADAPTER" --config configs/eval/qa.yaml --methods "$METHODS" \
  --autocast auto --batch-size 1 --out "$OUT/qa" > "$OUT/qa.log" 2>&1
if [ "${MAIN:-1}" != 0 ]; then
  cepe main --adapter "$ADAPTER" --out "$OUT/main" > "$OUT/main.log" 2>&1
fi
echo "results in $OUT/{needle_encoder,icl,qa,main}/"
