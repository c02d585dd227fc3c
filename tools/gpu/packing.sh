#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with .gpu/whl carried (README.md):
#
#   bash tools/gpu/packing.sh
#
# The packing check (README.md, "The packing check"): how a study's small runs share
# the GPU best. tools/gpu/bench_packing.py, in order of what decides most (the study's
# ViT as 1, 2, 3, 8 and 16 runs in one program ran on an H200: docs/performance.md):
#   the study's ViT (batch 256, mixed_bfloat16) as 8 processes side by side, and the
#   same under NVIDIA's MPS, each row printed as soon as it is measured;
#   8 processes of 2 runs in one program each (what `ablate` would gain by training a
#   variant's rates together);
#   the check that runs packed in one program train as runs alone (float32).
# (Whether Imagenette's Ti/16 step leaves room to pack is benchmarks/profile_step.py's to
# say first: README.md, the queue.)
# Each table comes back in $OUT/packing.md as soon as it is printed, so a call that runs
# out of time keeps the tables and rows before it.
set -uo pipefail
cd "$(dirname "$0")/../.."
bash tools/gpu/run.sh stage > /dev/null || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KERAS_BACKEND=jax
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
bench() {
    echo "== bench_packing.py $* ($(date +%T))"
    python3 tools/gpu/bench_packing.py --device gpu --batch-size 256 \
        --mixed-precision mixed_bfloat16 "$@" 2>&1
}
{
    bench --model study --packs 1 8 --sharing processes mps --process-seconds 100
    bench --model study --packs 8 --sharing processes --runs-per-process 2 --process-seconds 100
    bench --model study --packs 1 3 --steps 1 --rounds 1 --check
    echo "== done $(date +%T)"
} | tee "$OUT/packing.md"
