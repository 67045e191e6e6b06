#!/usr/bin/env bash
# Launch a recipe with torchrun on this node:  ./launch.sh RECIPE [section.key=value ...] [--dry-run]
#
# Environment (all optional):
#   NPROC_PER_NODE  processes on this node (default: number of GPUs, or 1 on CPU)
#   NNODES          number of nodes (default 1)       NODE_RANK    this node's rank (default 0)
#   MASTER_ADDR     rank-0 host (default 127.0.0.1)   MASTER_PORT  its port (default 29500; one node: a free port)
#   PYTHON          interpreter (default: .venv/bin/python beside this script, else python3)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
recipe="$1"; shift
dry_run=0
overrides=()
for arg in "$@"; do
    if [[ "$arg" == "--dry-run" ]]; then dry_run=1; else overrides+=("$arg"); fi
done

python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$here/.venv/bin/python" ]]; then python="$here/.venv/bin/python"; else python="python3"; fi
fi

num_gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then num_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
if [[ -n "${NPROC_PER_NODE:-}" ]]; then nproc_per_node="$NPROC_PER_NODE"
elif [[ "$num_gpus" -gt 0 ]]; then nproc_per_node="$num_gpus"
else nproc_per_node=1; fi
nnodes="${NNODES:-1}"
node_rank="${NODE_RANK:-0}"
master_addr="${MASTER_ADDR:-127.0.0.1}"
if [[ -z "${MASTER_PORT:-}" && "$nnodes" -eq 1 ]]; then  # one node: any free port, so two runs can share a host
    master_port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
else
    master_port="${MASTER_PORT:-29500}"
fi
world_size=$((nnodes * nproc_per_node))

# Validate the recipe and the batch split before any process starts.
check_args=("$recipe" "${overrides[@]}" --world-size "$world_size")
[[ $dry_run -eq 1 ]] && check_args+=(--dry-run)
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
module="$("$python" -m core.launch "${check_args[@]}")"

# CPU runs: split the cores between the processes of this node.
if [[ "$num_gpus" -eq 0 && -z "${OMP_NUM_THREADS:-}" ]]; then
    cores=$(nproc)
    export OMP_NUM_THREADS=$(( cores / nproc_per_node > 0 ? cores / nproc_per_node : 1 ))
fi
# glibc hands large freed buffers back to the OS, so every step page-faults fresh activations and ZeRO's flat
# buffers back in (benchmarks/results/engine.md: ZeRO-1 1.4-1.6x a plain loop with glibc, 1.05-1.2x with
# tcmalloc). Preload tcmalloc (Debian: libtcmalloc-minimal4) when it is installed; MIMPIPE_MALLOC=system skips it.
tcmalloc=/usr/lib/$(uname -m)-linux-gnu/libtcmalloc_minimal.so.4
if [[ "${MIMPIPE_MALLOC:-tcmalloc}" == "tcmalloc" && "${LD_PRELOAD:-}" != *tcmalloc* ]]; then
    if [[ -f "$tcmalloc" ]]; then
        export LD_PRELOAD="$tcmalloc${LD_PRELOAD:+:$LD_PRELOAD}"
    else  # no tcmalloc: keep glibc from returning big blocks to the OS (ZeRO-1 ~1.14x a plain loop)
        export MALLOC_MMAP_MAX_="${MALLOC_MMAP_MAX_:-0}" MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-1099511627776}"
    fi
fi

cmd=("$python" -m torch.distributed.run
     --nnodes "$nnodes" --node-rank "$node_rank" --nproc-per-node "$nproc_per_node"
     --master-addr "$master_addr" --master-port "$master_port"
     -m "$module" "$recipe" "${overrides[@]}")
if [[ $dry_run -eq 1 ]]; then
    printf '%q ' "${cmd[@]}"; echo
    exit 0
fi
exec "${cmd[@]}"
