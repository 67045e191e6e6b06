#!/usr/bin/env bash
# Launch a recipe:  ./launch.sh RECIPE [section.key=value ...] [--dry-run] [--allow-config-change] [--take-over-run-dir]
# A recipe key's type, default and meaning:  ./launch.sh --explain KEY   (all of them: docs/recipe-reference.md)
#
# Run one launch.sh per node: it checks the recipe, the batch split and the files the recipe names (a problem is one
# line and exit code 2), prints the plan, then starts torchrun, which spawns this node's processes (one process on one
# node: launch.sh becomes it, without torchrun). With HOSTFILE, one launch.sh starts every node (DeepSpeed's
# launcher, ssh).
# --dry-run stops after printing the resolved config, the plan and the command.
# A run_dir is one run (docs/run_dir.md): relaunching into one whose latest checkpoint another config wrote is refused
# (run_dir=NEW_DIR starts a new run; --allow-config-change continues that one with this config), and relaunching a
# finished run with the same schedule does nothing (exit 0). One launch at a time trains in a run_dir: while another
# holds its lease (RUN_DIR/lease.json, renewed by a heartbeat) a launch is refused; a lease whose heartbeat stopped
# for checkpoint.lease_timeout_s, or whose process is gone on this host, is taken over; --take-over-run-dir takes it
# whatever it says.
# Environment (all optional):
#   NPROC_PER_NODE  processes per node (default: the GPUs here, else 1; HOSTFILE: its slots); the GPUs here are
#                   nvidia-smi's, narrowed by CUDA_VISIBLE_DEVICES and by the SLURM step's GPUs on this node
#   NNODES          number of nodes (default 1; HOSTFILE: all its hosts); no elastic MIN:MAX range, see docs/clusters.md
#   NODE_RANK       this node's rank, 0..NNODES-1 (default 0; not used with RDZV_ENDPOINT or HOSTFILE)
#   MASTER_ADDR     rank-0 host (default 127.0.0.1)   MASTER_PORT  its port (default 29500; one node: a free port)
#   RDZV_ENDPOINT   host:port of a torchrun c10d rendezvous, in place of MASTER_ADDR/MASTER_PORT/NODE_RANK
#   RDZV_ID         id shared by the nodes of one run (default: SLURM_JOB_ID, else "mimpipe")
#   MAX_RESTARTS    with RDZV_ENDPOINT: restarts of every worker after a failure, resuming from `latest` (default 0)
#   HOSTFILE        DeepSpeed hostfile (`host slots=N` lines); MASTER_ADDR defaults to its first host
#   PYTHON          interpreter (default: .venv/bin/python beside this script, else python3)
#   OMP_NUM_THREADS, OMP_WAIT_POLICY   default: this node's cores / processes, and PASSIVE (idle threads sleep)
#   MIMPIPE_DEBUG   1: a failing rank prints its traceback on the console too (always in RUN_DIR/logs/rank{N}.log)
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT  seconds torchrun lets its ranks save a checkpoint after passing on a SIGTERM
#                   or the first Ctrl-C, before it SIGKILLs them (default here 120; torchrun's own 30); see
#                   docs/processes.md
#   TORCH_NCCL_ASYNC_ERROR_HANDLING  NCCL's handling of a peer's error or a collective timeout (default here 2: the
#                   communicators are aborted and the rank raises, one line; torchrun's own 1 ends the process)
# Ctrl-C stops the run after the current step with a checkpoint of it (exit code 130); Ctrl-C again stops it at once.
# In a SLURM allocation (SLURM_JOB_ID set, NNODES and HOSTFILE not): `srun --ntasks-per-node=1 ./launch.sh RECIPE`.
#   NNODES (the step's nodes), NODE_RANK, MASTER_ADDR (first host of the step) and MASTER_PORT (20000 + job id %
#   10000) come from SLURM unless set.
set -euo pipefail

die() { echo "launch.sh: $*" >&2; exit 2; }

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"  # the comment block above
    exit 2
fi
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$here/.venv/bin/python" ]]; then python="$here/.venv/bin/python"; else python="python3"; fi
fi
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
if [[ "$1" == "--explain" ]]; then  # reads the schema only: no GPU query, no pre-flight
    [[ $# -eq 2 ]] || die "usage: ./launch.sh --explain KEY (e.g. objective.mask_ratio)"
    exec "$python" -m core.recipe.reference --explain "$2"
fi
recipe="$1"; shift
dry_run=0
overrides=()
for arg in "$@"; do
    if [[ "$arg" == "--dry-run" ]]; then dry_run=1; else overrides+=("$arg"); fi
done
# --allow-config-change and --take-over-run-dir stay among the arguments: the pre-flight and every rank get them
# (through torchrun, or the DeepSpeed launcher over ssh, whatever the environment they pass on).

free_port() { "$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

num_gpus="$("$python" -m core.launch.gpus)"  # honours CUDA_VISIBLE_DEVICES and the SLURM step (core/launch/gpus.py)
default_nproc=$(( num_gpus > 0 ? num_gpus : 1 ))
nnodes="${NNODES:-}"
node_rank="${NODE_RANK:-0}"
master_addr="${MASTER_ADDR:-}"
master_port="${MASTER_PORT:-}"
max_restarts="${MAX_RESTARTS:-0}"
[[ "$max_restarts" =~ ^[0-9]+$ ]] || die "MAX_RESTARTS='$max_restarts' is not a non-negative integer"
[[ -z "${HOSTFILE:-}" || -z "${RDZV_ENDPOINT:-}" ]] || die "set HOSTFILE or RDZV_ENDPOINT, not both"
if [[ "$max_restarts" -gt 0 && -z "${RDZV_ENDPOINT:-}" ]]; then
    die "MAX_RESTARTS needs a c10d rendezvous: set RDZV_ENDPOINT (one node: RDZV_ENDPOINT=127.0.0.1:29400)"
fi

# Where the values come from: a hostfile, a SLURM allocation, or the variables above.
if [[ -n "${HOSTFILE:-}" ]]; then
    [[ -f "$HOSTFILE" ]] || die "HOSTFILE=$HOSTFILE: no such file"
    [[ -n "$master_addr" ]] || master_addr="$(awk '$1 !~ /^#/ && NF { print $1; exit }' "$HOSTFILE")"
elif [[ -n "${SLURM_JOB_ID:-}" && -z "$nnodes" ]]; then
    # One launch.sh per node: several tasks on a node would each start a full set of processes there.
    if [[ -n "${SLURM_STEP_NUM_TASKS:-}" && "$SLURM_STEP_NUM_TASKS" != "${SLURM_STEP_NUM_NODES:-}" ]]; then
        die "SLURM step has $SLURM_STEP_NUM_TASKS tasks on ${SLURM_STEP_NUM_NODES:-?} nodes; run one launch.sh per" \
            "node (srun --ntasks-per-node=1), it starts NPROC_PER_NODE processes itself"
    fi
    # The step's own nodes (srun -N 2 inside a 4-node job), with the job's as fallback; SLURM_NODEID is this node's
    # place in the step, and the step's first host is node 0.
    nnodes="${SLURM_STEP_NUM_NODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}}"
    node_rank="${NODE_RANK:-${SLURM_NODEID:-0}}"
    if [[ -z "$master_addr" && -z "${RDZV_ENDPOINT:-}" ]]; then
        nodelist="${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:-}}"
        master_addr="$(scontrol show hostnames "$nodelist" 2>/dev/null | sed -n 1p)" || true
        [[ -n "$master_addr" ]] || die "cannot read the first host of SLURM_STEP_NODELIST with scontrol; set MASTER_ADDR"
    fi
    [[ -n "$master_port" ]] || master_port=$(( 20000 + 10#$SLURM_JOB_ID % 10000 ))  # jobs sharing a host differ
fi
nnodes="${nnodes:-1}"
master_addr="${master_addr:-127.0.0.1}"
nproc_per_node="${NPROC_PER_NODE:-$default_nproc}"
# One process on one node needs no torchrun agent (seconds of imports): launch.sh becomes the process, which makes
# a process group of one itself (core/engine/distributed.py). Its exit code is the stage's own (3, 4: docs/recipes.md).
single=0
if [[ "$nnodes" == 1 && "$nproc_per_node" == 1 && -z "${HOSTFILE:-}" && -z "${RDZV_ENDPOINT:-}" ]]; then
    single=1
fi
if [[ -z "$master_port" && "$single" -eq 0 ]]; then  # one node: any free port, so two runs can share a host
    if [[ "$nnodes" == 1 && -z "${HOSTFILE:-}" ]]; then master_port="$(free_port)"; else master_port=29500; fi
fi

# Validate the recipe, the topology and the batch split, and pre-flight the recipe's files (data, model.init, run_dir)
# before any process starts; print the plan. A problem is one line naming the key and the file, exit code 2.
check_args=("$recipe" "${overrides[@]}")
if [[ -n "${HOSTFILE:-}" ]]; then
    check_args+=(--hostfile "$HOSTFILE" --launcher "DeepSpeed launcher over ssh, master $master_addr:$master_port")
    [[ -z "${NNODES:-}" ]] || check_args+=(--nnodes "$NNODES")
    [[ -z "${NPROC_PER_NODE:-}" ]] || check_args+=(--nproc-per-node "$NPROC_PER_NODE")
elif [[ -n "${RDZV_ENDPOINT:-}" ]]; then
    rdzv_id="${RDZV_ID:-${SLURM_JOB_ID:-mimpipe}}"
    check_args+=(--nnodes "$nnodes" --nproc-per-node "$nproc_per_node"
                 --launcher "torchrun, c10d rendezvous $RDZV_ENDPOINT id $rdzv_id, max restarts $max_restarts")
elif [[ "$single" -eq 1 ]]; then
    check_args+=(--nnodes 1 --nproc-per-node 1 --launcher "one process, started without torchrun")
else
    check_args+=(--nnodes "$nnodes" --nproc-per-node "$nproc_per_node" --node-rank "$node_rank"
                 --launcher "torchrun, master $master_addr:$master_port")
fi
[[ $dry_run -eq 0 ]] || check_args+=(--dry-run)
module="$("$python" -m core.entry.launch_check "${check_args[@]}")"
[[ -n "$module" ]] || exit 0  # the run in run_dir finished this schedule: the check said so, nothing to start

# Split this node's cores (those this launch may use) between its processes, on GPU nodes as on CPU ones: torchrun
# would give each process 1 thread when a node runs several, which starves a GPU rank's host-side tensor work (saving and
# converting checkpoints, anything computed on the CPU) as much as a CPU rank's compute. A rank's DataLoader
# workers share its cores (torch runs each worker on 1 thread), and OpenMP threads that spin while they wait take the
# time the workers need: PASSIVE makes them sleep (quickstart on 2 cores: MAE 700 -> 926 img/s, fine-tuning
# 436 -> 462). On a GPU a rank mostly waits for the device, so its threads sleep and the workers get the cores.
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    cores=$(nproc)
    export OMP_NUM_THREADS=$(( cores / nproc_per_node > 0 ? cores / nproc_per_node : 1 ))
fi
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
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

# torchrun SIGKILLs its ranks this long after passing a SIGTERM (preemption) or the first Ctrl-C on: 30 s by default,
# less than a large checkpoint may take to save. It waits only as long as the ranks take; SLURM's own grace still bounds it.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120}"
# torchrun's agent gives its ranks TORCH_NCCL_ASYNC_ERROR_HANDLING from its own environment, else 1 (tear the process
# down from NCCL's watchdog thread), so the ranks' own default never applied under it: 2, NCCL aborts the communicators
# and the rank raises, reported in one line (core/engine/distributed.py `nccl_error_handling`). A value set is kept.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-2}"
# core.launch.torchrun is torchrun with its failure report cut to one line (the ranks print their own errors).
if [[ -n "${HOSTFILE:-}" ]]; then
    # DeepSpeed's runner reaches the hosts over pdsh/ssh and starts them in this directory (same path everywhere);
    # it sets RANK/LOCAL_RANK/WORLD_SIZE in the environment, so no --local_rank argument is passed.
    cmd=("$python" -m deepspeed.launcher.runner --hostfile "$HOSTFILE"
         --master_addr "$master_addr" --master_port "$master_port")
    [[ -z "${NNODES:-}" ]] || cmd+=(--num_nodes "$NNODES")
    [[ -z "${NPROC_PER_NODE:-}" ]] || cmd+=(--num_gpus "$NPROC_PER_NODE")
    cmd+=(--no_local_rank --module "$module" "$recipe" "${overrides[@]}")
elif [[ -n "${RDZV_ENDPOINT:-}" ]]; then
    # c10d rendezvous: node ranks are assigned as nodes join; after a failure every node restarts its workers.
    cmd=("$python" -m core.launch.torchrun
         --nnodes "$nnodes" --nproc-per-node "$nproc_per_node"
         --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$rdzv_id" --max-restarts "$max_restarts"
         -m "$module" "$recipe" "${overrides[@]}")
    # Restarted workers must not share the agents' store: they would read the dead workers' addresses left there
    # and fail to connect (pytorch/pytorch#135712); unshared, each round's rank 0 hosts a fresh one.
    if [[ "$max_restarts" -gt 0 ]]; then
        cmd=(env "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}" "${cmd[@]}")
    fi
elif [[ "$single" -eq 1 ]]; then
    cmd=("$python" -m "$module" "$recipe" "${overrides[@]}")
else
    cmd=("$python" -m core.launch.torchrun
         --nnodes "$nnodes" --node-rank "$node_rank" --nproc-per-node "$nproc_per_node"
         --master-addr "$master_addr" --master-port "$master_port"
         -m "$module" "$recipe" "${overrides[@]}")
fi
if [[ $dry_run -eq 1 ]]; then
    printf '%q ' "${cmd[@]}"; echo
    exit 0
fi
# exec: no shell is left to die of a Ctrl-C, or to wait, between the terminal and what takes it (torchrun's agent, or
# the one rank; docs/processes.md#ctrl-c), and launch.sh's exit code is theirs (130 after a Ctrl-C, 2 when the ranks
# refused the launch before training, as the pre-flight above does; core/launch/torchrun.py).
exec "${cmd[@]}"
