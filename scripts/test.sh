#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, lint included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
# Quick tier first (tiny models, one process: a broken core fails in seconds), then the tests marked slow
# (the real default decoder, minute-long runs) or multiproc (other Python processes). CEPE_TESTS=quick
# runs the quick tier only; CI runs both.
# Each tier within a time budget (seconds, CEPE_TEST_BUDGET; a hung test fails the run, with the tests that
# ran and their durations, instead of stalling it): the whole run is meant to take under 20 minutes.
tier() {
    local rc=0
    # from a terminal, --foreground keeps pytest in its process group, so Ctrl-C still stops it; elsewhere
    # (CI) timeout runs it in a group of its own, whose every process a timeout ends
    local fg=()
    [ -t 0 ] && fg=(--foreground)
    timeout "${fg[@]}" --signal=INT --kill-after=60 "${CEPE_TEST_BUDGET:-1500}" \
        python -m pytest -q -x --durations=15 "$@" || rc=$?
    [ "$rc" != 124 ] || echo "tests: a tier ran past its ${CEPE_TEST_BUDGET:-1500} s budget" >&2
    return "$rc"
}
tier -m "not slow and not multiproc" "$@"
if [ "${CEPE_TESTS:-all}" != quick ]; then
    tier -m "slow or multiproc" "$@"
fi
