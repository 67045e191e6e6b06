#!/usr/bin/env bash
# A short GPU lease, spent in value order (docs/gpu.md): on a machine that has torch but cannot reach a package index.
# Run from the repository root:
#
#   benchmarks/gpu_lease.sh OUT_DIR [SECONDS]
#
# Wheels of what the machine lacks are read from .whl/ (`make lease-wheels` writes them here beforehand; the lease
# carries the folder) and installed into a private folder. Then benchmarks/gpu_lease.py runs its arms, most valuable
# first, inside SECONDS (default 540): MAE ViT-L timed and traced at the old and the new settings, then the A/B arms,
# then tests/gpu if time is left. OUT_DIR/lease.md (the table, rewritten after every arm), lease.json, lease.log, the
# traces and their summaries: at most 8 files, what a lease machine sends back.
set -u
out="${1:?usage: benchmarks/gpu_lease.sh OUT_DIR [SECONDS]}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_lease_site \
        .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/gpu_lease_site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m benchmarks.gpu_lease "$out" --budget "${2:-540}"
