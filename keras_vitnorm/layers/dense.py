"""`Dense` and `Conv2D` with an optionally weight-standardized kernel."""

import keras

from keras_vitnorm.validation import check_bool
from keras_vitnorm.ops import linear
from keras_vitnorm.ops import standardize_kernel


def _refuse_quantization(layer):
    if layer.weight_standardization:
        raise ValueError(
            f"{layer.name}: a weight-standardized layer cannot be quantized (the quantized "
            "kernel would skip the standardization). Build the model with "
            "weight_standardization=False to quantize it.")


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class FusedDense(keras.layers.Dense):
    """`keras.layers.Dense` whose unquantized call is `keras_vitnorm.ops.linear`.

    Same weights, names, arguments, LoRA and quantization as Keras' `Dense`.

    Args:
        weight_standardization: bool, default `False`. Standardize the kernel in the forward
            pass (`keras_vitnorm.ops.standardize_kernel`); the stored kernel is the raw one.
        **kwargs: `keras.layers.Dense` arguments.

    Example:
    >>> y = FusedDense(8)(keras.ops.ones((2, 5, 4)))
    """

    def __init__(self, *args, weight_standardization=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.weight_standardization = check_bool("weight_standardization", weight_standardization)

    @property
    def forward_kernel(self):
        """The kernel the forward pass multiplies by (standardized if asked; LoRA included)."""
        kernel = self.kernel
        return standardize_kernel(kernel) if self.weight_standardization else kernel

    def call(self, inputs, training=None):
        x = linear(inputs, self.forward_kernel, self.bias)
        if self.activation is not None:
            x = self.activation(x)
        return x

    def quantize(self, mode=None, type_check=True, config=None):
        _refuse_quantization(self)
        # Keras' Dense refuses its subclasses by default (their `call` might not be its
        # own); a quantized FusedDense runs Keras' quantized call, so the check is moot.
        return super().quantize(mode, type_check=False, config=config)

    def get_config(self):
        return {**super().get_config(), "weight_standardization": self.weight_standardization}


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class StandardizedConv2D(keras.layers.Conv2D):
    """`keras.layers.Conv2D` with a standardized kernel in the forward pass (each filter's weights).

    Args:
        weight_standardization: bool, default `True`. `False` is Keras' `Conv2D`.
        **kwargs: `keras.layers.Conv2D` arguments.
    """

    def __init__(self, *args, weight_standardization=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.weight_standardization = check_bool("weight_standardization", weight_standardization)

    def convolution_op(self, inputs, kernel):
        if self.weight_standardization:
            kernel = standardize_kernel(kernel)
        return super().convolution_op(inputs, kernel)

    def quantize(self, *args, **kwargs):
        _refuse_quantization(self)
        return super().quantize(*args, **kwargs)

    def get_config(self):
        return {**super().get_config(), "weight_standardization": self.weight_standardization}
