#!/usr/bin/env bash
# Score a training checkpoint's adapter on the validation probes used to follow a run: the copy probe
# (held-out passages, natural and shuffled) and the validation needle (configs/eval/needle_val.yaml).
# Usage: bash scripts/eval_checkpoint.sh RUN_DIR STEP   (e.g. runs/recipe/long_mixed 300)
# Results: RUN_DIR/eval/step_NNNNNN/{copy,needle}/. Pause a training run on the same cores first.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
RUN=$1; STEP=$(printf "%06d" "$2")
ADAPTER=$RUN/checkpoints/step_$STEP/adapter
OUT=$RUN/eval/step_$STEP
cepe eval copy --model "$ADAPTER" --config configs/eval/copy.yaml --methods cepe --autocast bf16 \
  --out "$OUT/copy" > /dev/null
cepe eval needle --model "$ADAPTER" --config configs/eval/needle_val.yaml --methods cepe --autocast bf16 \
  --out "$OUT/needle" > /dev/null
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
copy = json.load(open(f"{out}/copy/copy.json"))["rows"]
needle = json.load(open(f"{out}/needle/needle.json"))["rows"]
cells = " / ".join(f"{r['value']:.1f}" for r in copy)
print(f"{out}: copy ppl (natural essays/papers/code, shuffled ...) {cells}; "
      f"needle_val {sum(r['value'] for r in needle) / len(needle):.1f}% of {len(needle)}")
PY
