#!/usr/bin/env bash
# The normalization comparison in the Dual PatchNorm paper's own geometry: Imagenette
# (ImageNet images of 10 classes) at 224 px in 16-px patches (196 tokens), on a ViT of
# Ti/16's size (width 192, 3 heads, MLP 768, 12 blocks), each variant of the
# `converged` group at its own peak learning rate.
#
#   <out>/imagenette   the eight variants (pre-LN, DPN, post-LN, DeepNorm, conv stem,
#                      RMSNorm, DyT, BatchNorm), a learning-rate sweep of 5e-4, 1e-3
#                      and 2e-3 on seed 0, then seeds 0, 1, 2 at each variant's rate
#   <out>/calibrate    the same eight at 1e-3 for 330 steps (33 warm-up), seed 0: how fast runs
#                      train 8 at a time on the GPU at hand, for planning the rest
#
# Recipe: big_vision's AugReg ImageNet setup scaled to 8,522 training images: AdamW at
# batch 256, 3,300 steps (about 100 passes), 330 warm-up steps then cosine decay,
# decoupled weight decay 0.1 (big_vision's 1e-4 at its rate 1e-3), clipping at 1.0;
# random zoom-in crops (Keras core has no Inception crop) and flips, RandAugment with
# 2 operations at strength 0.5, MixUp 0.2 and stochastic depth 0.1 (the "light2"
# augmentation with AugReg's regularization); bfloat16 matmuls, class-token pooling.
# Evaluated and checkpointed every 165 steps (5 passes).
#
# Splits: the official val/ folder is the test set, scored once per run at the end;
# validation (the rate choice, the curves) is 10% of train/, carved with a fixed seed.
#
# Usage: [STUDIES="calibrate imagenette"] recipes/imagenette_study.sh IMAGENETTE_DIR OUTPUT_DIR [extra ablate options]
# IMAGENETTE_DIR holds train/<wnid>/*.JPEG and val/<wnid>/*.JPEG (../shared/data's
# imagenette2_224.tar). STUDIES picks studies (default: imagenette). Every run
# resumes: rerun the same command after an interruption. Extra options come last and
# win; `--tables-only --parallel 1` writes the tables from the finished runs.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 IMAGENETTE_DIR OUTPUT_DIR [extra ablate options]" >&2
    exit 2
fi
data=$1 out=$2
shift 2
python=${PYTHON:-python}
all="imagenette calibrate"
studies=${STUDIES:-imagenette}
for study in $studies; do
    if [[ " $all " != *" $study "* ]]; then
        echo "unknown study '$study' in STUDIES; valid: $all" >&2
        exit 2
    fi
done
wants() { [[ " $studies " == *" $1 "* ]]; }
for split in train val; do
    if [ ! -d "$data/$split" ]; then
        echo "$data has no $split/ folder: give the folder that holds train/ and val/" >&2
        exit 2
    fi
done
# The loader reads train/ and test/ and carves validation from train/: val/ is the test set.
layout="$out/imagenette_splits"
mkdir -p "$layout"
ln -sfn "$(cd "$data" && pwd)/train" "$layout/train"
ln -sfn "$(cd "$data" && pwd)/val" "$layout/test"
recipe=(--dataset "folder:$layout" --image-size 224 --patch-size 16 --width 192 --num-heads 3
        --mlp-dim 768 --depth 12 --batch-size 256 --lr 1e-3 --steps 3300 --steps-per-epoch 165
        --warmup-steps 330 --weight-decay 0.1 --grad-clip 1.0 --label-smoothing 0 --crop zoom
        --zoom 0.75 --flip --randaugment-ops 2 --randaugment-factor 0.5 --mixup 0.2
        --drop-path 0.1 --mixed-precision mixed_bfloat16 --input-pipeline python
        --grad-norm-every 165 --parallel 8 --groups converged)
if wants imagenette; then
    KERAS_BACKEND=jax "$python" -m keras_vitnorm ablate "${recipe[@]}" --lr-sweep 5e-4 1e-3 2e-3 \
        --seeds 0 1 2 "$@" --output-dir "$out/imagenette"
fi
if wants calibrate; then
    KERAS_BACKEND=jax "$python" -m keras_vitnorm ablate "${recipe[@]}" --steps 330 --warmup-steps 33 --seeds 0 \
        "$@" --output-dir "$out/calibrate"
fi
