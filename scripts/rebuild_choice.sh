#!/usr/bin/env bash
# Rebuild the validation choice soup_qa2_gates_break on this machine from the committed tree, in the
# background, resumably: the route's nine stages (scripts/train_chain.sh: each resumed or skipped), the
# equal average of fast_fold_qa2, fast_fold_gates and fast_fold_break_only (runs/soup/qa2_gates_break), then
# its probes with nothing else training (scripts/probe_stage.sh into results/recipe/soup_qa2_gates_break_rebuilt/,
# the documented ones in results/recipe/soup_qa2_gates_break/ left as they are) and its fixed-target curve;
# then the stages from it to the validation choice, fast_soup_run, fast_soup_run2, fast_soup_run3 (run biases
# alone, 40 steps each) and fast_soup_linux_s2 (40 steps with all weights, kernel documentation added), the
# last probed the same way into results/recipe/fast_soup_linux_s2_rebuilt/ (the documented
# results/recipe/fast_soup_linux_s2/ left as they are); then the output mixture's head over it (mix_choice,
# the choice frozen) and its probes into results/recipe/mix_choice/step060/.
# Run it again after a stop, a kill or a new session on the same machine: done stages are skipped.
#   bash scripts/rebuild_choice.sh          # start or pick up (log: runs/recipe/rebuild.log)
#   bash scripts/rebuild_choice.sh run      # the same route with run biases from the 8K stage on
#                                           # (fast_direct_8kd_run, fast_fold_run, ...: runs/soup/qa2_gates_break_run,
#                                           # probes in results/recipe/soup_qa2_gates_break_run/)
# The chain's step times: docs/TRAINING.md, "Another new machine" (about fifteen hours on a 2-core AVX2 CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") SUFFIX=""; PROBE=soup_qa2_gates_break_rebuilt; CHOICE=(fast_soup_run fast_soup_run2 fast_soup_run3 fast_soup_linux_s2)
      MIX=mix_choice ;;
  run) SUFFIX=_run; PROBE=soup_qa2_gates_break_run; CHOICE=(); MIX="" ;;
  *) echo "usage: bash scripts/rebuild_choice.sh [run]" >&2; exit 2 ;;
esac
STAGES=(fast_warmup fast_direct_copy fast_direct_recall2)
for name in fast_direct_8kd fast_fold fast_fold_qa fast_fold_qa2 fast_fold_gates fast_fold_break_only; do
  STAGES+=("$name$SUFFIX")
done
PARENTS=("fast_fold_qa2$SUFFIX" "fast_fold_gates$SUFFIX" "fast_fold_break_only$SUFFIX")
SOUP=runs/soup/qa2_gates_break$SUFFIX
mkdir -p runs/recipe
if [ -f runs/recipe/rebuild.pid ] && kill -0 "$(cat runs/recipe/rebuild.pid)" 2>/dev/null; then
  echo "already running (pid $(cat runs/recipe/rebuild.pid)); log: runs/recipe/rebuild.log"; exit 0
fi
. scripts/pidfile.sh  # pid_running
rebuild() {
  set -euo pipefail
  . .venv/bin/activate
  chain() {  # the stages named, through scripts/train_chain.sh (or the chain already running), to their end
    if pid_running runs/recipe/chain.pid run_chain; then
      echo "$(date -u +%FT%TZ) a chain is running already (pid $(cat runs/recipe/chain.pid)): waiting for it"
    else
      bash scripts/train_chain.sh "$@"
    fi
    while pid_running runs/recipe/chain.pid run_chain; do sleep 5; done
  }
  done_or_stop() {
    grep -q '"state": "done"' "runs/recipe/$1/status.json" 2>/dev/null \
      || { echo "$(date -u +%FT%TZ) $1 is not done: the chain stopped (runs/recipe/chain.log); run again"; exit 1; }
  }
  probe() {  # ADAPTER NAME [STEP]: the stage probes and the fixed-target curve, each once
    local step=${3:-40}
    local out=results/recipe/$2/step$(printf "%03d" "$step")
    if [ ! -f "$out/copy_val/copy.json" ]; then
      echo "$(date -u +%FT%TZ) probing $1"
      ADAPTER=$1 bash scripts/probe_stage.sh "$2" "$step"
    fi
    if [ ! -f "$out/fixedppl/fixedppl.json" ]; then
      cepe eval fixedppl --model "$1" --config configs/eval/fixedppl.yaml --methods cepe \
        --autocast auto --no-progress --out "$out/fixedppl" > "$out/fixedppl.log" 2>&1
    fi
    echo "$(date -u +%FT%TZ) rebuilt: $1, probes in $out"
  }
  chain "${STAGES[@]}"
  local ends=()
  for name in "${PARENTS[@]}"; do
    done_or_stop "$name"
    ends+=("runs/recipe/$name/checkpoints/step_000040/adapter")
  done
  [ -f "$SOUP/cepe_config.json" ] || python scripts/average_adapters.py "$SOUP" "${ends[@]}"
  probe "$SOUP" "$PROBE"
  if [ "${#CHOICE[@]}" -gt 0 ]; then  # fast_soup_run starts from $SOUP (its config's init_adapter)
    chain "${CHOICE[@]}"
    for name in "${CHOICE[@]}"; do done_or_stop "$name"; done
    local last=${CHOICE[${#CHOICE[@]}-1]}
    probe "runs/recipe/$last/checkpoints/step_000040/adapter" "${last}_rebuilt"
  fi
  if [ -n "$MIX" ]; then  # the mixing head over the choice (its config's init_adapter), 60 steps
    chain "$MIX"
    done_or_stop "$MIX"
    probe "runs/recipe/$MIX/checkpoints/step_000060/adapter" "$MIX" 60
  fi
}
nohup bash -c "$(declare -p STAGES PARENTS SOUP PROBE CHOICE MIX); $(declare -f rebuild pid_running); rebuild" >> runs/recipe/rebuild.log 2>&1 &
echo $! > runs/recipe/rebuild.pid
echo "started the rebuild (pid $!), log runs/recipe/rebuild.log"
