#!/usr/bin/env bash
# The validation evaluations that decide between adapters (never the reported test documents): fixed targets
# up to 2K on 80 sequences (fixedppl_val_short.yaml) and up to 7.5K on 8 (fixedppl_val.yaml), perplexity at
# 1K / 2K (lm_val.yaml), the validation copy probe (copy_val.yaml), the news needle (needle_val4.yaml) and
# planted-fact QA from held-out papers with 2 / 5 / 10 passages (qa_val.yaml).
# Usage: bash scripts/eval_val.sh ADAPTER_DIR OUT_DIR   (pause any training run on the same cores)
# ONLY="lm_val copy_val" runs a subset (the other validation needles too: ONLY="needle_val2 needle_val3"; the
# short curve on kernel documents outside the training corpora, fixedppl_val_short_kernel, and with other
# documents' contexts, fixedppl_val_short_foreign);
# results: OUT_DIR/CONFIG/{TASK.json,.md,.png} (TASK: fixedppl, lm, copy, needle, qa), logs OUT_DIR/CONFIG.log.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi  # else: cepe on the PATH
. scripts/fast_alloc.sh 2> /dev/null  # jemalloc where there is one; each evaluation purges it after each item
[ $# -eq 2 ] || { echo "usage: bash scripts/eval_val.sh ADAPTER_DIR OUT_DIR" >&2; exit 2; }
ADAPTER=$1; OUT=$2
[ -f "$ADAPTER/cepe_config.json" ] || { echo "no cepe adapter at $ADAPTER (no cepe_config.json)" >&2; exit 2; }
mkdir -p "$OUT"
for name in ${ONLY:-fixedppl_val_short fixedppl_val lm_val copy_val needle_val4 qa_val}; do
  case $name in
    fixedppl_val*) task=fixedppl ;; lm_val) task=lm ;; copy_val) task=copy ;; needle_val*) task=needle ;; qa_val) task=qa ;;
    *) echo "unknown validation config: $name" >&2; exit 2 ;;
  esac
  cepe eval "$task" --model "$ADAPTER" --config "configs/eval/$name.yaml" --methods cepe --autocast auto \
    --no-progress --out "$OUT/$name" > "$OUT/$name.log" 2>&1 || {
    rc=$?  # a signal (128 + its number) passes through: the caller stops rather than going on
    echo "$name failed: $OUT/$name.log" >&2; [ $rc -gt 128 ] && exit $rc; exit 1; }
  echo "$name done: $OUT/$name/"
done
