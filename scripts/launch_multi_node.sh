#!/usr/bin/env bash
# Train on several nodes: run this same command on every node listed in the hostfile.
#
#   scripts/launch_multi_node.sh -f HOSTFILE [-p PORT] [-i RDZV_ID] [--] [python -m train overrides...]
#
#   # on each of the 2 nodes of hostfile (first line = rendezvous host):
#   scripts/launch_multi_node.sh -f scripts/hostfile.example +recipe=eagle_llama3_8b deepspeed.num_nodes=2
#
# HOSTFILE: one node per line, "hostname slots=N" (DeepSpeed's format; lines starting with # are
# ignored). The node count and processes per node come from it, all nodes must have the same
# slots, and the first host runs the c10d rendezvous on PORT (default 29400); every node must reach
# it and share the same repository path and data/feature-cache paths (a shared filesystem).
# RDZV_ID (default: the hostfile's checksum) must be the same on all nodes of one job.
set -euo pipefail

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

hostfile="" port=29400 rdzv_id=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    -f|--hostfile) hostfile="$2"; shift 2 ;;
    -p|--port) port="$2"; shift 2 ;;
    -i|--rdzv-id) rdzv_id="$2"; shift 2 ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[[ -n "$hostfile" && -f "$hostfile" ]] || { echo "error: -f HOSTFILE is required and must exist" >&2; usage 2; }

hosts=() slots=()
while read -r host rest; do
  [[ -z "$host" || "$host" == \#* ]] && continue
  n=$(sed -n 's/.*slots=\([0-9]\+\).*/\1/p' <<<"$rest")
  [[ -n "$n" ]] || { echo "error: $hostfile: '$host' has no slots=N" >&2; exit 2; }
  hosts+=("$host"); slots+=("$n")
done < "$hostfile"
[[ ${#hosts[@]} -gt 0 ]] || { echo "error: $hostfile lists no hosts" >&2; exit 2; }
for n in "${slots[@]}"; do
  [[ "$n" == "${slots[0]}" ]] || { echo "error: all hosts need the same slots (got ${slots[*]})" >&2; exit 2; }
done
rdzv_id="${rdzv_id:-$(cksum < "$hostfile" | cut -d' ' -f1)}"

cd "$(dirname "$0")/.."
python="${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python )}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
echo "nodes: ${#hosts[@]} (${hosts[*]}), ${slots[0]} processes each, rendezvous ${hosts[0]}:$port id $rdzv_id" >&2
exec "$python" -m torch.distributed.run \
  --nnodes "${#hosts[@]}" --nproc_per_node "${slots[0]}" \
  --rdzv_backend c10d --rdzv_endpoint "${hosts[0]}:$port" --rdzv_id "$rdzv_id" \
  -m train "$@"
