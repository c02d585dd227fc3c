"""`Dense` with the bias fused into the matmul on PyTorch."""

import keras

from keras_vitnorm.backend_ops import linear


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class FusedDense(keras.layers.Dense):
    """`keras.layers.Dense` whose unquantized call is one fused matmul plus bias.

    The same weights, names, arguments, LoRA and quantization as Keras' `Dense`
    (a quantized layer takes Keras' quantized path, which does not reach `call`).
    Only the unquantized forward changes, and only on PyTorch: there
    `keras.ops.matmul` plus `keras.ops.add` runs the bias add as a second pass,
    while `torch.nn.functional.linear` fuses it (see `backend_ops.linear`; 11%
    of an S/16 CPU inference step, measured with `benchmarks/bench_ab.py`,
    docs/performance.md). On JAX and TensorFlow the computation is Keras' own.

    Example:
    >>> layer = FusedDense(8)
    >>> y = layer(keras.ops.ones((2, 5, 4)))
    """

    def call(self, inputs, training=None):
        x = linear(inputs, self.kernel, self.bias)
        if self.activation is not None:
            x = self.activation(x)
        return x
