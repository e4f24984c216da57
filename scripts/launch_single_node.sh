#!/usr/bin/env bash
# Train on one node with N processes (one per GPU; on a CPU-only machine, N CPU processes over gloo).
#
#   scripts/launch_single_node.sh [-n NPROC] [--] [python -m train overrides...]
#
#   scripts/launch_single_node.sh -n 8 +recipe=eagle_llama3_8b
#   scripts/launch_single_node.sh -n 2 +recipe=eagle_llama3_70b    # the plan's -n: 2 copies of the split target
#   scripts/launch_single_node.sh -n 2 +recipe=eagle_smollm2_135m deepspeed=zero2   # CPU smoke run
#
# NPROC defaults to the visible GPU count (nvidia-smi), else 2. Uses torchrun --standalone (a free
# rendezvous port on localhost). Not `accelerate launch --cpu --num_processes N`: on CPU that starts
# one process, and the training entry refuses it. Batch size, accumulation, precision and clipping
# are trainer.* overrides; DeepSpeed receives them from there.
set -euo pipefail

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

nproc=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    -n|--nproc) nproc="$2"; shift 2 ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
if [[ -z "$nproc" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); [[ "${gpus:-0}" -gt 0 ]]; then
    nproc="$gpus"
  else
    nproc=2
  fi
fi
[[ "$nproc" =~ ^[1-9][0-9]*$ ]] || { echo "error: -n needs a positive integer, got '$nproc'" >&2; usage 2; }

cd "$(dirname "$0")/.."
python="${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python )}"
# One CPU thread per process unless the caller says otherwise (N processes share the cores).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$python" -m torch.distributed.run --standalone --nproc_per_node "$nproc" -m train "$@"
