#!/usr/bin/env bash
# Runs the test suite once per Keras backend (jax, tensorflow, torch) and fails if
# any run fails (pytest's "no tests collected", exit 5, counts as a failure).
# Extra arguments go to pytest, e.g. `bash tools/test_backends.sh -k parity`. Tests run in
# PYTEST_WORKERS processes (pytest-xdist; default 2, the cores of the CI machine; 0 runs
# them in this process). PYTHON names the interpreter (see below).
set -u
cd "$(dirname "$0")/.."
# The interpreter: $PYTHON if set; else an active virtual environment's `python`; else
# the README's .venv, so the command works in a new shell where it is not activated
# (the system's pytest has no pytest-xdist for -n).
if [ -z "${PYTHON:-}" ]; then
    if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then
        PYTHON=.venv/bin/python
    else
        PYTHON=python
    fi
fi
status=0
summary=""
for backend in jax tensorflow torch; do
    echo "=== KERAS_BACKEND=$backend ==="
    start=$SECONDS
    KERAS_BACKEND=$backend "$PYTHON" -m pytest -q -p no:cacheprovider -n "${PYTEST_WORKERS:-2}" "$@"
    code=$?
    summary+="$backend: exit $code in $((SECONDS - start)) s"$'\n'
    [ $code -ne 0 ] && status=1
done
printf '%s' "$summary"
exit $status
