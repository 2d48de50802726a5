#!/usr/bin/env bash
# Set up (idempotent) and run the main job: the shipped CEPE adapter on SmolLM2-135M-Instruct against
# truncated, full-context, StreamingLLM and REPLUG baselines on held-out documents, a needle-in-a-haystack
# grid and an answer generated from a paper longer than the decoder window. Extra arguments go to
# `cepe main` (e.g. --quick, --out DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
cepe main "$@"
