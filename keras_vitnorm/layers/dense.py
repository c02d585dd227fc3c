"""`Dense` whose forward pass is `keras_vitnorm.ops.linear`."""

import keras

from keras_vitnorm.ops import linear


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class FusedDense(keras.layers.Dense):
    """`keras.layers.Dense` whose unquantized call is `keras_vitnorm.ops.linear`.

    The same weights, names, arguments, LoRA and quantization as Keras' `Dense` (a
    quantized layer takes Keras' quantized path, which does not reach `call`). Only
    the unquantized forward differs: `linear` computes `x @ kernel + bias` as one
    fused matmul where its fast path applies (PyTorch), Keras' matmul and add
    elsewhere.

    Example:
    >>> layer = FusedDense(8)
    >>> y = layer(keras.ops.ones((2, 5, 4)))
    """

    def call(self, inputs, training=None):
        x = linear(inputs, self.kernel, self.bias)
        if self.activation is not None:
            x = self.activation(x)
        return x
