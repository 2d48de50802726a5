#!/usr/bin/env bash
# Start or resume the whole training pipeline (scripts/train_mini.sh) in the background, and control it.
#   bash scripts/train_bg.sh start    # start, or resume after a kill / reboot / new machine (idempotent)
#   bash scripts/train_bg.sh status   # stage, step, tokens seen, recent loss, tokens/s, ETA of each stage
#   bash scripts/train_bg.sh pause    # the running stage stops after its current step (nothing is lost)
#   bash scripts/train_bg.sh resume   # continue a paused stage
#   bash scripts/train_bg.sh stop     # finish the current step, checkpoint, exit (start resumes it)
# Environment: RUNS (default runs/mini), SNAP, SAVE_MINUTES, SKIP_CEPED, DATA as in train_mini.sh.
# The log is $RUNS/pipeline.log; the pipeline's process group id is in $RUNS/pipeline.pid.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-runs/mini}
PIDFILE="$RUNS/pipeline.pid"
mkdir -p "$RUNS"
running() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }
stage_pids() {  # the training processes of this pipeline's stages that are running or paused
  python3 - "$RUNS" <<'PY'
import json, sys, pathlib
for p in pathlib.Path(sys.argv[1]).glob("*/status.json"):
    s = json.loads(p.read_text())
    if s.get("state") in ("running", "paused"):
        print(s["pid"])
PY
}
case "${1:-start}" in
  start)
    if running; then echo "already running (process group $(cat "$PIDFILE")); see: $0 status"; exit 0; fi
    setsid bash scripts/train_mini.sh >>"$RUNS/pipeline.log" 2>&1 < /dev/null &
    echo $! > "$PIDFILE"
    echo "started (process group $!); log: $RUNS/pipeline.log" ;;
  status)
    running && echo "pipeline: running (process group $(cat "$PIDFILE"))" || echo "pipeline: not running"
    if [ -x .venv/bin/cepe ]; then .venv/bin/cepe train --status "$RUNS"/*/; else python -m cepe.cli train --status "$RUNS"/*/; fi ;;
  pause) for p in $(stage_pids); do kill -USR1 "$p"; done; echo "pause requested" ;;
  resume) for p in $(stage_pids); do kill -USR2 "$p"; done; echo "resumed" ;;
  stop)
    if running; then kill -TERM -- "-$(cat "$PIDFILE")"; echo "stop requested (the stage checkpoints first)"; else echo "not running"; fi ;;
  *) echo "usage: $0 start|status|pause|resume|stop" >&2; exit 2 ;;
esac
