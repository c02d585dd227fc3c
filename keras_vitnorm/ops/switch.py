"""The switch of the backend fast paths (docs/backends.md, "Fast paths and their switch").

On by default; `KERAS_VITNORM_FAST_PATHS` (`0`, or the names to keep on), `set_fast_paths`
or `fast_paths` turn them off. JAX and TensorFlow read it when they trace a step.
"""

import contextlib
import os

#: Every fast path, by the name the switch knows it by.
FAST_PATHS = (
    "linear",  # PyTorch: the bias add fused into the matmul
    "split_qkv",  # TensorFlow: q, k and v from three matmuls
    "attention",  # heads-first on a CPU; PyTorch's SDPA; cuDNN on padded tokens (JAX GPU)
    "residual_fence",  # JAX on a CPU: a gradient fence on the residual stream
    "bincount_histogram",  # RandAugment's Equalization histogram by bincount
)
ENVIRONMENT_VARIABLE = "KERAS_VITNORM_FAST_PATHS"


def _check_names(names, where):
    unknown = [name for name in names if name not in FAST_PATHS]
    if unknown:
        raise ValueError(
            f"Unknown fast path {unknown[0]!r} in {where}; the fast paths are "
            f"{', '.join(FAST_PATHS)}.")
    return list(names)


def _from_environment():
    value = os.environ.get(ENVIRONMENT_VARIABLE, "").strip()
    if value.lower() in ("", "1", "all", "on", "true"):
        return dict.fromkeys(FAST_PATHS, True)
    if value.lower() in ("0", "none", "off", "false"):
        return dict.fromkeys(FAST_PATHS, False)
    names = _check_names([part.strip() for part in value.split(",") if part.strip()],
                         f"{ENVIRONMENT_VARIABLE}={value!r}")
    return {name: name in names for name in FAST_PATHS}


_enabled = _from_environment()


def fast_path_enabled(name):
    """Whether the fast path `name` (one of `FAST_PATHS`) is on."""
    return _enabled[name]


def set_fast_paths(enabled=True, names=None):
    """Turns `names` (default: all) on or off; returns the previous `{name: bool}` of all."""
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled must be True or False, got {enabled!r}.")
    chosen = FAST_PATHS if names is None else _check_names(names, "set_fast_paths")
    previous = dict(_enabled)
    for name in chosen:
        _enabled[name] = enabled
    return previous


@contextlib.contextmanager
def fast_paths(enabled=True, names=None):
    """`set_fast_paths` within a `with` block; the previous state comes back after it."""
    previous = set_fast_paths(enabled, names)
    try:
        yield
    finally:
        _enabled.update(previous)
