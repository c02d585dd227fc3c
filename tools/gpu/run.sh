#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with .gpu/ carried (tools/gpu/README.md).
#
#   bash tools/gpu/run.sh stage
#       keeps the carried archive parts (in /tmp/parts) for a later call
#   bash tools/gpu/run.sh DATASET STUDY RUNS SECONDS [ablate options]
#       DATASET cifar10 or imagenette, STUDY one of its recipe's studies
#       (recipes/cifar10_study.sh, recipes/imagenette_study.sh). Starts from the
#       study's finished runs committed in docs/study-results/DATASET-STUDY, plans
#       the runs that can train now (`ablate --plan`), trains the first RUNS of them
#       side by side for at most SECONDS, writes the tables of every finished run and
#       exports the study without weights to $OUT/STUDY.tar.gz.
#
# A run still training when SECONDS are up is stopped. Its checkpoint stays in
# /tmp/studies while the machine is warm: the same command on the warm machine
# resumes it; on a new machine it starts again.
#
# GPU_KIT (default .gpu) and GPU_WORK (default /tmp) move the kit and the machine's
# working folders (bin, site, parts, data, studies, export), and GPU_RESULTS (default
# docs/study-results) the committed studies a study starts from, for a rehearsal on a
# CPU (tests/test_gpu_kit.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHON=${PYTHON:-python3} KERAS_BACKEND=jax PYTHONUNBUFFERED=1
# The runs share the GPU: each JAX process takes memory as it needs it, not 75% at its start.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
kit=${GPU_KIT:-.gpu} work=${GPU_WORK:-/tmp}
if ls "$kit"/whl/*.whl > /dev/null 2>&1 && [ ! -d "$work/site/keras" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$work/site" "$kit"/whl/*.whl || exit 1
fi
export PYTHONPATH=$work/site:$PWD
# `keras-vitnorm`, as the plan's commands call it.
mkdir -p "$work/bin" "$work/parts" "$work/data" "$work/studies"
printf '#!/usr/bin/env bash\nexec %s -m keras_vitnorm "$@"\n' "$PYTHON" > "$work/bin/keras-vitnorm"
chmod +x "$work/bin/keras-vitnorm"
export PATH=$work/bin:$PATH
cp -n "$kit"/parts/* "$work/parts/" 2>/dev/null
ls -l "$work/parts"
[ "${1:-stage}" = stage ] && exit 0
if [ $# -lt 4 ]; then
    echo "usage: $0 stage | DATASET STUDY RUNS SECONDS [ablate options]" >&2
    exit 2
fi
dataset=$1 study=$2 runs=$3 seconds=$4
shift 4
case $dataset in
    cifar10) archive=cifar10-jpg recipe=recipes/cifar10_study.sh ;;
    imagenette) archive=imagenette2_224 recipe=recipes/imagenette_study.sh ;;
    *) echo "unknown dataset '$dataset': cifar10 or imagenette" >&2; exit 2 ;;
esac
data=$work/data/$archive
if [ ! -d "$data" ]; then
    cat "$work/parts/$archive".tar.part-* > "$work/$archive.tar" || exit 1
    (cd "$work" && sha256sum -c "parts/$archive.tar.sha256") \
        || { echo "the parts of $archive do not add up: carry the missing ones" >&2; exit 1; }
    mkdir -p "$data.partial" && tar -xf "$work/$archive.tar" -C "$data.partial" \
        && mv "$data.partial" "$data" && rm "$work/$archive.tar" || exit 1
fi
studies=$work/studies
committed=${GPU_RESULTS:-docs/study-results}/$dataset-${study//_/-}
if [ -d "$committed" ] && [ ! -d "$studies/$study" ]; then
    cp -r "$committed" "$studies/$study"
fi
command -v nvidia-smi > /dev/null \
    && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
study_command() {
    STUDIES=$study bash "$recipe" "$data" "$studies" "$@"
}
study_command "$@" --plan --parallel 1 --take-over-lock || exit 1
# One run per line of the plan, side by side; each line's output beside its job file.
run_line() { bash -c "$1 --verbose 2" > "${1##* }.log" 2>&1; }
export -f run_line
start=$SECONDS
head -n "$runs" "$studies/$study/plan/commands.txt" \
    | timeout --signal=TERM --kill-after=20 "$seconds" xargs -P "$runs" -I{} bash -c 'run_line "$1"' _ {}
echo "training stopped after $((SECONDS - start)) s"
study_command "$@" --tables-only --parallel 1 --take-over-lock > "$work/tables.log" 2>&1
tail -n 40 "$work/tables.log"
rm -rf "$work/export/$study"
"$PYTHON" -c "import sys; from keras_vitnorm.study import export_study; \
print(export_study(sys.argv[1], sys.argv[2]), 'finished runs exported')" \
    "$studies/$study" "$work/export/$study"
tar -czf "$OUT/$study.tar.gz" -C "$work/export" "$study"
tar -czf "$OUT/$study-logs.tar.gz" -C "$studies/$study" plan "$work/tables.log" 2>/dev/null
ls -l "$OUT"
