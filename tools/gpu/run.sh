#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with .gpu/ carried (tools/gpu/README.md).
#
#   bash tools/gpu/run.sh stage
#       keeps the carried archive parts (in /tmp/parts) for a later call
#   bash tools/gpu/run.sh unpack DATASET
#       the same, then unpacks DATASET's archive from its parts (once per machine) and
#       prints where its folder is, for a benchmark of its images
#   bash tools/gpu/run.sh DATASET STUDY RUNS SECONDS [ablate options]
#       DATASET cifar10 or imagenette, STUDY one of its recipe's studies
#       (recipes/cifar10_study.sh, recipes/imagenette_study.sh). Starts from the
#       study's finished runs committed in docs/study-results/DATASET-STUDY, plans
#       the runs that can train now (`ablate --plan`), trains the first RUNS of them
#       side by side, writes the tables of every finished run and exports the study
#       without weights to $OUT/STUDY.tar.gz, all within SECONDS of the call's start:
#       training stops GPU_TABLES_SECONDS (default 30) before, so that the tables and
#       the export fit (tables cut short there are written again where the export is
#       committed: tools/gpu/README.md). Each run's log comes back in
#       $OUT/STUDY-logs.tar.gz, and $OUT/monitor.txt has the GPU's use and the host's
#       load every 10 s.
#
# A run still training when its time is up is stopped. Its checkpoint stays in
# /tmp/studies while the machine is warm: the same command on the warm machine
# resumes it; on a new machine it starts again. Compiled programs are kept in
# /tmp/jax_cache for the warm machine's next call.
#
# GPU_MPS=1 starts NVIDIA's Multi-Process Service daemon before the runs train (its
# pipe and log folders in $GPU_WORK/mps), so that their kernels run at the same time
# instead of in turns, and quits it when the call ends; where it cannot start, the
# runs share the GPU without it. Use it where bench_packing.py's `--sharing mps` has
# shown that MPS serves this machine's processes (tools/gpu/README.md).
#
# GPU_KIT (default .gpu) and GPU_WORK (default /tmp) move the kit and the machine's
# working folders (bin, site, parts, data, studies, export, jax_cache), and
# GPU_RESULTS (default docs/study-results) the committed studies a study starts from,
# for a rehearsal on a CPU (tests/test_gpu_kit.py).
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
export PYTHONPATH=$work/site:$PWD JAX_COMPILATION_CACHE_DIR=$work/jax_cache
# `keras-vitnorm`, as the plan's commands call it.
mkdir -p "$work/bin" "$work/parts" "$work/data" "$work/studies"
printf '#!/usr/bin/env bash\nexec %s -m keras_vitnorm "$@"\n' "$PYTHON" > "$work/bin/keras-vitnorm"
chmod +x "$work/bin/keras-vitnorm"
export PATH=$work/bin:$PATH
cp -n "$kit"/parts/* "$work/parts/" 2>/dev/null
ls -l "$work/parts"
[ "${1:-stage}" = stage ] && exit 0
usage="usage: $0 stage | unpack DATASET | DATASET STUDY RUNS SECONDS [ablate options]"
mode=$1
if [ "$mode" = unpack ]; then
    [ $# = 2 ] || { echo "$usage" >&2; exit 2; }
    dataset=$2
elif [ $# -lt 4 ]; then
    echo "$usage" >&2
    exit 2
else
    dataset=$1 study=$2 runs=$3 seconds=$4
    shift 4
fi
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
if [ "$mode" = unpack ]; then
    echo "$data"
    exit 0
fi
reserve=${GPU_TABLES_SECONDS:-30}
deadline=$seconds  # SECONDS counts from the script's start
studies=$work/studies
committed=${GPU_RESULTS:-docs/study-results}/$dataset-${study//_/-}
if [ -d "$committed" ] && [ ! -d "$studies/$study" ]; then
    cp -r "$committed" "$studies/$study"
fi
if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
    while sleep 10; do  # ends with the call
        echo "$(date +%T) $(nvidia-smi --query-gpu=utilization.gpu,memory.used \
            --format=csv,noheader) load $(cut -d' ' -f1 /proc/loadavg)"
    done > "$OUT/monitor.txt" 2>&1 &
    monitor=$!
fi
study_command() {
    STUDIES=$study bash "$recipe" "$data" "$studies" "$@"
}
export -f study_command
export study recipe data studies
study_command "$@" --plan --parallel 1 --take-over-lock || exit 1
# One run per line of the plan, side by side; each line's output beside its job file.
# Each line of a run's log starts with the seconds since the run began (its phases:
# reading the data, compiling, each epoch).
run_line() {
    bash -c "$1 --verbose 2" 2>&1 | while IFS= read -r line; do
        printf '%5d %s\n' "$SECONDS" "$line"
    done > "${1##* }.log"
}
export -f run_line
if [ "${GPU_MPS:-0}" = 1 ]; then
    export CUDA_MPS_PIPE_DIRECTORY=$work/mps/pipe CUDA_MPS_LOG_DIRECTORY=$work/mps/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if ! command -v nvidia-cuda-mps-control > /dev/null; then
        echo "GPU_MPS=1: nvidia-cuda-mps-control is not on PATH; the runs share the GPU without MPS"
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    elif nvidia-cuda-mps-control -d; then
        trap 'echo quit | nvidia-cuda-mps-control' EXIT
        echo "GPU_MPS=1: the MPS daemon runs (pipe $CUDA_MPS_PIPE_DIRECTORY)"
    else
        echo "GPU_MPS=1: the MPS daemon did not start; the runs share the GPU without MPS"
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    fi
fi
start=$SECONDS
# A run stopped by SIGTERM writes its checkpoint; SIGKILL follows 20 s later.
training=$((deadline - reserve - 20 - SECONDS))
if [ "$training" -lt 1 ]; then
    echo "no time left to train: SECONDS=$seconds leaves none after the ${reserve} s kept" \
        "for the tables and export (GPU_TABLES_SECONDS)" >&2
    exit 2
fi
head -n "$runs" "$studies/$study/plan/commands.txt" \
    | timeout --signal=TERM --kill-after=20 "$training" xargs -P "$runs" -I{} bash -c 'run_line "$1"' _ {}
# timeout stops xargs at once, its runs only after their checkpoints are written: wait
# for them (SIGKILL after 20 s) before anything reads the study.
runs_of_plan="ablate-job $studies/$study/plan/"
for _ in $(seq 20); do
    pgrep -f "$runs_of_plan" > /dev/null || break
    sleep 1
done
pkill -KILL -f "$runs_of_plan" && sleep 1
echo "training stopped after $((SECONDS - start)) s"
if [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then  # a client that cannot reach it runs without it
    servers=$(echo get_server_list | nvidia-cuda-mps-control | tr -cs '0-9' ' ')
    if [ -n "${servers// /}" ]; then
        echo "MPS served the runs (servers:${servers%% })"
    else
        echo "no MPS server ran: the runs took turns on the GPU"
    fi
fi
tar -czf "$OUT/$study-logs.tar.gz" -C "$studies/$study" plan 2>/dev/null
# The export needs a few seconds: the tables get the rest of the time kept.
if [ -z "$(find "$studies/$study" -name metrics.json -print -quit)" ]; then
    echo "no run has finished: no tables to write"
else
    timeout --kill-after=5 $((deadline - SECONDS - 10 > 1 ? deadline - SECONDS - 10 : 1)) \
        bash -c 'study_command "$@" --tables-only --parallel 1 --take-over-lock' _ "$@" \
        > "$work/tables.log" 2>&1
    case $? in
        0) ;;
        124|137) echo "the tables were stopped at the call's time (their log: tables.log)" ;;
        *) echo "the tables step failed (its log: tables.log)" ;;
    esac
    tail -n 40 "$work/tables.log"
    cp "$work/tables.log" "$OUT/"
fi
rm -rf "$work/export/$study"
"$PYTHON" -c "import sys; from keras_vitnorm.study import export_study; \
print(export_study(sys.argv[1], sys.argv[2]), 'finished runs exported')" \
    "$studies/$study" "$work/export/$study"
tar -czf "$OUT/$study.tar.gz" -C "$work/export" "$study"
[ -n "${monitor:-}" ] && kill "$monitor" 2>/dev/null
echo "call's script ended after $SECONDS s"
ls -l "$OUT"
