#!/usr/bin/env bash
# Runs the test suite once per Keras backend (jax, tensorflow, torch) and fails if
# any run fails (pytest's "no tests collected", exit 5, counts as a failure).
# Extra arguments go to pytest, e.g. `bash tools/test_backends.sh -k parity`.
set -u
cd "$(dirname "$0")/.."
status=0
summary=""
for backend in jax tensorflow torch; do
    echo "=== KERAS_BACKEND=$backend ==="
    start=$SECONDS
    KERAS_BACKEND=$backend python -m pytest -q -p no:cacheprovider "$@"
    code=$?
    summary+="$backend: exit $code in $((SECONDS - start)) s"$'\n'
    [ $code -ne 0 ] && status=1
done
printf '%s' "$summary"
exit $status
