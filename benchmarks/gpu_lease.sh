#!/usr/bin/env bash
# `make gpu-check` cut to fit a short GPU lease (docs/gpu.md): a machine that has torch but cannot reach a package
# index, and minutes rather than the hour the full batch searches take. Run from the repository root:
#
#   benchmarks/gpu_lease.sh OUT_DIR [SECONDS]
#
# Wheels of what the machine lacks are read from .whl/ (pip download / pip wheel them beforehand, docs/gpu.md) and
# installed into a private folder. Then, each step bounded so that the whole stays inside SECONDS (default 540):
#   1. tests/gpu, 8 at a time (OUT_DIR/tests.log);
#   2. bench_gpu per model at one batch (--start-batch = --max-batch = $BATCH, 256 unless set), bf16 eager and the
#      fp32 control, then bf16 compiled if time is left (OUT_DIR/gpu_<model>_<modes>.md, bench_<model>_<modes>.log).
# Exits with pytest's status. What a step had not finished when its time ran out is missing from OUT_DIR.
set -u
out="${1:?usage: benchmarks/gpu_lease.sh OUT_DIR [SECONDS]}"
deadline=$((SECONDS + ${2:-540}))
batch="${BATCH:-256}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1

left() { local n=$((deadline - SECONDS - ${1:-0})); echo $((n > 1 ? n : 1)); }

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_lease_site \
        .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/gpu_lease_site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c 'import torch, deepspeed, timm, webdataset, pydantic
print("torch", torch.__version__, "CUDA", torch.version.cuda, "| deepspeed", deepspeed.__version__,
      "| timm", timm.__version__, "| webdataset", webdataset.__version__, "| pydantic", pydantic.__version__)'
} 2>&1 | tee "$out/environment.txt"

timeout "$(left 240)" python3 -m pytest -q -n 8 --dist load -p no:cacheprovider -rfE tests/gpu 2>&1 | tee "$out/tests.log"
tests=${PIPESTATUS[0]}

bench() {  # bench MODEL_KEY MODEL MODES RESERVE: one bench_gpu run, killed when fewer than RESERVE seconds are left
    local budget
    budget=$(left "$4")
    if ((budget < 60)); then echo "[lease] no time left for $2 $3" | tee -a "$out/skipped.txt"; return; fi
    timeout "$budget" python3 -m benchmarks.bench_gpu --models "$2" --modes "$3" --start-batch "$batch" \
        --max-batch "$batch" --warmup 2 --steps 5 --data-steps 16 --out "$out/gpu_$1_${3//,/-}.md" 2>&1 |
        tee "$out/bench_$1_${3//,/-}.log"
}
bench vitb ViT-B/16 bf16,fp32 150
bench vitl ViT-L/16 bf16,fp32 60
bench vitl ViT-L/16 bf16-compiled 0
exit "$tests"
