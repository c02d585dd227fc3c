#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with .gpu/whl carried (README.md):
#
#   bash tools/gpu/packing.sh
#
# The packing check (README.md, "The packing check"): how a study's small runs share
# the GPU best. benchmarks/bench_packing.py, in order of what decides most:
#   the study's ViT (batch 256, mixed_bfloat16) as 1, 2, 3, 8 and 16 runs in one program;
#   as 8 and 16 processes side by side, and the same under NVIDIA's MPS;
#   Ti/16 at 224 px as 1, 2 and 3 runs in one program;
#   the check that runs packed in one program train as runs alone (float32).
# Each table comes back in $OUT/packing.md as soon as it is printed, so a call that runs
# out of time keeps the tables before it.
set -uo pipefail
cd "$(dirname "$0")/../.."
bash tools/gpu/run.sh stage > /dev/null || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KERAS_BACKEND=jax
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
bench() {
    echo "== bench_packing.py $* ($(date +%T))"
    python3 benchmarks/bench_packing.py --device gpu --batch-size 256 \
        --mixed-precision mixed_bfloat16 "$@" 2>&1
}
{
    bench --model study --packs 1 2 3 8 16
    bench --model study --packs 1 8 16 --sharing processes mps --process-seconds 75
    bench --model ti16 --packs 1 2 3 --steps 5
    bench --model study --packs 1 3 --steps 1 --rounds 1 --check
    echo "== done $(date +%T)"
} | tee "$OUT/packing.md"
