#!/usr/bin/env bash
# Score a training checkpoint's adapter on the validation probes used to follow a run: the copy probe
# (held-out passages, natural and shuffled), the validation needle with its answer's teacher-forced NLL
# (configs/eval/needle_val_nll.yaml: the needle_val layout, sentences packed into 64-token chunks) and the
# validation perplexity (configs/eval/lm_val.yaml: the retrieval split, never trained on, not the test split)
# and in-context classification on the validation articles (configs/eval/icl_val.yaml: 2 demonstrations in
# the decoder + 8 in the encoder; the BBC test part is never read; ICL_VAL=0 skips it).
# Usage: bash scripts/eval_checkpoint.sh RUN_DIR STEP   (e.g. runs/recipe/long_mixed 300)
# Results: RUN_DIR/eval/step_NNNNNN/{copy,needle}/. Pause a training run on the same cores first.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
RUN=$1; STEP=$(printf "%06d" "$2")
ADAPTER=$RUN/checkpoints/step_$STEP/adapter
OUT=$RUN/eval/step_$STEP
cepe eval copy --model "$ADAPTER" --config configs/eval/copy.yaml --methods cepe --autocast auto \
  --out "$OUT/copy" > /dev/null
cepe eval needle --model "$ADAPTER" --config configs/eval/needle_val_nll.yaml --methods cepe --autocast auto \
  --out "$OUT/needle" > /dev/null
cepe eval lm --model "$ADAPTER" --config configs/eval/lm_val.yaml --methods cepe --autocast auto \
  --out "$OUT/lm_val" > /dev/null
if [ "${ICL_VAL:-1}" != 0 ]; then
  cepe eval icl --model "$ADAPTER" --config configs/eval/icl_val.yaml --methods cepe --autocast auto \
    --batch-size 1 --out "$OUT/icl_val" > /dev/null
fi
python - "$OUT" <<'PY'
import os
import json, sys
out = sys.argv[1]
copy = json.load(open(f"{out}/copy/copy.json"))["rows"]
needle = json.load(open(f"{out}/needle/needle.json"))["rows"]
lm = [r for r in json.load(open(f"{out}/lm_val/lm.json"))["rows"] if r["setting"]["domain"] == "avg"]
cells = " / ".join(f"{r['value']:.1f}" for r in copy)
print(f"{out}: copy ppl (natural essays/papers/code, shuffled ...) {cells}; "
      f"needle_val {sum(r['value'] for r in needle) / len(needle):.1f}% of {len(needle)}, "
      f"answer NLL {sum(r['answer_nll'] for r in needle) / len(needle):.2f}; "
      f"lm_val ppl " + " / ".join(f"{r['setting']['total']}: {r['value']:.2f}" for r in lm))
if os.path.exists(f"{out}/icl_val/icl.json"):
    for r in json.load(open(f"{out}/icl_val/icl.json"))["rows"]:
        print(f"icl_val 2+{r['setting']['k_encoder']}: {r['value']:.1f}% (predicted {r['predicted']})")
PY
