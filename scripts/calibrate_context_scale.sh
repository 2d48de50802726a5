#!/usr/bin/env bash
# Calibrate how strongly a trained adapter reads its context (CepeConfig.context_scale, a multiplier on
# every cross-attention output) on validation data only: the validation needle (configs/eval/needle_val.yaml:
# Austen's test split, its own needle; accuracy and the answer's teacher-forced NLL), the validation
# perplexity (lm_val.yaml: the retrieval split) and in-context classification on the validation articles
# (icl_val.yaml). None of the reported evaluations is read.
# Usage: bash scripts/calibrate_context_scale.sh ADAPTER_DIR OUT_DIR [SCALE ...]   (default 1 1.25 1.5 1.75)
# Writes OUT_DIR/scale_S/{needle,lm_val,icl_val}/ and OUT_DIR/calibrate.{json,md}. Pause a training run first.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi  # else: cepe on the PATH
ADAPTER=$1; OUT=$2; shift 2
SCALES=("$@"); [ ${#SCALES[@]} -gt 0 ] || SCALES=(1 1.25 1.5 1.75)
for s in "${SCALES[@]}"; do
  d=$OUT/scale_$s
  run() { cepe eval "$1" --model "$ADAPTER" --config "$2" --methods cepe --autocast auto --context-scale "$s" \
    --no-progress "${@:4}" --out "$d/$3" > /dev/null; }
  [ -f "$d/needle/needle.json" ] || run needle configs/eval/needle_val_nll.yaml needle
  [ -f "$d/lm_val/lm.json" ] || run lm configs/eval/lm_val.yaml lm_val
  [ "${ICL_VAL:-1}" = 0 ] || [ -f "$d/icl_val/icl.json" ] || run icl configs/eval/icl_val.yaml icl_val --batch-size 1
  echo "scale $s done"
done
python scripts/sweep_table.py "$OUT" "$ADAPTER" context_scale scale calibrate "context_scale calibration" "${SCALES[@]}"
