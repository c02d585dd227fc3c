#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with .gpu/ carried (tools/gpu/README.md).
#
#   bash tools/gpu/run.sh stage                 keep the carried archive parts (in /tmp)
#   bash tools/gpu/run.sh cifar10 STUDY SECONDS [ablate options]
#       trains STUDY of recipes/cifar10_study.sh (converged, converged_lr, regularized,
#       deep) for at most SECONDS, then writes the tables of the finished runs and
#       exports the study without weights to $OUT/STUDY.tar.gz
#   bash tools/gpu/run.sh imagenette STUDY SECONDS [options]   the same for
#       recipes/imagenette_study.sh
#
# Every call first stages the parts it carries. A run still training when SECONDS
# are up is stopped; its checkpoint stays in /tmp/studies while the machine is warm,
# so the same command on the warm machine resumes it.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHON=${PYTHON:-python3} KERAS_BACKEND=jax PYTHONUNBUFFERED=1
if ls .gpu/whl/*.whl > /dev/null 2>&1 && [ ! -d /tmp/site/keras ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/site .gpu/whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/parts /tmp/data /tmp/studies
cp -n .gpu/parts/* /tmp/parts/ 2>/dev/null
ls -l /tmp/parts
task=${1:-stage}
[ "$task" = stage ] && exit 0
[ $# -ge 3 ] || { echo "usage: $0 stage | cifar10|imagenette STUDY SECONDS [options]" >&2; exit 2; }
study=$2 seconds=$3
shift 3
case $task in
    cifar10) archive=cifar10-jpg recipe=recipes/cifar10_study.sh ;;
    imagenette) archive=imagenette2_224 recipe=recipes/imagenette_study.sh ;;
    *) echo "unknown task '$task': stage, cifar10 or imagenette" >&2; exit 2 ;;
esac
data=/tmp/data/$archive
if [ ! -d "$data" ]; then
    cat /tmp/parts/"$archive".tar.part-* > /tmp/"$archive".tar || exit 1
    (cd /tmp && sha256sum -c parts/"$archive".tar.sha256) \
        || { echo "the parts of $archive do not add up: carry the missing ones" >&2; exit 1; }
    mkdir -p "$data.partial" && tar -xf /tmp/"$archive".tar -C "$data.partial" \
        && mv "$data.partial" "$data" && rm /tmp/"$archive".tar || exit 1
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
start=$SECONDS
STUDIES=$study timeout --signal=TERM --kill-after=20 "$seconds" \
    bash "$recipe" "$data" /tmp/studies "$@" --take-over-lock
echo "training stopped after $((SECONDS - start)) s (exit $?)"
STUDIES=$study bash "$recipe" "$data" /tmp/studies "$@" --tables-only --parallel 1 \
    --take-over-lock > /tmp/tables.log 2>&1
tail -n 30 /tmp/tables.log
"$PYTHON" -c "import sys; from keras_vitnorm.study import export_study; \
print(export_study(sys.argv[1], sys.argv[2]), 'finished runs exported')" \
    "/tmp/studies/$study" "/tmp/export/$study"
tar -czf "$OUT/$study.tar.gz" -C /tmp/export "$study"
ls -l "$OUT"
