"""Pooling of the token sequence to one feature vector."""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class ClassTokenPooling(keras.layers.Layer):
    """The class token `x[:, 0]` of `(batch, tokens, width)`; a registered layer for safe mode.

    Example:
    >>> pooled = ClassTokenPooling()(keras.random.normal((2, 17, 32)))  # (2, 32)
    """

    def call(self, x):
        # A slice, not `x[:, 0]`: with an open batch size JAX makes that a dynamic
        # gather, which the TFLite converter cannot convert.
        token = ops.slice(x, (0, 0, 0), (ops.shape(x)[0], 1, ops.shape(x)[2]))
        return ops.squeeze(token, axis=1)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[-1])
