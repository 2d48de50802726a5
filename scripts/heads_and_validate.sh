#!/usr/bin/env bash
# After a reader stage: fit the output mixture's heads over it, store the adapter as int8, run every
# validation evaluation on it and judge it against the shipped adapter, for each heads recipe named, one
# after another in the background, so that no CPU time is lost between the steps.
# Usage: bash scripts/heads_and_validate.sh NAME [NAME ...]   (NAME: configs/train/recipe/NAME.yaml, a heads
#        recipe for `cepe fit-heads`, e.g. mix_fit14 mix_fit14k)
# WAIT_FOR=STAGE first waits until runs/recipe/STAGE/status.json says "done" (the reader the recipes
# read), and gives up if the chain (runs/recipe/chain.pid) ends without it.
# Per NAME (each step skipped where its output exists and is not older than the fit, so the same command
# resumes; an int8 export or a validation result older than fit.md is an earlier fit's, done again):
#   cepe fit-heads --recipe configs/train/recipe/NAME.yaml --compare adapters/smollm2-135m-cepe --no-progress
#   cepe export --model runs/recipe/NAME-fit/adapter --out runs/recipe/NAME-fit/int8 --quantize int8
#   ONLY=CONFIG bash scripts/eval_val.sh runs/recipe/NAME-fit/int8 results/recipe/NAME/fit150_int8  (each)
#   python scripts/val_verdict.py results/recipe/NAME/fit150_int8 --out results/recipe/NAME/val_verdict
#   (against the shipped adapter's validation run on the CPU kind the results record, where there is one)
# An evaluation that fails is logged and the others go on (the verdict then names it as not evaluated and
# rules the replacement out); any other error stops the pipeline with a line in the log.
# Log: runs/recipe/heads.log; pid: runs/recipe/heads.pid. Pause it for other work as the chain
# (kill -STOP / -CONT on the running `cepe` process).
# An evaluation that failed is not run again on the same adapter at every rerun (the chain reruns its heads
# entries at each restart): RETRY=1 runs it again.
# FOREGROUND=1 runs the same pipeline in the foreground and exits with its status (the chain's
# `heads:NAME` entries do this, so that heads and the next stage never share the cores).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: bash scripts/heads_and_validate.sh NAME [NAME ...] (configs/train/recipe/NAME.yaml)" >&2; exit 2; }
for name in "$@"; do
  [ -f "configs/train/recipe/$name.yaml" ] || { echo "no such heads recipe: configs/train/recipe/$name.yaml" >&2; exit 2; }
done
if [ -n "${WAIT_FOR:-}" ] && [ ! -f "configs/train/recipe/$WAIT_FOR.yaml" ]; then
  echo "WAIT_FOR=$WAIT_FOR: no such stage (configs/train/recipe/$WAIT_FOR.yaml)" >&2; exit 2
fi
mkdir -p runs/recipe
. scripts/pidfile.sh  # pid_running: a pid file's process, told from a later one given the same pid
# a heads recipe the running chain lists (heads:NAME) is the chain's to run: a second run of it here would
# hold the pid file when the chain reaches it, and the chain would stop there as failed
if [ -z "${FOREGROUND:-}" ] && pid_running runs/recipe/chain.pid run_chain; then
  for name in "$@"; do  # (one the chain has judged already may be run again here, e.g. a failed evaluation)
    if [ ! -f "results/recipe/$name/val_verdict.md" ] &&
      tr '\0 ' '\n\n' < "/proc/$(cat runs/recipe/chain.pid)/cmdline" 2>/dev/null | grep -qxF -- "heads:$name"; then
      echo "the running chain runs heads:$name itself when its reader is done (runs/recipe/chain.log);" \
        "leave it to the chain" >&2
      exit 2
    fi
  done
fi
if pid_running runs/recipe/heads.pid 'heads_and_validate\|pipeline'; then
  if [ -z "${FOREGROUND:-}" ]; then
    echo "heads_and_validate is running already (pid $(cat runs/recipe/heads.pid), log runs/recipe/heads.log)" >&2
    exit 2
  fi
  # the chain's own entry: wait for the other run (a rerun started by hand), then do what is left
  echo "$(date -u +%FT%TZ) waiting for the running heads run (pid $(cat runs/recipe/heads.pid))" >> runs/recipe/heads.log
  while pid_running runs/recipe/heads.pid 'heads_and_validate\|pipeline'; do sleep 10; done
fi
# jemalloc where there is one (a preload the chain passes down stays): the heads fit purges its kept pages
# after each recorded step and the evaluations after each item, as training does after each step
. scripts/fast_alloc.sh 2>> runs/recipe/heads.log
. scripts/recipe_corpus.sh  # stage_corpus: a recipe's corpus, through the configs it extends
# the validation configs, in the order the decision reads them
VAL="fixedppl_val_short fixedppl_val_short_kernel needle_val4 needle_val2 needle_val3 fixedppl_val lm_val qa_val copy_val"
pipeline() {
  set -euo pipefail
  . .venv/bin/activate
  log() { echo "$(date -u +%FT%TZ) $*"; }
  if [ -n "${WAIT_FOR:-}" ]; then
    log "waiting for $WAIT_FOR"
    until grep -qs '"state": "done"' "runs/recipe/$WAIT_FOR/status.json"; do
      if ! pid_running runs/recipe/chain.pid run_chain; then
        log "the chain is not running and $WAIT_FOR is not done: run the chain again, then this"; exit 1
      fi
      sleep 60
    done
    log "$WAIT_FOR done"
  fi
  for name in "$@"; do
    local fit=runs/recipe/$name-fit res=results/recipe/$name/fit150_int8
    if [ "$(stage_corpus "$name")" = runs/data/mini_kernel ] && [ ! -f runs/data/mini_kernel/summary.json ]; then
      log "$name: preparing runs/data/mini_kernel"
      cepe prepare-data --corpora austen acl stdlib linux-docs linux-code --max-docs 1000 --seed 1 \
        --test-fraction 0.1 --retrieval-fraction 0.05 --out runs/data/mini_kernel --quiet
    fi
    if [ ! -f "$fit/fit.md" ]; then  # written last, after the adapter and fit.json (a kill before: fit again)
      if [ "$(stage_init "$name")" = runs/given/shipped_reader ] && [ ! -f runs/given/shipped_reader/cepe_config.json ]; then
        log "$name: the shipped adapter's reader (runs/given/shipped_reader)"
        cepe export --model adapters/smollm2-135m-cepe --out runs/given/shipped_reader --drop-mixture \
          >> "runs/recipe/$name-fit.log" 2>&1
      fi
      log "$name: fit-heads"
      cepe fit-heads --recipe "configs/train/recipe/$name.yaml" --compare adapters/smollm2-135m-cepe \
        --no-progress >> "runs/recipe/$name-fit.log" 2>&1
    fi
    # exported again after the heads were fitted again (an int8 older than the fit is an earlier fit's)
    if [ ! -f "$fit/int8/cepe_config.json" ] || [ "$fit/int8/cepe_config.json" -ot "$fit/fit.md" ]; then
      log "$name: export int8"
      cepe export --model "$fit/adapter" --out "$fit/int8" --quantize int8 >> "runs/recipe/$name-fit.log" 2>&1
    fi
    # the adapter evaluated: an evaluation that failed on it is not run again at every rerun (RETRY=1 does)
    local stamp; stamp=$(LC_ALL=C stat -c '%n %.9Y %s' "$fit/int8/"* 2>/dev/null | LC_ALL=C sort)
    for cfg in $VAL; do
      # a result older than the fit was computed for an earlier fit (a committed result, on a machine that
      # trained the reader and fitted the heads again): this fit is evaluated, not judged by it
      for f in "$res/$cfg/"*.json; do
        if [ -f "$f" ] && [ "$f" -ot "$fit/fit.md" ]; then
          log "$name: $cfg holds a result older than this fit ($f): an earlier fit's, evaluated again"
          rm -rf "${res:?}/$cfg"
          break
        fi
      done
      if ! ls "$res/$cfg/"*.json > /dev/null 2>&1; then
        if [ -z "${RETRY:-}" ] && [ -f "$res/$cfg.failed" ] && [ "$(cat "$res/$cfg.failed")" = "$stamp" ]; then
          log "$name: $cfg failed before on this adapter ($res/$cfg.log); not run again (RETRY=1 runs it)"
          continue
        fi
        log "$name: $cfg"
        # one evaluation that fails does not stop the others; the verdict names it as not evaluated
        rc=0
        ONLY=$cfg bash scripts/eval_val.sh "$fit/int8" "$res" || rc=$?
        if [ $rc -gt 128 ]; then  # stopped by a signal: stop too (the chain then stops, to be run again)
          log "$name: $cfg stopped by signal $((rc - 128))"; exit $rc
        fi
        if [ $rc -eq 0 ]; then
          rm -f "$res/$cfg.failed"
        else
          mkdir -p "$res" && printf '%s\n' "$stamp" > "$res/$cfg.failed"
          log "$name: $cfg failed ($res/$cfg.log); going on, rerun with RETRY=1 once it is fixed"
        fi
      fi
    done
    python scripts/val_verdict.py "$res" --out "results/recipe/$name/val_verdict" | tail -1
    log "$name: done (results/recipe/$name/val_verdict.md)"
  done
}
if [ -n "${FOREGROUND:-}" ]; then
  echo $$ > runs/recipe/heads.pid
  set +e  # (a subshell, not `pipeline || ...`, which would switch off set -e inside it)
  (VAL="$VAL" pipeline "$@") >> runs/recipe/heads.log 2>&1
  rc=$?
  [ $rc -eq 0 ] || echo "$(date -u +%FT%TZ) stopped by an error (exit $rc): fix it, then rerun the chain" \
    >> runs/recipe/heads.log
  exit $rc
fi
# (a subshell, not `pipeline || ...`, which would switch off set -e inside it)
nohup bash -c "$(declare -f pipeline stage_corpus stage_init pid_running); (VAL='$VAL' pipeline $*); rc=\$?; [ \$rc -eq 0 ] ||
  { echo \"\$(date -u +%FT%TZ) stopped by an error (exit \$rc): fix it, then rerun bash scripts/heads_and_validate.sh $*\"; exit \$rc; }" \
  >> runs/recipe/heads.log 2>&1 &
echo $! > runs/recipe/heads.pid
echo "started heads_and_validate $* (pid $(cat runs/recipe/heads.pid)), log runs/recipe/heads.log"
