"""What differs per backend beyond the layers' ops: gradients, devices and processes.

`keras_vitnorm.ops` holds the tensor operations of the layers; this package holds the
rest of what the library does differently under JAX, TensorFlow and PyTorch, each
function a small form per backend in that backend's private module (`_jax`,
`_tensorflow`, `_torch`, imported only under its backend):

- `value_and_gradients`, `gradients_function`: a loss and its gradients with respect
  to a model's inputs and weights (Keras has no backend-neutral gradient op), once or
  as a function taken again and again.
- `distribution_scope`: the scope that spreads training over devices, and the number
  of data-parallel replicas.
- `process_index_and_count`, `process_share`: where this process stands among the
  training processes, and which share of each batch it reads.
- `average_gradients`, `share_variables`, `from_first_process`, `any_process`: what
  the processes of one run exchange.
- `global_random_state`, `set_global_random_state`, `share_global_random_state`:
  the global generator that PyTorch's dropout draws from.
- `count_bins`, `compiled`, `map_examples`: what the Python input pipeline's
  augmentation program needs: a histogram count that also traces, a compiled program
  (JAX; the fast path `augmentation_program`, chosen by
  `keras_vitnorm.training.data.python_pipeline`), and a function of one example
  applied to each example of a batch inside it.
- `keeping_variables`, `remember_variables`: a model whose `fit`, `evaluate` or
  `predict` raised keeps its weights (JAX, whose trainer empties the variables while
  it runs; `keras_vitnorm.models.guarded_calls`).

Nothing outside `keras_vitnorm.ops` and this package asks which backend it runs on
(tests/test_backend_boundary.py checks it).
"""

import importlib

import keras

__all__ = [
    "any_process", "average_gradients", "compiled", "count_bins",
    "distribution_scope", "from_first_process", "global_random_state", "gradients_function",
    "keeping_variables", "map_examples", "name", "remember_variables",
    "process_index_and_count",
    "process_share", "processes_start_equal", "set_global_random_state",
    "share_global_random_state", "share_variables", "value_and_gradients",
]


def name():
    """The Keras backend this process computes with (`"jax"`, `"tensorflow"`, `"torch"`)."""
    return keras.backend.backend()


def _import_native():
    module = {"jax": "_jax", "tensorflow": "_tensorflow", "torch": "_torch"}.get(name())
    return None if module is None else importlib.import_module(f"keras_vitnorm.backend.{module}")


# Imported with this package, not at a function's first call: `torch.compile`, tracing the
# training step, cannot trace an import (nor see through a cache around one) and would
# split the compiled step there.
_NATIVE = _import_native()


def _native():
    """This backend's module."""
    if _NATIVE is None:
        raise ValueError(f"keras_vitnorm runs on jax, tensorflow and torch, not {name()!r}.")
    return _NATIVE


def value_and_gradients(model, inputs, loss_fn, training=False):
    """Computes a loss and its gradients with respect to the inputs and weights.

    Args:
        model: a built Keras model.
        inputs: NumPy array fed to the model.
        loss_fn: callable mapping the model output (a backend tensor) to a scalar.
        training: bool, default `False`. Passed to the model call.

    Returns:
        `(loss, input_gradient, {variable path: gradient})` as NumPy values. A
        weight the loss does not depend on gets a zero gradient.

    Example:
    >>> loss, dx, dw = value_and_gradients(model, x, lambda y: keras.ops.sum(y))
    """
    return _as_numpy(model, *_native().value_and_gradients(model, inputs, loss_fn, training))


def gradients_function(model, loss_fn, training=False):
    """`value_and_gradients` of `model` and `loss_fn` as a function of the inputs alone,
    for a loss taken again and again (a probe batch every k steps).

    Each call reads the model's weights as they are then. JAX compiles the forward and
    backward pass once, at the first call, where `value_and_gradients` runs them
    operation by operation; TensorFlow and PyTorch run them eagerly either way.

    Returns:
        A function mapping a NumPy array of inputs to `(loss, input_gradient,
        {variable path: gradient})`, as `value_and_gradients` returns them.
    """
    gradients = _native().gradients_function(model, loss_fn, training)
    return lambda inputs: _as_numpy(model, *gradients(inputs))


def _as_numpy(model, loss, input_grad, grads):
    """A backend's `(loss, input gradient, [weight gradient])` as NumPy values, the
    weights' by path, zeros where the loss does not depend on a weight."""
    import numpy as np

    to_numpy = keras.ops.convert_to_numpy
    weight_grads = {}
    for variable, grad in zip(model.trainable_variables, grads):
        weight_grads[variable.path] = (
            np.zeros(variable.shape, "float32") if grad is None else to_numpy(grad)
        )
    return float(to_numpy(loss)), to_numpy(input_grad), weight_grads


def distribution_scope(kind, sharded_layout):
    """`(context manager, number of data-parallel replicas)` that trains over every device.

    Args:
        kind: `"data"` (data-parallel) or `"fsdp"` (JAX: data-parallel with the
            variables that `sharded_layout` names split over the devices too).
        sharded_layout: `{variable path pattern: sharded axes}` for `"fsdp"`, in
            `keras.distribution.LayoutMap`'s form, over one mesh axis `"batch"`.

    JAX: `keras.distribution.DataParallel` (or `ModelParallel` for `"fsdp"`) over all
    devices of all processes (`keras.distribution.initialize()` first where
    `KERAS_DISTRIBUTION_NUM_PROCESSES` > 1). TensorFlow: `tf.distribute.MirroredStrategy`
    over the local GPUs, or the logical CPUs. PyTorch: one process per device, started by
    `torchrun`; the scope is empty and the replicas are the processes.
    """
    return _native().distribution_scope(kind, sharded_layout)


def process_index_and_count():
    """`(index, count)` of this process among the training processes: torchrun's
    rank and world size, or JAX's process index and count; `(0, 1)` for one process."""
    return _native().process_index_and_count()


def process_share():
    """`(index, count)`: which share of each global batch this process trains on.

    `(rank, world size)` under torchrun with its process group running; else `(0, 1)`
    (JAX and TensorFlow split the global batch over their devices themselves).
    """
    return _native().process_share()


def processes_start_equal():
    """Whether processes seeded alike create equal variables (JAX, one program over all
    of them); where not (PyTorch), a fresh start shares the first process's values."""
    return _native().PROCESSES_START_EQUAL


def average_gradients(optimizer):
    """Makes `optimizer.apply` average each step's gradients over the processes first
    (PyTorch's processes: one `all_reduce` of all of them), so every process applies
    the same update: the update DistributedDataParallel computes."""
    _native().average_gradients(optimizer)


def share_variables(variables, values=None):
    """Gives every training process the first process's `values` of `variables` (its
    current ones where `values` is None). Every process calls this, with its own
    variables in the same order; every process assigns (on JAX an assignment is a
    step of all processes)."""
    _native().share_variables(variables, values, lead=process_index_and_count()[0] == 0)


def from_first_process(value):
    """The first training process's `value` (a small picklable object: a step, a
    message; arrays go through `share_variables`), on every process."""
    return _native().from_first_process(value)


def any_process(flag):
    """Whether `flag` holds on any training process (every process must call this)."""
    return _native().any_process(flag)


def global_random_state():
    """The global random state that decides dropout masks as a uint8 array, or `None`.

    Keras' dropout on PyTorch, when it has no noise shape, draws from PyTorch's global
    generator instead of the layer's seed generator, so that state decides the next
    dropout masks too. JAX and TensorFlow draw from the layers' seed generators
    (model variables): `None`.
    """
    return _native().global_random_state()


def set_global_random_state(state):
    """Restores a state from `global_random_state` (not `None`)."""
    _native().set_global_random_state(state)


def share_global_random_state(state, lead):
    """Every process continues from the first process's `state` (`global_random_state`
    of a restored checkpoint); nothing where the backend has no global state. Every
    process calls this."""
    state = from_first_process(state) if _native().HAS_GLOBAL_RANDOM_STATE else None
    if state is not None and not lead:
        set_global_random_state(state)


def count_bins(indices, nbins):
    """How many of the int32 `indices` (each in `[0, nbins)`) fall in each of `nbins`
    bins, as a length-`nbins` vector: `bincount` in a form that also traces inside a
    compiled program (JAX's needs its length fixed; Keras' `ops.bincount` does not
    trace under JAX)."""
    return _native().count_bins(indices, nbins)


def compiled(function):
    """`function` compiled into one program (JAX: `jax.jit`), or `None` where the
    backend has no form the input pipeline uses (PyTorch, TensorFlow: the Python input
    pipeline's augmentation stays NumPy and eager layer calls there)."""
    return _native().compiled(function)


def map_examples(function, *batches, chunk=None):
    """`function` applied to each example of `batches` (arrays or lists of arrays, each
    with the examples along the first axis), the results stacked: a loop over chunks
    of `chunk` examples, each chunk one batched computation (`jax.lax.map`; the loop
    bounds the memory), or where `chunk` is `None` a loop over single examples, in
    which `function` sees no batch axis. JAX only: it is called inside a program of
    `compiled`, which the other backends do not make."""
    return _native().map_examples(function, *batches, chunk=chunk)


def keeping_variables(model):
    """A context around a call of Keras' trainer on `model` (`fit`, `evaluate`, `predict`,
    `*_on_batch`): where the call raises, every variable it emptied gets its value back.

    Keras' JAX trainer moves the variables' values into the compiled step's state and
    empties the variables until the call ends; a call that raises (an input of the wrong
    shape, labels the loss does not take, Ctrl-C) leaves them empty, and the model fails
    at every later call and save. Inside this context they get the state of the call's
    last finished step, or the values they had before it (docs/backends.md, "A failed
    call under JAX"); a variable that cannot get one is named in a note on the error.
    TensorFlow and PyTorch update the variables in place: a context that does nothing.
    """
    return _native().keeping_variables(model)


def remember_variables(model):
    """Takes the values of `model`'s variables as those `keeping_variables` gives back
    (called when Keras has built everything a call needs, before its first step)."""
    _native().remember_variables(model)
