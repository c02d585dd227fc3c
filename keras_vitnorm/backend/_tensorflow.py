"""TensorFlow forms of `keras_vitnorm.backend`: one process per run, so exchanges are identities."""

import contextlib

import tensorflow as tf

PROCESSES_START_EQUAL = True
HAS_GLOBAL_RANDOM_STATE = False


def value_and_gradients(model, inputs, loss_fn, training):
    x = tf.convert_to_tensor(inputs)
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = loss_fn(model(x, training=training))
    grads = tape.gradient(loss, [x] + variables)
    return loss, grads[0], grads[1:]


def gradients_function(model, loss_fn, training):
    return lambda inputs: value_and_gradients(model, inputs, loss_fn, training)


def distribution_scope(kind, sharded_layout):
    if kind == "fsdp":
        raise ValueError(
            "distribute='fsdp' is available on the JAX backend only (keras.distribution."
            "ModelParallel); the 'tensorflow' backend trains with distribute='data'.")
    # All GPUs, else every logical CPU (one unless the process split the CPU).
    devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
    strategy = tf.distribute.MirroredStrategy(devices=[d.name for d in devices])
    return strategy.scope(), strategy.num_replicas_in_sync


def process_index_and_count():
    return 0, 1


def process_share():
    return 0, 1


def average_gradients(optimizer):
    raise ValueError("TensorFlow averages the gradients over its replicas itself.")


def share_variables(variables, values, lead):
    if values is not None:
        for variable, value in zip(variables, values):
            variable.assign(value)


def from_first_process(value):
    return value


def any_process(flag):
    return bool(flag)


def global_random_state():
    return None


def set_global_random_state(state):
    pass  # dropout draws from the layers' seed generators, restored with the model


def count_bins(indices, nbins):
    return tf.math.bincount(indices, minlength=nbins, maxlength=nbins, dtype="int32")


def compiled(function):
    return None  # the input pipeline's plain form: NumPy and a layer call per image


def keeping_variables(model):
    return contextlib.nullcontext()  # Keras' trainer updates the variables in place


def remember_variables(model):
    pass
