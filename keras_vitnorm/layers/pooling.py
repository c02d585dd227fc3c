"""Pooling of the token sequence to one feature vector."""

import keras


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class ClassTokenPooling(keras.layers.Layer):
    """The class token of a `(batch, tokens, width)` sequence: `x[:, 0]`.

    What a ViT with a class token classifies from. A registered layer rather than a
    `keras.layers.Lambda`, so that a saved model that contains it (a backbone from
    `ViT.backbone()`) loads in Keras' safe mode.

    Args:
        **kwargs: base layer keyword arguments.

    Example:
    >>> pooled = ClassTokenPooling()(keras.random.normal((2, 17, 32)))  # (2, 32)
    """

    def call(self, x):
        return x[:, 0]

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[-1])
