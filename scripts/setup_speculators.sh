#!/usr/bin/env bash
# A separate venv with vLLM's checkpoint library `speculators` (0.9.0), used by
# scripts/speculators_check.py to load our EAGLE-3 exports the way serving teams do. It never
# touches the project's .venv.
#
#   bash scripts/setup_speculators.sh          # builds .venv-speculators (re-running is cheap)
#   SPECULATORS_VENV=/tmp/v bash scripts/setup_speculators.sh
#
# speculators pins a training stack (vLLM, deepspeed, ...) it does not import to load a model,
# so it is installed without deps plus the few packages its import chain needs.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${SPECULATORS_VENV:-.venv-speculators}
TORCH=${SPECULATORS_TORCH:-torch==2.13.0}  # on these machines pip's constraints resolve this to a local CPU wheel

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --quiet --disable-pip-version-check"
$PIP install "$TORCH" 2>&1 | grep -v "is ignored" || true
$PIP install --no-deps "speculators==0.9.0" 2>&1 | grep -v "is ignored" || true
# Pinned to the set the comparison was last run with (speculators 0.9.0 allows transformers<=5.19,
# datasets<=5.1); pip resolves their own dependencies.
$PIP install "hs-connectors==0.9.0" "transformers==5.19.0" "datasets==5.1.0" "loguru==0.7.3" \
  "pydantic-settings==2.16.3" "openai==3.57.0" "httpx==0.28.1" "safetensors==0.8.0" 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" -W ignore -c "
from importlib.metadata import version
from speculators import SpeculatorModel
print('speculators', version('speculators'), 'ready in $VENV: torch', version('torch'), 'transformers', version('transformers'))
"
touch "$VENV/.specheads-ready"  # scripts/speculators_compare.py builds the venv until this exists
