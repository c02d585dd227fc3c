#!/usr/bin/env bash
# The CIFAR-10 normalization study of docs/normalization-guide.md: four `ablate`
# studies on one small ViT (patch 4 or 8, width 128, 4 heads, MLP 512, depth 6 unless
# varied; AdamW, pad-crop and flips, label smoothing 0.1, bfloat16 matmuls):
#
#   <out>/depth      depth_stability + depth_drop_path: pre-LN, post-LN and DeepNorm
#                    at depths 6, 12, 24 (patch 8), 1,500 steps, with and without warm-up
#   <out>/depth_no_clip  the depth-24 models without warm-up and without gradient
#                    clipping: which of them diverge, and at which step
#   <out>/factors    dpn_factors: plain stem against Dual PatchNorm by training-set size
#                    and patch size, 3,000 steps, and what DPN's first norm removes;
#                    dpn_schedule: the two stems trained 3,000 and 12,000 steps
#   <out>/converged  converged: the eight variants at patch 4, 80 passes over the
#                    45,000 training images (batch 256), on a GPU under JAX
#   <out>/converged_lr  the same, each variant at its own peak learning rate: a sweep
#                    of 5e-4, 1e-3 and 2e-3 on seed 0, chosen on validation
#   <out>/regularized   converged_lr with RandAugment(2 ops, factor 0.5), MixUp 0.2
#                    and stochastic depth 0.1 (big_vision's "light2" augmentation)
#   <out>/deep       deep: pre-LN, post-LN and DeepNorm at depth 12, at the converged
#                    budget, with a warm-up of 1,760 steps (12.5%) and each at its own
#                    rate: converged_lr's sweep and a quarter of the GPU recipe's rate,
#                    2.5e-4 (at 12 blocks on the CPU, deep_cpu, post-LN trained only
#                    at a quarter and half of the CPU recipe's rate)
#   <out>/deep_cpu   deep's three variants in depth's setting (patch 8, the CPU recipe)
#                    but four times as long, 6,000 steps, with a warm-up of 750 (12.5%)
#                    and a sweep of 1.25e-4, 2.5e-4, 5e-4 and 1e-3 (a quarter of the
#                    CPU recipe's rate to twice it)
#
# depth, depth_no_clip, factors and deep_cpu train on a CPU (TensorFlow, batch 32, 2
# runs at a time, one thread each; docs/study.md); the others on a GPU (JAX, 8 runs at
# a time), reading the images with the python input pipeline so that the batches do
# not depend on whether TensorFlow is installed.
#
# Usage: [STUDIES="factors converged"] recipes/cifar10_study.sh CIFAR10_DIR OUTPUT_DIR [extra ablate options]
# CIFAR10_DIR holds train/<class>/*.jpg and test/<class>/*.jpg. STUDIES picks studies
# (default all eight, in the order above). Every run resumes: rerun the same command
# after an interruption. Extra options come last and win (e.g. --seeds 0 --parallel 4).
# `--tables-only --parallel 1` writes the tables and figures from the finished runs
# and trains nothing.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 CIFAR10_DIR OUTPUT_DIR [extra ablate options]" >&2
    exit 2
fi
data=$1 out=$2
shift 2
python=${PYTHON:-python}
all="depth depth_no_clip factors converged converged_lr regularized deep deep_cpu"
studies=${STUDIES:-$all}
for study in $studies; do
    if [[ " $all " != *" $study "* ]]; then
        echo "unknown study '$study' in STUDIES; valid: $all" >&2
        exit 2
    fi
done
wants() { [[ " $studies " == *" $1 "* ]]; }
model=(--dataset "folder:$data" --image-size 32 --width 128 --num-heads 4 --mlp-dim 512
       --depth 6 --weight-decay 0.05 --label-smoothing 0.1 --crop pad --crop-padding 4 --flip
       --mixed-precision mixed_bfloat16 --seeds 0 1 2)
# The CPU recipe; its studies run on TensorFlow, the fastest backend for this model
# on a CPU (docs/performance.md).
cpu=(--batch-size 32 --lr 5e-4 --parallel 2 "$@")
if wants depth; then
    KERAS_BACKEND=tensorflow "$python" -m keras_vitnorm ablate --groups depth_stability depth_drop_path \
        --patch-size 8 --steps 1500 --steps-per-epoch 500 --warmup-steps 200 --grad-norm-every 50 \
        "${model[@]}" "${cpu[@]}" --output-dir "$out/depth"
fi
if wants depth_no_clip; then
    KERAS_BACKEND=tensorflow "$python" -m keras_vitnorm ablate --groups depth_stability --patch-size 8 \
        --variants depth_stability:pre_ln-depth_24-no_warmup depth_stability:post_ln-depth_24-no_warmup \
        depth_stability:deepnorm-depth_24-no_warmup --grad-clip 0 \
        --steps 1500 --steps-per-epoch 500 --warmup-steps 200 --grad-norm-every 50 \
        "${model[@]}" "${cpu[@]}" --output-dir "$out/depth_no_clip"
fi
if wants factors; then
    KERAS_BACKEND=tensorflow "$python" -m keras_vitnorm ablate --groups dpn_factors dpn_schedule --patch-size 4 \
        --steps 3000 --steps-per-epoch 500 --warmup-steps 100 --grad-norm-every 100 \
        "${model[@]}" "${cpu[@]}" --output-dir "$out/factors"
fi
# The GPU recipe: 14,080 steps of 256, 80 passes over the 45,000 training images; evaluated
# and checkpointed every 880 steps (5 passes); warm-up 5 passes.
gpu=(--patch-size 4 --batch-size 256 --lr 1e-3 --steps 14080 --steps-per-epoch 880
     --warmup-steps 880 --grad-norm-every 880 --input-pipeline python --parallel 8)
sweep=(--lr-sweep 5e-4 1e-3 2e-3)
if wants converged; then
    KERAS_BACKEND=jax "$python" -m keras_vitnorm ablate --groups converged \
        "${gpu[@]}" "${model[@]}" "$@" --output-dir "$out/converged"
fi
if wants converged_lr; then
    KERAS_BACKEND=jax "$python" -m keras_vitnorm ablate --groups converged "${sweep[@]}" \
        "${gpu[@]}" "${model[@]}" "$@" --output-dir "$out/converged_lr"
fi
if wants regularized; then
    KERAS_BACKEND=jax "$python" -m keras_vitnorm ablate --groups converged "${sweep[@]}" \
        --randaugment-ops 2 --randaugment-factor 0.5 --mixup 0.2 --drop-path 0.1 \
        "${gpu[@]}" "${model[@]}" "$@" --output-dir "$out/regularized"
fi
if wants deep; then
    KERAS_BACKEND=jax "$python" -m keras_vitnorm ablate --groups deep --lr-sweep 2.5e-4 5e-4 1e-3 2e-3 \
        "${gpu[@]}" --warmup-steps 1760 "${model[@]}" "$@" --output-dir "$out/deep"
fi
if wants deep_cpu; then
    KERAS_BACKEND=tensorflow "$python" -m keras_vitnorm ablate --groups deep --lr-sweep 1.25e-4 2.5e-4 5e-4 1e-3 \
        --patch-size 8 --steps 6000 --steps-per-epoch 500 --warmup-steps 750 --grad-norm-every 100 \
        "${model[@]}" "${cpu[@]}" --output-dir "$out/deep_cpu"
fi
