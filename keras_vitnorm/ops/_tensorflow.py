"""TensorFlow forms of the ops (imported only under the TensorFlow backend).

On a CPU, Keras runs TensorFlow's training step as a graph of TensorFlow kernels
without XLA (`jit_compile="auto"`), so each element-wise op is its own pass over its
tensor and autodiff keeps every intermediate. The gradients written out here need
fewer passes; they match autodiff (tests/test_ops.py) and finite differences
(tests/test_formulas.py).
"""

import tensorflow as tf
from keras import ops

_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


def on_cpu():
    return not (tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("TPU"))


@ops.custom_gradient
def gelu(x):
    """`0.5 x (1 + erf(x / sqrt 2))` with the derivative `Phi(x) + x phi(x)` written out.

    Keras' `gelu(approximate=False)` computes the `erfc` form, which XLA expands
    into two polynomial branches with an `exp`; the backward pass here keeps
    `Phi(x)` from the forward pass and adds `x phi(x)`.
    """
    cdf = 0.5 * (1.0 + ops.erf(x * _SQRT_HALF))

    def gradient(*args, upstream=None):
        if upstream is None:
            (upstream,) = args
        pdf = ops.exp(-0.5 * ops.square(x)) * _INV_SQRT_2PI
        return upstream * (cdf + x * pdf)

    return x * cdf, gradient


def rms_normalization(x, scale, epsilon):
    """RMSNorm over the last axis with its backward pass written out.

    The closed-form gradient needs only the normalized input and the inverse RMS:
    `dx = r * (g*s - xhat * mean(g*s*xhat))`, `dscale = sum(g * xhat)`.
    """

    @ops.custom_gradient
    def normalize(x, scale):
        inverse_rms = ops.rsqrt(ops.mean(ops.square(x), axis=-1, keepdims=True) + epsilon)
        normalized = x * inverse_rms

        def gradient(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            width = x.shape[-1]
            scale_grad = ops.sum(ops.reshape(upstream * normalized, (-1, width)), axis=0)
            scaled = upstream * scale
            mean_term = ops.mean(scaled * normalized, axis=-1, keepdims=True)
            return inverse_rms * (scaled - normalized * mean_term), scale_grad

        return normalized * scale, gradient

    return normalize(x, scale)
