#!/usr/bin/env bash
# The normalization comparison in the Dual PatchNorm paper's own patch geometry:
# Imagenette (ImageNet images of 10 classes) in 16-px patches, on a ViT of Ti/16's size
# (width 192, 3 heads, MLP 768, 12 blocks), each variant at its own peak learning rate.
# The official val/ folder is the test set, scored once per run at the end; validation
# (the rate choice, the curves) is 10% of train/, carved with a fixed seed.
#
# On a 2-core CPU (TensorFlow, two runs at a time with one thread each, mixed_bfloat16):
#   <out>/cpu          the nine variants of `core` (pre-LN, DPN, post-LN, Peri-LN,
#                      DeepNorm, conv stem, RMSNorm, DyT, BatchNorm) at 112 px (7x7 =
#                      49 tokens: the paper's 16-px patch at its /32 models' token
#                      count), a sweep of 5e-4, 1e-3 and 2e-3 on seed 0, extended by a
#                      rate beyond whichever end a variant's choice lands on, then seeds
#                      0, 1, 2 at each variant's rate
#   <out>/cpu_calibrate  pre-LN at 1e-3 trained twice as long (7,980 steps), seed 0:
#                      how close to its plateau the cpu study's budget ends
# On a GPU (JAX, eight runs at a time, bfloat16):
#   <out>/imagenette   the eight variants of `converged` at 224 px (196 tokens), a sweep of
#                      5e-4, 1e-3 and 2e-3 on seed 0, then seeds 0, 1, 2 at each variant's rate
#   <out>/calibrate    the same eight at 1e-3 for 330 steps (33 warm-up), seed 0: how fast runs
#                      train 8 at a time on the GPU at hand, for planning the rest
#
# The CPU recipe: AdamW at batch 64, 3,990 steps (30 passes over 8,522 training images),
# 399 warm-up steps (3 passes) then cosine decay, decoupled weight decay 0.1, clipping
# at 1.0; random zoom-in crops and flips, MixUp 0.2 and stochastic depth 0.1, without
# RandAugment: on the one core each run has, its tf.data input reads 61 images/s
# against the step's 67, so it would take 52% of a run's time; without it the input
# reads 1,157 images/s, 5% of the time (benchmarks/bench_input.py, recipes
# imagenette and imagenette_cpu; docs/study-results/imagenette-cpu). The images are resized
# once to 112 px with an antialiased filter (tools/resize_folder.py, into
# <out>/imagenette_112) and kept decoded in memory by the input pipeline.
#
# The GPU recipe: big_vision's AugReg ImageNet setup scaled to 8,522 training images:
# AdamW at batch 256, 3,300 steps (about 100 passes), 330 warm-up steps then cosine
# decay, decoupled weight decay 0.1 (big_vision's 1e-4 at its rate 1e-3), clipping at
# 1.0; random zoom-in crops (Keras core has no Inception crop) and flips, RandAugment
# with 2 operations at strength 0.5, MixUp 0.2 and stochastic depth 0.1 (the "light2"
# augmentation with AugReg's regularization); bfloat16 matmuls, class-token pooling.
# Evaluated and checkpointed every 165 steps (5 passes).
#
# Usage: [STUDIES="cpu cpu_calibrate"] recipes/imagenette_study.sh IMAGENETTE_DIR OUTPUT_DIR [extra ablate options]
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
all="cpu cpu_calibrate imagenette calibrate"
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
splits() {  # splits FOLDER LAYOUT: LAYOUT/train -> FOLDER/train, LAYOUT/test -> FOLDER/val
    mkdir -p "$2"
    ln -sfn "$(cd "$1" && pwd)/train" "$2/train"
    ln -sfn "$(cd "$1" && pwd)/val" "$2/test"
}
layout="$out/imagenette_splits"
splits "$data" "$layout"
if wants cpu || wants cpu_calibrate; then
    small="$out/imagenette_112"
    if [ ! -d "$small" ]; then
        "$python" "$(dirname "$0")/../tools/resize_folder.py" "$data" "$small" --size 112
        if [ ! -d "$small/train" ]; then
            echo "tools/resize_folder.py wrote no $small/train" >&2
            exit 1
        fi
    fi
    splits "$small" "$out/imagenette_112_splits"
    cpu=(--dataset "folder:$out/imagenette_112_splits" --image-size 112 --patch-size 16 --width 192
         --num-heads 3 --mlp-dim 768 --depth 12 --batch-size 64 --lr 1e-3 --steps 3990
         --steps-per-epoch 133 --warmup-steps 399 --weight-decay 0.1 --grad-clip 1.0
         --label-smoothing 0 --crop zoom --zoom 0.75 --flip --mixup 0.2 --drop-path 0.1
         --mixed-precision mixed_bfloat16 --grad-norm-every 399 --parallel 2)
fi
if wants cpu; then
    KERAS_BACKEND=tensorflow "$python" -m keras_vitnorm ablate "${cpu[@]}" --groups core \
        --lr-sweep 5e-4 1e-3 2e-3 --extend-sweep --seeds 0 1 2 "$@" --output-dir "$out/cpu"
fi
if wants cpu_calibrate; then
    KERAS_BACKEND=tensorflow "$python" -m keras_vitnorm ablate "${cpu[@]}" --groups core \
        --variants core:pre_ln --steps 7980 --seeds 0 --parallel 1 "$@" \
        --output-dir "$out/cpu_calibrate"
fi
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
