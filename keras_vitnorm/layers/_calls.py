"""Calling a sublayer from its parent's `call`, without Keras' per-call cost where that cost buys nothing.

Why it exists: on PyTorch every layer call runs eagerly, and Keras'
`Layer.__call__` (input conversion, `CallSpec` binding, input-spec check, call
context, name scopes, autocast scope, mask bookkeeping, then `torch.nn.Module`
dispatch) costs about 0.04 ms before the layer's `call` starts. A ViT's blocks
call about eight sublayers each, and on a CPU that bookkeeping was most of the
gap between the PyTorch backend and the transformers ViT at inference: a
`torch.profiler` comparison in one process measured equal time in ATen
operators and 29 ms against 6 to 7 ms per S/16 step outside them
(docs/performance.md, "Sublayer calls on PyTorch").
JAX and TensorFlow trace each step once, so there the cost is paid once per
compilation and this module changes nothing.

`call_sublayer(parent, layer, x, ...)` calls `layer.call` directly only where
`Layer.__call__` would do nothing but call it:

- the backend is PyTorch and `x` is a concrete tensor (not a symbolic one);
- `layer` is built;
- `layer` and `parent` have the same dtype policy, and either both autocast
  (then the autocast scope that `parent.__call__` opened is the one
  `layer.__call__` would open) or the policy is not mixed (then any scope in
  force casts to the variables' own dtype, a no-op, as the one
  `layer.__call__` would open does: Keras' `LayerNormalization` does not
  autocast); and `x` already has `layer`'s input dtype, so no cast is due;
- `x` carries no Keras mask, `layer` has no activity regularizer, is not
  quantized and was not built under `keras.RematScope`;
- PyTorch itself would go straight to `forward` (`backend_ops.torch_forward_is_plain`:
  no hooks, no `torch.jit.trace`, no `Module.compile()`).

Everywhere else it is `layer(x, ...)`. `parent` must be the layer whose
`call` is running, entered through Keras' `__call__` (or through this
function): the rules above rest on the scope its `__call__` opened.
"""

import functools
import inspect

import keras

from keras_vitnorm.backend_ops import torch_forward_is_plain

_EAGER_BACKEND = keras.backend.backend() == "torch"

#: Set to `False` to send every sublayer call through Keras' `Layer.__call__`
#: (the A/B in `benchmarks/bench_ab.py --changes sublayer_calls` and the tests).
ENABLED = True


@functools.cache
def _accepts_training(call):
    """Whether a `call` function takes `training` (cached per function, so a patched `call` is looked at anew)."""
    return "training" in inspect.signature(call).parameters


@functools.cache
def _standard_dtype(dtype):
    return keras.backend.standardize_dtype(dtype)


@functools.cache
def _keras_marks_remat():
    """Whether Keras records `RematScope` on each layer as `_remat_mode` (checked once).

    If a Keras release renames it, every call goes through `Layer.__call__`
    rather than risk skipping rematerialization.
    """
    return hasattr(keras.layers.Identity(), "_remat_mode")


def skips_keras_call(parent, layer, x, kwargs):
    """Whether `layer(x, **kwargs)` from `parent.call` may run as `layer.call(x, **kwargs)`."""
    return (
        ENABLED
        and _EAGER_BACKEND
        and layer.built
        and keras.ops.is_tensor(x)
        and layer.dtype_policy.name == parent.dtype_policy.name
        and (
            (layer.autocast and parent.autocast)
            or layer.dtype_policy.compute_dtype == layer.dtype_policy.variable_dtype
        )
        and _standard_dtype(x.dtype) == layer.input_dtype
        and ("training" in kwargs or not _accepts_training(type(layer).call))
        and getattr(x, "_keras_mask", None) is None
        and layer.activity_regularizer is None
        and getattr(layer, "quantization_mode", None) is None
        and _keras_marks_remat()
        and layer._remat_mode is None
        and torch_forward_is_plain(layer)
    )


def call_sublayer(parent, layer, x, **kwargs):
    """`layer(x, **kwargs)`, called from `parent.call`; `layer.call` directly where that is the same.

    Args:
        parent: the layer whose `call` is running.
        layer: a sublayer of `parent`.
        x: its one positional input.
        **kwargs: keyword arguments for the call (`training`); `training` is
            dropped on the direct path when `layer.call` does not take it, as
            Keras drops it.

    Returns:
        What `layer(x, **kwargs)` returns.
    """
    if skips_keras_call(parent, layer, x, kwargs):
        if "training" in kwargs and not _accepts_training(type(layer).call):
            kwargs = {key: value for key, value in kwargs.items() if key != "training"}
        return layer.call(x, **kwargs)
    return layer(x, **kwargs)
