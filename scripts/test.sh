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
python -m pytest -q -x --durations=15 -m "not slow and not multiproc" "$@"
if [ "${CEPE_TESTS:-all}" != quick ]; then
    python -m pytest -q -x --durations=15 -m "slow or multiproc" "$@"
fi
