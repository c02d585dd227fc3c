#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with .gpu/whl and the last part of
# imagenette2_224 carried, after the staging calls of the others (README.md):
#
#   bash tools/gpu/imagenette_check.sh
#
# Where a run of the Imagenette study spends its time on this GPU, for sizing the study
# (README.md, "The queue"); the calibration's 8 runs took about 100 ms of the GPU per
# run and step, and the study's input about 93 ms per batch of 256 on its own (with
# RandAugment computed over chunks of images, a form since removed):
#   1. the study's input (python pipeline: zoom crops, flips, RandAugment, MixUp) against
#      the study's training step: benchmarks/bench_input.py, which times decoding and
#      the kept images apart (NumPy crops and flips, RandAugment's chosen operations one
#      image at a time, a compiled call per image under JAX);
#   2. Ti/16's training step alone (batch 256, mixed_bfloat16, the batch already on the
#      device), by part of the model: benchmarks/profile_step.py (JSON: profile_ti16.json).
# Both print into $OUT/imagenette_check.md as they go, so a call cut short keeps what
# it measured.
set -uo pipefail
cd "$(dirname "$0")/../.."
data=$(bash tools/gpu/run.sh unpack imagenette | tail -n 1) || exit 1
export PYTHONPATH=${GPU_WORK:-/tmp}/site:$PWD PYTHONUNBUFFERED=1 KERAS_BACKEND=jax
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
{
    echo "== bench_input.py ($(date +%T))"
    python3 benchmarks/bench_input.py --dataset "folder:$data/train" --recipe imagenette \
        --image-size 224 --batch-size 256 --batches 8 --rounds 2 --pipelines python \
        --mixed-precision mixed_bfloat16 2>&1
    echo "== profile_step.py ($(date +%T))"
    python3 benchmarks/profile_step.py --device gpu --preset ti16 --batch-size 256 \
        --mixed-precision mixed_bfloat16 --json "$OUT/profile_ti16.json" 2>&1
    echo "== done $(date +%T)"
} | tee "$OUT/imagenette_check.md"
