#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with .gpu/whl carried (README.md):
#
#   bash tools/gpu/efficiency.sh PART       PART: s16, b16-jax or b16-torch
#
# One part of the GPU half of the efficiency table (docs/normalization-guide.md, "The
# efficiency table"), each sized for one call of at most 10 minutes:
#   s16        ViT-S/16 at batch 128, JAX and PyTorch: training and inference time,
#              peak memory; and the converged study's ViT at its batch of 256 on JAX
#              (the step time that turns the study's steps to accuracy into seconds)
#   b16-jax    ViT-B/16 at batch 128, JAX: training and inference time
#   b16-torch  ViT-B/16 at batch 128: PyTorch's time and peak memory, JAX's peak memory
# Every benchmark's JSON file and log come back in $OUT (gpu_variants_*).
set -uo pipefail
cd "$(dirname "$0")/../.."
case ${1:-} in
    s16 | b16-jax | b16-torch) ;;
    *) echo "usage: $0 s16 | b16-jax | b16-torch" >&2; exit 2 ;;
esac
bash tools/gpu/run.sh stage > /dev/null || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
bench() {
    local name=$1
    shift
    echo "== $name $(date +%T)"
    python3 benchmarks/bench_variants.py --device gpu --mixed-precision mixed_bfloat16 \
        --json "$OUT/gpu_variants_$name.json" "$@" 2>&1 | tee "$OUT/gpu_variants_$name.log"
}
case $1 in
    s16)
        bench s16 --model s16 --batch-size 128 --backends jax torch --rounds 10 --steps 10 \
            --warmup 3 --measure train inference memory --memory-parallel 4
        bench study_b256 --model study --batch-size 256 --backends jax --rounds 10 --steps 30 \
            --warmup 3 ;;
    b16-jax)
        bench b16_jax --model b16 --batch-size 128 --backends jax --rounds 10 --steps 10 \
            --warmup 3 ;;
    b16-torch)
        bench b16_torch --model b16 --batch-size 128 --backends torch --rounds 10 --steps 10 \
            --warmup 3 --measure train inference memory --memory-parallel 2
        bench b16_jax_memory --model b16 --batch-size 128 --backends jax --warmup 3 \
            --measure memory --memory-parallel 2 ;;
esac
echo "== done $(date +%T)"
