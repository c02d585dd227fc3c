"""The switch of the backend fast paths.

Each op in `keras_vitnorm.ops` has a plain form written in `keras.ops` and, on some
backends and devices, a faster form of the same computation (docs/performance.md
gives each one's measured whole-step gain); so have RandAugment in both input
pipelines (`bincount_histogram`, `augmentation_program`). The fast forms are on by
default. Turn
one or all of them off when an update of Keras, JAX, TensorFlow or PyTorch breaks
one, or to time a form against the other (`benchmarks/bench_vit.py --other-forms` does):

    KERAS_VITNORM_FAST_PATHS=0 python train.py            # all off
    KERAS_VITNORM_FAST_PATHS=attention,linear python ...  # only these on

or in Python:

    from keras_vitnorm import ops
    ops.set_fast_paths(False)                 # all off
    ops.set_fast_paths(False, ["linear"])     # one off
    with ops.fast_paths(False, ["attention"]):
        ...

JAX and TensorFlow read the switch when they trace a step, so change it before the
model's first call (or compile) for it to take effect there; PyTorch reads it at
every call.
"""

import contextlib
import os

#: Every fast path, by the name the switch knows it by.
FAST_PATHS = (
    "linear",             # PyTorch: the bias add fused into the matmul (torch.nn.functional.linear)
    "split_qkv",          # TensorFlow: q, k and v from three matmuls on the fused kernel's thirds
    "attention",          # heads-first attention on a CPU (JAX, TensorFlow); PyTorch's SDPA on
                          # strided views; JAX on a GPU: cuDNN attention on padded tokens
    "residual_fence",     # JAX on a CPU: a gradient fence on the residual stream
    "bincount_histogram",  # RandAugment's Equalization counts its histogram with a
                           # bincount (tf.math.bincount in tf.data, the backend's in the
                           # Python pipeline; a private Keras method replaced on that one
                           # layer; keras_vitnorm.training.data)
    "augmentation_program",  # JAX, the Python input pipeline: a training batch's
                             # augmentation (crops, flips, RandAugment per image, MixUp,
                             # CutMix) as one compiled program on the default device
                             # instead of NumPy and a layer call per image
                             # (keras_vitnorm.training.data.python_pipeline)
)
ENVIRONMENT_VARIABLE = "KERAS_VITNORM_FAST_PATHS"


def _check_names(names, where):
    unknown = [name for name in names if name not in FAST_PATHS]
    if unknown:
        raise ValueError(
            f"Unknown fast path {unknown[0]!r} in {where}; the fast paths are "
            f"{', '.join(FAST_PATHS)}."
        )
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
    """Turns the fast paths `names` (default: all) on or off; returns the previous state.

    Args:
        enabled: bool.
        names: optional list of names from `FAST_PATHS`.

    Returns:
        `{name: bool}` of every fast path before the change.
    """
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
