"""Test-session setup: one JAX compilation cache for the whole session, and the
backend that runs the backend-independent tests.

Most of the JAX suite's time is XLA compiling the same tiny models again: in each
pytest-xdist worker and in each child process the durability, multi-process and
study tests start. JAX's persistent compilation cache, in one fresh directory for
the session that every worker and child process inherits through the environment,
compiles each program once. It changes no result: a cached executable is the one
the compiler made for the same program, options and JAX version.
"""

import os
import shutil
import tempfile

import pytest

CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
# Cache every program, however quick to compile or small (JAX's defaults skip those
# under one second, which are most of a tiny model's).
CACHE_SETTINGS = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}
_OWNED_ENV = "KERAS_VITNORM_TEST_JAX_CACHE_OWNER"

#: Tests marked `one_backend` check code that no backend enters (run directories,
#: locks, storage errors, the study's scheduling, the recipes' arguments), though they
#: train tiny models on the way; they run under this backend only, the quickest for
#: training in child processes. The rest of the suite, which checks what a backend
#: does enter, runs under all three.
ONE_BACKEND = "torch"


def pytest_configure(config):
    # The first process (the xdist controller, or the only one) makes the directory;
    # workers and child processes find it in the environment. A cache directory the
    # user set is used as it is.
    if os.environ.get(CACHE_ENV):
        return
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="keras_vitnorm-jax-cache-")
    os.environ[_OWNED_ENV] = str(os.getpid())
    for name, value in CACHE_SETTINGS.items():
        os.environ.setdefault(name, value)


def pytest_unconfigure(config):
    if os.environ.get(_OWNED_ENV) == str(os.getpid()):
        shutil.rmtree(os.environ.pop(CACHE_ENV), ignore_errors=True)
        os.environ.pop(_OWNED_ENV, None)


def pytest_collection_modifyitems(config, items):
    import keras

    if keras.backend.backend() == ONE_BACKEND:
        return
    skip = pytest.mark.skip(
        reason=f"backend-independent: runs once, under KERAS_BACKEND={ONE_BACKEND}")
    for item in items:
        if item.get_closest_marker("one_backend"):
            item.add_marker(skip)
