#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, lint included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
python -m pytest -q -x --durations=15 "$@"
