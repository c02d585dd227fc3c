"""Gradients of a loss with respect to a model's inputs and weights, on every backend.

Keras has no backend-neutral "gradient of this function" op, so each backend gets
one small function here; the probes of `keras_vitnorm.analysis` and the tests use
`value_and_gradients`.
"""

import keras
import numpy as np


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
    backend = keras.backend.backend()
    if backend == "jax":
        loss, input_grad, grads = _jax(model, inputs, loss_fn, training)
    elif backend == "tensorflow":
        loss, input_grad, grads = _tensorflow(model, inputs, loss_fn, training)
    elif backend == "torch":
        loss, input_grad, grads = _torch(model, inputs, loss_fn, training)
    else:
        raise ValueError(
            f"value_and_gradients supports the jax, tensorflow and torch backends, not {backend!r}."
        )
    to_numpy = keras.ops.convert_to_numpy
    weight_grads = {}
    for variable, grad in zip(model.trainable_variables, grads):
        weight_grads[variable.path] = (
            np.zeros(variable.shape, "float32") if grad is None else to_numpy(grad)
        )
    return float(to_numpy(loss)), to_numpy(input_grad), weight_grads


def _jax(model, inputs, loss_fn, training):
    import jax

    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def compute(x, trainable_values):
        outputs, _ = model.stateless_call(trainable_values, non_trainable, x, training=training)
        return loss_fn(outputs)

    loss, (input_grad, grads) = jax.value_and_grad(compute, argnums=(0, 1))(
        jax.numpy.asarray(inputs), trainable
    )
    return loss, input_grad, grads


def _tensorflow(model, inputs, loss_fn, training):
    import tensorflow as tf

    x = tf.convert_to_tensor(inputs)
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = loss_fn(model(x, training=training))
    grads = tape.gradient(loss, [x] + variables)
    return loss, grads[0], grads[1:]


def _torch(model, inputs, loss_fn, training):
    import torch

    parameters = [v.value for v in model.trainable_variables]
    device = parameters[0].device if parameters else None
    x = torch.tensor(np.asarray(inputs), device=device, requires_grad=True)
    loss = loss_fn(model(x, training=training))
    grads = torch.autograd.grad(loss, [x] + parameters, allow_unused=True)
    return loss.detach(), grads[0], grads[1:]
