#!/usr/bin/env bash
# Builds the GPU kit in .gpu/ (ignored by git): the wheels the GPU machine lacks and the
# data archives of ../shared/data cut into parts that fit one device call each.
#
# Usage: bash tools/gpu/kit.sh [ARCHIVE ...]    e.g. cifar10-jpg imagenette2_224
#
# The machine's Python (3.12) has JAX, PyTorch, timm, transformers, Pillow and SciPy but
# not Keras, so the wheels are Keras (the version installed here) and its two
# dependencies the image lacks. A device call carries at most 64 MiB with the
# working tree, so each archive travels in parts, one per call (tools/gpu/README.md),
# each as large as a call carries beside the tree and the wheels (tools/gpu/carry.py).
# perf.sh's timm travels apart, in .gpu/timm (TIMM_VERSION; pure Python, its needs are
# in the image), so that a data part's call carries no more.
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF "/.gpu/" "$exclude" 2>/dev/null || echo "/.gpu/" >> "$exclude"
mkdir -p .gpu/whl .gpu/timm .gpu/parts
python=${PYTHON:-python}
keras_version=$("$python" -c "import keras; print(keras.__version__)")
rm -f .gpu/whl/*.whl .gpu/timm/*.whl
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .gpu/whl "keras==$keras_version" namex optree
"$python" -m pip download -q --no-deps --only-binary=:all: -d .gpu/timm \
    "timm==${TIMM_VERSION:-1.0.31}"
data=${DATA_DIR:-../shared/data}
[ $# -eq 0 ] || part=$("$python" tools/gpu/carry.py .gpu/whl)
for name in "$@"; do
    archive="$data/$name.tar"
    [ -f "$archive" ] || { echo "no archive $archive" >&2; exit 2; }
    rm -f ".gpu/parts/$name.tar.part-"*
    split -b "$part" -d "$archive" ".gpu/parts/$name.tar.part-"
    cp "$archive.sha256" ".gpu/parts/$name.tar.sha256"
done
ls -l .gpu/whl .gpu/timm .gpu/parts
