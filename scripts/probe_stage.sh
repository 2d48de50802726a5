#!/usr/bin/env bash
# The probes every stage end of the recipe route gets (docs/TRAINING.md tables): the reported needle from
# the encoder (needle_encoder.yaml), the copy probe, the validation needle with its answer NLL and the
# validation perplexity (calibrate_context_scale.sh at scale 1), the second validation needle
# (needle_val2.yaml), the third, in papers (needle_val3.yaml), the fourth, in news, a domain no stage
# trains on (needle_val4.yaml), the validation copy probe (copy_val.yaml)
# and the validation perplexity beyond the length exponents' pivot (lm_val_long.yaml: 4K / 8K totals); with FULL=1 also ICL (2 + 4 / 2 + 8)
# and QA (k = 2 / 5 / 10). Results: results/recipe/NAME/stepNNN/. Run with nothing training on the same cores.
# Usage: bash scripts/probe_stage.sh NAME STEP   (e.g. fast_direct_qa_teach_held2 30)
#        ADAPTER=DIR bash scripts/probe_stage.sh NAME STEP   (any adapter directory, e.g. an average of two)
#        SKIP_DONE=1 bash scripts/probe_stage.sh NAME STEP   (only the probes whose results are missing)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi  # else: cepe on the PATH
NAME=$1; STEP=$2
ADAPTER=${ADAPTER:-runs/recipe/$NAME/checkpoints/step_$(printf "%06d" "$STEP")/adapter}
OUT=results/recipe/$NAME/step$(printf "%03d" "$STEP")
[ -d "$ADAPTER" ] || { echo "no adapter at $ADAPTER: train the stage first (bash scripts/train_chain.sh $NAME)" >&2; exit 2; }
mkdir -p "$OUT"
ev() {  # SKIP_DONE=1: keep a probe whose results are there already (a probe run before, or resumed)
  if [ "${SKIP_DONE:-0}" = 1 ] && compgen -G "$OUT/$3/*.json" > /dev/null; then return 0; fi
  cepe eval "$1" --model "$ADAPTER" --config "configs/eval/$2.yaml" --methods cepe --autocast auto \
    --no-progress --out "$OUT/$3" "${@:4}" > "$OUT/$3.log" 2>&1
}
ev needle needle_encoder needle_encoder
ev copy copy copy
if [ "${SKIP_DONE:-0}" != 1 ] || [ ! -f "$OUT/calibrate.md" ]; then
  ICL_VAL=0 bash scripts/calibrate_context_scale.sh "$ADAPTER" "$OUT" 1 > "$OUT/calibrate.log" 2>&1
fi
ev needle needle_val2 needle_val2
ev needle needle_val3 needle_val3
ev needle needle_val4 needle_val4
ev copy copy_val copy_val
ev lm lm_val_long lm_val_long
if [ "${FULL:-0}" = 1 ]; then
  ev icl icl icl --batch-size 1
  ev qa qa qa --batch-size 1
fi
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
rows = json.load(open(f"{out}/needle_encoder/needle.json"))["rows"]
by = {}
for r in rows:
    by.setdefault(r["setting"]["total"], []).append(r["value"])
print("reported needle", {k: round(sum(v) / len(v)) for k, v in sorted(by.items())},
      "mean", round(sum(sum(v) for v in by.values()) / sum(len(v) for v in by.values())))
print(open(f"{out}/calibrate.md").read().strip().splitlines()[-1])
for name, what in (("needle_val2", "second"), ("needle_val3", "third"), ("needle_val4", "fourth")):
    by = {}
    for r in json.load(open(f"{out}/{name}/needle.json"))["rows"]:
        by.setdefault(r["setting"]["total"], []).append(r["value"])
    print(what, "validation needle", {k: round(sum(v) / len(v)) for k, v in sorted(by.items())})
rows = json.load(open(f"{out}/lm_val_long/lm.json"))["rows"]
print("lm_val_long 4K / 8K", " / ".join(f"{r['value']:.2f}" for r in rows if r["setting"]["domain"] == "avg"))
for name in ("copy", "copy_val"):
    rows = json.load(open(f"{out}/{name}/copy.json"))["rows"]
    print(name, "natural", " / ".join(f"{r['value']:.1f}" for r in rows if r["setting"]["order"] == "natural"))
PY
