"""What differs per backend beyond the layers' ops: gradients, devices, processes, random
state, and the compiled call of the input pipeline's RandAugment (docs/backends.md)."""

import importlib

import keras
import numpy as np

__all__ = [
    "any_process", "average_gradients", "compiled", "count_bins",
    "distribution_scope", "from_first_process", "global_random_state", "gradients_function",
    "keeping_variables", "name", "remember_variables", "process_index_and_count",
    "process_share", "processes_start_equal", "set_global_random_state",
    "share_global_random_state", "share_variables", "value_and_gradients",
]


def name():
    """The Keras backend this process computes with (`"jax"`, `"tensorflow"`, `"torch"`)."""
    return keras.backend.backend()


def _import_native():
    module = {"jax": "_jax", "tensorflow": "_tensorflow", "torch": "_torch"}.get(name())
    return None if module is None else importlib.import_module(f"keras_vitnorm.backend.{module}")


# Imported now, not at a first call: `torch.compile` cannot trace an import (nor a cache
# around one) and would split the compiled step there.
_NATIVE = _import_native()


def _native():
    if _NATIVE is None:
        raise ValueError(f"keras_vitnorm runs on jax, tensorflow and torch, not {name()!r}.")
    return _NATIVE


def value_and_gradients(model, inputs, loss_fn, training=False):
    """`(loss, input_gradient, {variable path: gradient})` as NumPy, `loss_fn` mapping the model's
    output to a scalar; a weight the loss does not depend on gets a zero gradient."""
    return _as_numpy(model, *_native().value_and_gradients(model, inputs, loss_fn, training))


def gradients_function(model, loss_fn, training=False):
    """`value_and_gradients` as a function of the inputs, reading the weights at each call."""
    gradients = _native().gradients_function(model, loss_fn, training)
    return lambda inputs: _as_numpy(model, *gradients(inputs))


def _as_numpy(model, loss, input_grad, grads):
    to_numpy = keras.ops.convert_to_numpy
    weight_grads = {}
    for variable, grad in zip(model.trainable_variables, grads):
        grad = np.zeros(variable.shape, "float32") if grad is None else to_numpy(grad)
        weight_grads[variable.path] = grad
    return float(to_numpy(loss)), to_numpy(input_grad), weight_grads


def distribution_scope(kind, sharded_layout):
    """`(context manager, data-parallel replicas)` that trains over every device.

    `kind` `"data"` or `"fsdp"` (JAX only: also splits the variables `sharded_layout` names, a
    `LayoutMap` over mesh axis `"batch"`); on PyTorch, one `torchrun` process per device.
    """
    return _native().distribution_scope(kind, sharded_layout)


def process_index_and_count():
    """`(index, count)` of this process among the training processes; `(0, 1)` for one."""
    return _native().process_index_and_count()


def process_share():
    """`(index, count)` of this process's share of each global batch (torchrun's, else `(0, 1)`)."""
    return _native().process_share()


def processes_start_equal():
    """Whether processes seeded alike create equal variables (JAX); where not, share the first's."""
    return _native().PROCESSES_START_EQUAL


def average_gradients(optimizer):
    """Makes `optimizer.apply` average each step's gradients over the processes first (DDP's)."""
    _native().average_gradients(optimizer)


def share_variables(variables, values=None):
    """Sets `variables` to the first process's `values` (default: current) on every process."""
    _native().share_variables(variables, values, lead=process_index_and_count()[0] == 0)


def from_first_process(value):
    """The first training process's small picklable `value`, on every process."""
    return _native().from_first_process(value)


def any_process(flag):
    """Whether `flag` holds on any training process (every process must call this)."""
    return _native().any_process(flag)


def global_random_state():
    """PyTorch's global generator state (Keras' dropout draws from it there), else `None`."""
    return _native().global_random_state()


def set_global_random_state(state):
    """Restores a state from `global_random_state` (not `None`)."""
    _native().set_global_random_state(state)


def share_global_random_state(state, lead):
    """Every process continues from the first process's `state` where the backend has one."""
    state = from_first_process(state) if _native().HAS_GLOBAL_RANDOM_STATE else None
    if state is not None and not lead:
        set_global_random_state(state)


def count_bins(indices, nbins):
    """`bincount` of int32 `indices` into `nbins` bins that also traces under JAX."""
    return _native().count_bins(indices, nbins)


def compiled(function):
    """`function` compiled into one program (JAX: `jax.jit`), or `None` (it stays eager)."""
    return _native().compiled(function)


def keeping_variables(model):
    """A context around a Keras trainer call on `model` that, where the call raises, gives every
    variable it emptied its value back (JAX; docs/backends.md, "A failed call under JAX")."""
    return _native().keeping_variables(model)


def remember_variables(model):
    """Takes the current values of `model`'s variables as those `keeping_variables` restores."""
    _native().remember_variables(model)
