#!/usr/bin/env bash
# Run recipe stages one after another in one background process, each started or resumed as
# scripts/train_long.sh does; a stage whose status.json says "done" is skipped, so the same command picks a
# chain up after a kill or in a new session on the same machine.
# Usage: bash scripts/train_chain.sh NAME [NAME ...]   (NAME: configs/train/recipe/NAME.yaml)
# e.g.   bash scripts/train_chain.sh fast_warmup fast_direct
# heads:NAME (a heads recipe) runs `FOREGROUND=1 bash scripts/heads_and_validate.sh NAME` at that point of
# the chain: the heads fitted over the stage before it, stored as int8, validated and judged (its finished
# steps skipped, log runs/recipe/heads.log), before the next stage starts, so the two never share the cores.
# e.g.   bash scripts/train_chain.sh read_lm6 heads:mix_fit16 read_lm7 heads:mix_fit17
# Log: runs/recipe/chain.log (each stage also logs to runs/recipe/NAME.log); the chain's pid: runs/recipe/chain.pid.
# One chain at a time: a second is refused while the first, or a stage it started, holds runs/recipe/chain.lock.
# A stage stopped by SIGHUP, SIGINT or SIGTERM stops the chain to be resumed; one killed otherwise (the
# out-of-memory killer) is a failure.
# BF16=auto (or true / false) overrides the configs' bf16 setting (resume a chain with the same BF16: it is
# part of each stage's fingerprint); configs that say `bf16: true` force
# emulated bf16, about 1/100 of fp32's speed, on CPUs without bf16 matrix units.
# Pause or stop the running stage with `cepe train --status runs/recipe/NAME` and its signals (docs/TRAINING.md).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: bash scripts/train_chain.sh NAME [NAME ...] (configs/train/recipe/NAME.yaml)" >&2; exit 2; }
for name in "$@"; do
  [ -f "configs/train/recipe/${name#heads:}.yaml" ] ||
    { echo "no such stage: configs/train/recipe/${name#heads:}.yaml" >&2; exit 2; }
done
. .venv/bin/activate
mkdir -p runs/recipe
. scripts/pidfile.sh
# one chain at a time: the lock is held by the chain's process and every stage it starts (fd 9 is inherited),
# so it also holds while a stage outlives a killed chain, and from the first check on (no gap before the pid)
exec 9>> runs/recipe/chain.lock
locked() { ! command -v flock >/dev/null || flock -n 9; }  # without flock (not Linux): the pid file alone
if ! locked || pid_running runs/recipe/chain.pid run_chain; then
  pid=$(cat runs/recipe/chain.pid 2>/dev/null || echo "gone; its stage runs on: pgrep -af 'cepe train'")
  echo "a chain is running already (pid $pid, log runs/recipe/chain.log): two would train the same stages" \
    "at once; wait for it, or stop it first (kill the chain and its stage: pgrep -af 'train_chain|cepe train')" >&2
  exit 2
fi
[ -f runs/data/mini/summary.json ] || cepe prepare-data --corpora austen acl stdlib --seed 1 \
  --test-fraction 0.1 --retrieval-fraction 0.05 --out runs/data/mini --quiet
# the wider set (fast_soup_linux): the same split of the three corpora plus 1,000 kernel documentation files.
# A stage's set is the `corpus:` its config gives, or the one the config it extends gives, and so on.
. scripts/recipe_corpus.sh
names_set() { for n in "${@:2}"; do stage_corpus "$n" | grep -qsE "^$1$" && return 0; done; return 1; }
if names_set 'runs/data/mini_linux' "$@"; then
  [ -f runs/data/mini_linux/summary.json ] || cepe prepare-data --corpora austen acl stdlib linux-docs --seed 1 \
    --test-fraction 0.1 --retrieval-fraction 0.05 --max-docs 1000 --out runs/data/mini_linux --quiet
fi
# all 3,183 kernel documentation files (fast_soup_linux2), the same split of every document
if names_set 'runs/data/mini_linux_all' "$@"; then
  [ -f runs/data/mini_linux_all/summary.json ] || cepe prepare-data --corpora austen acl stdlib linux-docs --seed 1 \
    --test-fraction 0.1 --retrieval-fraction 0.05 --out runs/data/mini_linux_all --quiet
fi
# a stop asked for (SIGHUP, SIGINT, SIGTERM: the run checkpoints and exits 128 + the signal) is no failure; a
# crash by another signal is (SIGKILL from the out-of-memory killer, SIGSEGV, SIGABRT): it would recur
stopped_by() { case "$1" in 129 | 130 | 143) return 0 ;; *) return 1 ;; esac; }
run_chain() {
  for name in "$@"; do
    if [ "${name#heads:}" != "$name" ]; then  # the heads over the stage before, judged, in the foreground
      local heads=${name#heads:} rc=0
      echo "$(date -u +%FT%TZ) $heads: heads and validation (runs/recipe/heads.log)"
      FOREGROUND=1 bash scripts/heads_and_validate.sh "$heads" || rc=$?
      if stopped_by "$rc"; then
        echo "$(date -u +%FT%TZ) $heads: stopped by signal $((rc - 128)); the chain stops (run it again to resume)"
        exit 0
      fi
      [ "$rc" = 0 ] || { echo "$(date -u +%FT%TZ) $heads: failed (exit $rc), see runs/recipe/heads.log"; exit 1; }
      echo "$(date -u +%FT%TZ) $heads: judged (results/recipe/$heads/val_verdict.md)"
      continue
    fi
    local cfg=configs/train/recipe/$name.yaml out=runs/recipe/$name
    if [ -f "$out/status.json" ] && grep -q '"state": "done"' "$out/status.json"; then
      echo "$(date -u +%FT%TZ) $name: done already, skipped"; continue
    fi
    local resume=(); [ -d "$out/checkpoints" ] && resume=(--resume)
    echo "$(date -u +%FT%TZ) $name: ${resume[*]:-start}"
    local rc=0
    cepe train --config "$cfg" --output-dir "$out" \
      --no-progress ${BF16:+--set "bf16=$BF16"} "${resume[@]}" >> "$out.log" 2>&1 || rc=$?
    if stopped_by "$rc"; then  # cepe train exits 128 + the signal after checkpointing (SIGTERM, SIGINT)
      echo "$(date -u +%FT%TZ) $name: stopped by signal $((rc - 128)) before its end; the chain stops (run it again to resume)"
      exit 0
    fi
    [ "$rc" = 0 ] || { echo "$(date -u +%FT%TZ) $name: failed (exit $rc), see $out.log"; exit 1; }
    if ! grep -q '"state": "done"' "$out/status.json"; then  # ended at its stop_step, before its last step
      echo "$(date -u +%FT%TZ) $name: stopped before its end; the chain stops (run it again to resume)"; exit 0
    fi
    echo "$(date -u +%FT%TZ) $name: ended"
  done
}
. scripts/fast_alloc.sh 2>> runs/recipe/chain.log  # jemalloc where there is one, for every stage
nohup bash -c "$(declare -f stopped_by run_chain); run_chain $*" >> runs/recipe/chain.log 2>&1 &
echo $! > runs/recipe/chain.pid
echo "started the chain $* (pid $(cat runs/recipe/chain.pid)), log runs/recipe/chain.log"
