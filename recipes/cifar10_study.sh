#!/usr/bin/env bash
# The CIFAR-10 normalization study of docs/normalization-guide.md: three `ablate`
# studies on one small ViT recipe (width 128, 4 heads, MLP 512, batch 32, AdamW at
# 5e-4, pad-crop and flips, label smoothing 0.1, bfloat16 matmuls):
#
#   <out>/depth      depth_stability + depth_drop_path: pre-LN, post-LN and DeepNorm
#                    at depths 6, 12, 24 (patch 8), 1,500 steps, with and without warm-up
#   <out>/depth_no_clip  the depth-24 models without warm-up and without gradient
#                    clipping: which of them diverge, and at which step
#   <out>/factors    dpn_factors: plain stem against Dual PatchNorm by training-set size
#                    and patch size, 3,000 steps, and what DPN's first norm removes
#   <out>/converged  converged: the eight variants at patch 4, 50 epochs
#
# Usage: recipes/cifar10_study.sh CIFAR10_DIR OUTPUT_DIR [extra ablate options]
# CIFAR10_DIR holds train/<class>/*.jpg and test/<class>/*.jpg. Every run resumes:
# rerun the same command after an interruption. The study trains 2 runs at a time, one
# thread each (--parallel 2; docs/study.md); change it in the extra options.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 CIFAR10_DIR OUTPUT_DIR [extra ablate options]" >&2
    exit 2
fi
data=$1 out=$2
shift 2
python=${PYTHON:-python}
export KERAS_BACKEND=${KERAS_BACKEND:-tensorflow}  # the fastest backend for this model on a CPU
common=(--dataset "folder:$data" --image-size 32 --width 128 --num-heads 4 --mlp-dim 512
        --depth 6 --batch-size 32 --lr 5e-4 --weight-decay 0.05 --label-smoothing 0.1
        --crop pad --crop-padding 4 --flip --mixed-precision mixed_bfloat16
        --seeds 0 1 2 --parallel 2 "$@")
"$python" -m keras_vitnorm ablate --groups depth_stability depth_drop_path --patch-size 8 \
    --steps 1500 --steps-per-epoch 500 --warmup-steps 200 --grad-norm-every 50 \
    "${common[@]}" --output-dir "$out/depth"
"$python" -m keras_vitnorm ablate --groups depth_stability --patch-size 8 \
    --variants depth_stability:pre_ln-depth_24-no_warmup depth_stability:post_ln-depth_24-no_warmup \
    depth_stability:deepnorm-depth_24-no_warmup --grad-clip 0 \
    --steps 1500 --steps-per-epoch 500 --warmup-steps 200 --grad-norm-every 50 \
    "${common[@]}" --output-dir "$out/depth_no_clip"
"$python" -m keras_vitnorm ablate --groups dpn_factors --patch-size 4 \
    --steps 3000 --steps-per-epoch 500 --warmup-steps 100 --grad-norm-every 100 \
    "${common[@]}" --output-dir "$out/factors"
"$python" -m keras_vitnorm ablate --groups converged --patch-size 4 \
    --epochs 50 --warmup-steps 2812 --grad-norm-every 1000 \
    "${common[@]}" --output-dir "$out/converged"
