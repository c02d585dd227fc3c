#!/usr/bin/env bash
# Measures docs/performance.md's GPU table on the GPU machine, from the repository root,
# with .gpu/whl and .gpu/timm carried (kit.sh; tools/gpu/README.md): B/16 and S/16 at 224,
# mixed_bfloat16, batch 256, inference and training, for the transformers ViT (the
# reference), timm's ViT eager and under torch.compile, and keras_vitnorm on JAX and
# PyTorch: img/s, ratio to the reference, MFU against the measured matmul rate and the
# datasheet's dense bfloat16 peak, peak memory; and each implementation's largest
# training batch at B/16.
#
#   bash tools/gpu/perf.sh [table|largest|all] [SECONDS]
#     table    the two tables (benchmarks/bench_vit.py --interleave, 3 rounds)
#     largest  only the B/16 largest-batch search (tools/gpu/largest_batch.py), for at most
#              SECONDS (default 270); on the warm machine of a `table` call, its B/16 steps
#              count as known fits
#     all      (default) the tables, then the search with what is left of SECONDS
#              (default 290) since the script started; skipped with under 30 s left
#
# Writes $OUT/perf.md (the GPU, then each table), $OUT/b16.json and $OUT/s16.json
# (bench_vit's --json), $OUT/largest.json and $OUT/perf.log (progress and errors).
# PERF_* variables change the setup, for a check on a CPU, e.g.
#   PERF_DEVICE=cpu PERF_BATCH=2 PERF_LIMIT=4 PERF_ROUNDS=1 PERF_STEPS=1 PERF_PRESETS=s16 \
#   PERF_IMAGE_SIZE=32 PERF_OVERRIDES='{"depth": 1, "width": 32, "num_heads": 2, "mlp_dim": 64,
#   "patch_size": 8, "num_classes": 10}' bash tools/gpu/perf.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
start=$SECONDS
mode=${1:-all}
case $mode in
    table) budget=0; [ $# -le 1 ] || { echo "table takes no SECONDS" >&2; exit 2; } ;;
    largest) budget=${2:-270} ;;
    all) budget=${2:-290} ;;
    *) echo "usage: $0 [table|largest|all] [SECONDS]; got '$mode'" >&2; exit 2 ;;
esac
[[ $budget =~ ^[0-9]+$ ]] || { echo "SECONDS must be a whole number, got '$budget'" >&2; exit 2; }
PYTHON=${PYTHON:-python3}
device=${PERF_DEVICE:-gpu}
shopt -s nullglob
wheels=(.gpu/whl/*.whl .gpu/timm/*.whl)  # for the GPU machine's Python only
shopt -u nullglob
if [ "$device" = gpu ] && [ ${#wheels[@]} -gt 0 ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "${wheels[@]}" || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/perf}
mkdir -p "$out"
log=$out/perf.log
read -r -a presets <<< "${PERF_PRESETS:-b16 s16}"
read -r -a backends <<< "${PERF_BACKENDS:-jax torch}"
read -r -a timm <<< "${PERF_TIMM-eager compiled}"
no_overrides='{}'
setup=(--device "$device" --batch-size "${PERF_BATCH:-256}" --image-size "${PERF_IMAGE_SIZE:-224}"
       --mixed-precision mixed_bfloat16
       --backends "${backends[@]}" --overrides "${PERF_OVERRIDES:-$no_overrides}")
[ ${#timm[@]} -gt 0 ] && setup+=(--timm "${timm[@]}")
[ -n "${PERF_LIMIT:-}" ] && limit=(--limit "$PERF_LIMIT") || limit=()
elapsed() { echo "[$((SECONDS - start)) s] $*" | tee -a "$log" >&2; }

if [ "$device" = gpu ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
        | sed 's/^/GPU: /' > "$out/perf.md"
else
    echo "CPU: $(nproc) cores" > "$out/perf.md"
fi
"$PYTHON" -c "import jax, keras, torch; print('Keras', keras.__version__, '| JAX', jax.__version__,
'| PyTorch', torch.__version__)" >> "$out/perf.md" 2>> "$log"
"$PYTHON" -c "import timm, transformers; print('timm', timm.__version__, '| transformers',
transformers.__version__)" >> "$out/perf.md" 2>> "$log"

if [ "$mode" != largest ]; then
    rm -rf /tmp/perf-tables && mkdir -p /tmp/perf-tables
    for preset in "${presets[@]}"; do
        elapsed "table: $preset"
        echo >> "$out/perf.md"
        "$PYTHON" benchmarks/bench_vit.py "${setup[@]}" --preset "$preset" --interleave \
            --rounds "${PERF_ROUNDS:-3}" --steps "${PERF_STEPS:-10}" --repeats 1 --warmup 3 \
            --json "$out/$preset.json" --markdown "$out/$preset.md" 2>> "$log" \
            || elapsed "bench_vit.py failed on $preset"
        cat "$out/$preset.md" >> "$out/perf.md" 2>/dev/null
        rm -f "$out/$preset.md"
        # kept for a `largest` call on the same (warm) machine, as $OUT is emptied
        cp "$out/$preset.json" "/tmp/perf-tables/$preset.json" 2>/dev/null
    done
fi
if [ "$mode" != table ]; then
    left=$((budget - (SECONDS - start)))
    if [ "$left" -lt 30 ]; then
        elapsed "no largest-batch search: $left s left of $budget"
        echo -e "\nlargest batch: not searched ($left s left of $budget)" >> "$out/perf.md"
    else
        elapsed "largest batch: ${presets[0]}, $left s"
        echo >> "$out/perf.md"
        # The table's training steps at this batch are known fits: one try less each.
        known=()
        table=/tmp/perf-tables/${presets[0]}.json
        [ -f "$table" ] && known=(--known "$table")
        "$PYTHON" tools/gpu/largest_batch.py "${setup[@]}" --preset "${presets[0]}" \
            --seconds "$left" "${limit[@]}" "${known[@]}" \
            --json "$out/largest.json" --markdown "$out/largest.md" 2>> "$log" \
            || elapsed "the largest-batch search failed"
        cat "$out/largest.md" >> "$out/perf.md" 2>/dev/null
        rm -f "$out/largest.md"
    fi
fi
elapsed "done"
cat "$out/perf.md"
