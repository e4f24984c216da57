#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): every -m gpu test, the Triton tree-attention kernel vs SDPA,
# a bf16 head-training step on a Llama-3-8B-shaped target, DeepSpeed ZeRO-2 with NCCL and
# `python -m eval head=release`, in under 8 minutes on one GPU; writes a JSON summary.
#
#   bash scripts/gpu_check.sh [--out runs/gpu_check.json] [--budget 450]
#
# Without CUDA every step reports "skipped: no CUDA" and the JSON is still written (exit 0).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
exec "$PYTHON" scripts/gpu_check.py "$@"
