"""JAX forms of `keras_vitnorm.backend` (imported only under the JAX backend)."""

import contextlib
import os
import pickle

import jax
import keras
import numpy as np
from jax.experimental import multihost_utils

#: Processes seeded alike create equal variables: a JAX program spans all of them.
PROCESSES_START_EQUAL = True
#: Dropout draws from the layers' seed generators, which are model variables.
HAS_GLOBAL_RANDOM_STATE = False


def gradients_function(model, loss_fn, training, jit=True):
    def compute(x, trainable, non_trainable):
        outputs, _ = model.stateless_call(trainable, non_trainable, x, training=training)
        return loss_fn(outputs)

    program = jax.value_and_grad(compute, argnums=(0, 1))
    # One compiled program: op by op, each of the pass's operations compiles on its own.
    program = jax.jit(program) if jit else program

    def gradients(inputs):
        loss, (input_grad, grads) = program(
            jax.numpy.asarray(inputs), [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables])
        return loss, input_grad, grads

    return gradients


def value_and_gradients(model, inputs, loss_fn, training):
    return gradients_function(model, loss_fn, training, jit=False)(inputs)


def distribution_scope(kind, sharded_layout):
    processes = int(os.environ.get("KERAS_DISTRIBUTION_NUM_PROCESSES", "1"))
    if processes > 1:
        if kind == "fsdp":
            raise ValueError(
                "distribute='fsdp' shards the weights over the devices of one process; "
                f"with KERAS_DISTRIBUTION_NUM_PROCESSES={processes} use distribute='data' "
                "(each process would hold only part of the weights it saves).")
        keras.distribution.initialize()
    devices = keras.distribution.list_devices()
    if kind == "data":
        return keras.distribution.DataParallel(devices=devices).scope(), len(devices)
    mesh = keras.distribution.DeviceMesh((len(devices),), ["batch"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    for pattern, axes in sharded_layout.items():
        layout_map[pattern] = axes
    fsdp = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    return fsdp.scope(), len(devices)


def process_index_and_count():
    return jax.process_index(), jax.process_count()


def process_share():
    return 0, 1  # Keras feeds each process its share of every batch itself


def average_gradients(optimizer):
    raise ValueError("JAX averages the gradients over its devices itself.")


def share_variables(variables, values, lead):
    # One variable at a time: every process offers an array of the variable's shape
    # (its own value), and the first process's is the one that arrives.
    for index, variable in enumerate(variables):
        value = values[index] if lead and values is not None else variable
        variable.assign(multihost_utils.broadcast_one_to_all(keras.ops.convert_to_numpy(value)))


def from_first_process(value):
    data = np.frombuffer(pickle.dumps(value), np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int64(data.size)))
    buffer = np.zeros(size, np.uint8)
    buffer[: min(size, data.size)] = data[:size]
    return pickle.loads(np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes())


def any_process(flag):
    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


def global_random_state():
    return None


def set_global_random_state(state):
    pass  # dropout draws from the layers' seed generators, restored with the model


def count_bins(indices, nbins):
    return jax.numpy.bincount(indices, length=nbins)  # a fixed length traces


def compiled(function):
    return jax.jit(function)


# Keras' JAX trainer empties the variables (private `Variable._value = None`) while a
# call runs and keeps each step's state in the private `_jax_state`; `keeping_variables`
# refills them from it, else from the values remembered before (docs/backends.md).
_KEEPERS = []
_STATE = "_jax_state"
_UNKNOWN = object()


def _variable_groups(model):
    """`{group of _jax_state: variables}`, in the order Keras' trainer passes them."""
    optimizer = getattr(model, "optimizer", None)
    return {
        "trainable_variables": list(model.trainable_variables),
        "non_trainable_variables": list(model.non_trainable_variables),
        "optimizer_variables": list(optimizer.variables) if optimizer is not None else [],
        "metrics_variables": list(model.metrics_variables),
    }


def _usable(value):
    return value is not None and not (isinstance(value, jax.Array) and value.is_deleted())


def _emptied(variable):
    """Whether `variable` has no usable value (emptied by Keras' trainer or consumed by a step)."""
    value = getattr(variable, "_value", _UNKNOWN)
    if value is _UNKNOWN:  # Keras keeps the value elsewhere: its public property fails
        try:
            value = variable.value
        except TypeError:
            return True
    return not _usable(value)


class _Keeper:
    def __init__(self, model):
        self.model = model
        self.state_before = getattr(model, _STATE, None)
        self.values = {}
        self.remember()

    def remember(self):
        for variables in _variable_groups(self.model).values():
            for variable in variables:
                if not _emptied(variable):
                    self.values[id(variable)] = variable.value

    def restore(self):
        """Gives every emptied variable a value; returns the paths of those it could not."""
        values = dict(self.values)
        state = getattr(self.model, _STATE, None)
        groups = _variable_groups(self.model)
        if isinstance(state, dict) and state is not self.state_before:  # this call's last step
            for group, variables in groups.items():
                for variable, value in zip(variables, state.get(group) or ()):
                    if _usable(value):
                        values[id(variable)] = value
        lost = []
        for variables in groups.values():
            for variable in variables:
                if not _emptied(variable):
                    continue
                value = values.get(id(variable))
                if _usable(value):
                    variable.assign(value)
                else:
                    lost.append(variable.path)
        if hasattr(self.model, _STATE):  # Keras takes the next call's state from the variables
            setattr(self.model, _STATE, None)
            self.model._jax_state_synced = True
        return lost


@contextlib.contextmanager
def keeping_variables(model):
    keeper = _Keeper(model)
    _KEEPERS.append(keeper)
    try:
        yield
    except BaseException as error:
        lost = keeper.restore()
        if lost and hasattr(error, "add_note"):  # Python 3.11
            error.add_note(
                f"The failed call left {len(lost)} of the model's variables without a value "
                f"({', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''}): load its weights "
                "again before using it.")
        raise
    finally:
        _KEEPERS.remove(keeper)


def remember_variables(model):
    for keeper in _KEEPERS:
        if keeper.model is model:
            keeper.remember()
