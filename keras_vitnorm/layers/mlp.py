"""The transformer MLP: Dense, GELU, optional mid norm, Dense."""

import keras
from keras import ops

from keras_vitnorm.layers._calls import call_sublayer
from keras_vitnorm.layers._validation import check_choice
from keras_vitnorm.layers._validation import check_positive_float
from keras_vitnorm.layers._validation import check_positive_int
from keras_vitnorm.layers._validation import check_rate
from keras_vitnorm.layers.dense import FusedDense
from keras_vitnorm.layers.initializers import scale_variable
from keras_vitnorm.layers.normalization import NORM_TYPES
from keras_vitnorm.layers.normalization import make_norm


def gelu_exact(x):
    """Exact GELU, `x * Phi(x)`; on TensorFlow as `0.5 * x * (1 + erf(x / sqrt(2)))`.

    Why it exists: Keras' `gelu(approximate=False)` computes `0.5 * x * erfc(-x /
    sqrt(2))`. XLA expands float32 `erfc` into two polynomial branches with an
    `exp`, against one rational polynomial for `erf`: in the compiled gradient of
    an S/16 MLP the element-wise part took 17 ms with `erf` against 31 ms with
    `erfc` (JAX, CPU; docs/performance.md). The two forms agree within float32
    round-off (tested). TensorFlow takes the `erf` form, with its backward pass
    written out (`_gelu_erf_closed_form_gradient`). JAX keeps Keras' `gelu`:
    its `erf` lowers to a StableHLO composite that TensorFlow cannot load, which
    would break `model.export` to a SavedModel. PyTorch keeps Keras' `gelu`, a
    fused kernel that computes the `erf` form.

    Args:
        x: tensor.

    Returns:
        Tensor of the dtype of `x`.
    """
    if keras.backend.backend() == "tensorflow":
        return _gelu_erf_closed_form_gradient(x)
    return keras.activations.gelu(x, approximate=False)


_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


def gelu_erf(x):
    """`0.5 * x * (1 + erf(x / sqrt(2)))`, differentiated by autodiff."""
    return 0.5 * x * (1.0 + ops.erf(x * _SQRT_HALF))


@ops.custom_gradient
def _gelu_erf_closed_form_gradient(x):
    """`gelu_erf` with its derivative written out: `Phi(x) + x * phi(x)`.

    Why it exists: TensorFlow on a CPU runs Keras' training step as a graph
    without XLA (Keras' `jit_compile="auto"` turns XLA off on CPU-only
    machines), so every element-wise op is its own pass over the MLP's
    `(batch x tokens, 4 x width)` activations. Autodiff of `gelu_erf` chains
    the derivatives of each product and of `erf`; here the backward pass keeps
    `Phi(x)` from the forward pass and adds `x * phi(x)`. Same values as autodiff
    (tested); timed in docs/performance.md (`benchmarks/bench_ab.py --changes
    gelu_grad`).
    """
    cdf = 0.5 * (1.0 + ops.erf(x * _SQRT_HALF))

    def gradient(*args, upstream=None):
        if upstream is None:
            (upstream,) = args
        pdf = ops.exp(-0.5 * ops.square(x)) * _INV_SQRT_2PI
        return upstream * (cdf + x * pdf)

    return x * cdf, gradient


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class MLP(keras.layers.Layer):
    """Two-layer MLP `fc2(N(gelu(fc1(x))))` of a transformer block.

    Args:
        hidden_dim: int. Width of the hidden layer.
        mid_norm: str or None, default `None`. A `norm` type applied after the
            activation and before `fc2` (NormFormer and Sub-LN).
        norm_epsilon: float, default `1e-6`.
        norm_groups: int, default `32`, for `groupnorm`.
        init_scale: float, default `1.0`. Multiplies the initial `fc1` and `fc2`
            weights (DeepNorm beta, Sub-LN gamma).
        dropout: float, default `0.0`. Dropout after the activation and after fc2.
        **kwargs: base layer keyword arguments.

    GELU is the exact (erf) form, as in timm and Hugging Face ViT. Kernels are
    Xavier-uniform and biases `N(0, 1e-6)`, as in big_vision.

    Example:
    >>> mlp = MLP(hidden_dim=128, mid_norm="layernorm")
    >>> y = mlp(keras.random.normal((2, 17, 32)))
    """

    def __init__(
        self,
        hidden_dim,
        mid_norm=None,
        norm_epsilon=1e-6,
        norm_groups=32,
        init_scale=1.0,
        dropout=0.0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_positive_int("hidden_dim", hidden_dim)
        if mid_norm is not None:
            check_choice("mid_norm", mid_norm, NORM_TYPES)
        check_positive_float("norm_epsilon", norm_epsilon)
        check_positive_int("norm_groups", norm_groups)
        check_positive_float("init_scale", init_scale)
        check_rate("dropout", dropout)
        self.hidden_dim = hidden_dim
        self.mid_norm = mid_norm
        self.norm_epsilon = norm_epsilon
        self.norm_groups = norm_groups
        self.init_scale = init_scale
        self.dropout = dropout

    def build(self, input_shape):
        width = input_shape[-1]
        hidden_shape = (*input_shape[:-1], self.hidden_dim)
        bias_init = keras.initializers.RandomNormal(stddev=1e-6)
        self.fc1 = FusedDense(
            self.hidden_dim,
            kernel_initializer="glorot_uniform",
            bias_initializer=bias_init,
            name="fc1",
            dtype=self.dtype_policy,
        )
        self.fc1.build(input_shape)
        self.fc2 = FusedDense(
            width,
            kernel_initializer="glorot_uniform",
            bias_initializer=bias_init,
            name="fc2",
            dtype=self.dtype_policy,
        )
        self.fc2.build(hidden_shape)
        if self.init_scale != 1.0:
            for variable in (self.fc1.kernel, self.fc1.bias, self.fc2.kernel, self.fc2.bias):
                scale_variable(variable, self.init_scale)
        self.mid_norm_layer = None
        if self.mid_norm is not None:
            self.mid_norm_layer = make_norm(
                self.mid_norm,
                epsilon=self.norm_epsilon,
                groups=self.norm_groups,
                name="mid_norm",
                dtype=self.dtype_policy,
            )
            self.mid_norm_layer.build(hidden_shape)
        self.dropout_layer = keras.layers.Dropout(self.dropout, dtype=self.dtype_policy)

    def call(self, x, training=None):
        x = gelu_exact(call_sublayer(self, self.fc1, x, training=training))
        if self.mid_norm_layer is not None:
            x = call_sublayer(self, self.mid_norm_layer, x, training=training)
        if self.dropout_layer.rate:  # a rate of 0 is the identity: no layer call
            x = call_sublayer(self, self.dropout_layer, x, training=training)
        x = call_sublayer(self, self.fc2, x, training=training)
        return call_sublayer(self, self.dropout_layer, x, training=training) if self.dropout_layer.rate else x

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "hidden_dim": self.hidden_dim,
                "mid_norm": self.mid_norm,
                "norm_epsilon": self.norm_epsilon,
                "norm_groups": self.norm_groups,
                "init_scale": self.init_scale,
                "dropout": self.dropout,
            }
        )
        return config
