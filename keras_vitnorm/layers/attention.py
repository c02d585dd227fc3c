"""Multi-head self-attention with the normalization hooks of QK-norm, NormFormer and Sub-LN."""

import keras
from keras import ops

from keras_vitnorm.choices import NORM_TYPES
from keras_vitnorm.choices import QK_NORM_TYPES
from keras_vitnorm.validation import check_bool
from keras_vitnorm.validation import check_positive_float
from keras_vitnorm.validation import check_positive_int
from keras_vitnorm.validation import check_rate
from keras_vitnorm.layers.dense import FusedDense
from keras_vitnorm.layers.initializers import FusedKernelInitializer
from keras_vitnorm.layers.initializers import ScaledInitializer
from keras_vitnorm.layers.normalization import check_norm
from keras_vitnorm.layers.normalization import check_norm_options
from keras_vitnorm.layers.normalization import make_norm
from keras_vitnorm.ops import attention
from keras_vitnorm.ops import qkv_projection
from keras_vitnorm.ops import split_heads


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class MultiHeadSelfAttention(keras.layers.Layer):
    """Multi-head self-attention over `(batch, tokens, width)` inputs.

    One fused `qkv` projection (columns `[q | k | v]`, each head-major like timm), softmax
    attention, then the `out` projection; big_vision's init (docs/normalization.md).

    Args:
        num_heads: int. `width` must be divisible by it.
        qkv_bias: bool, default `True`.
        qk_norm: str or None, default `None`. A norm of `QK_NORM_TYPES` (or a registered one)
            on each head's q and k, shared by all heads, before the scaling (ViT-22B).
        head_scale: bool, default `False`. NormFormer per-head gains before the out projection.
        inner_norm: str or None, default `None`. Sub-LN's norm before the out projection.
        norm_epsilon: float, default `1e-6`; norm_groups: int, default `32`.
        init_scale: float, default `1.0`. Multiplies the initial value and out kernels
            (DeepNorm beta, Sub-LN gamma).
        dropout: float, default `0.0`. Dropout after the out projection.
        weight_standardization: bool, default `False`.
        **kwargs: base layer keyword arguments.

    Example:
    >>> attention = MultiHeadSelfAttention(num_heads=4)
    >>> y = attention(keras.random.normal((2, 17, 32)))

    Reference:
    - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762)
    - [Shleifer et al., NormFormer, 2021](https://arxiv.org/abs/2110.09456)
    - [Wang et al., Foundation Transformers (Sub-LN), 2022](https://arxiv.org/abs/2210.06423)
    """

    #: The constructor arguments, in `get_config`'s order.
    CONFIG_KEYS = ("num_heads", "qkv_bias", "qk_norm", "head_scale", "inner_norm", "norm_epsilon",
                   "norm_groups", "init_scale", "dropout", "weight_standardization")

    def __init__(self, num_heads, qkv_bias=True, qk_norm=None, head_scale=False, inner_norm=None,
                 norm_epsilon=1e-6, norm_groups=32, init_scale=1.0, dropout=0.0,
                 weight_standardization=False, **kwargs):
        super().__init__(**kwargs)
        arguments = {key: value for key, value in locals().items() if key in self.CONFIG_KEYS}
        self.check_arguments(**arguments)
        for key, value in arguments.items():
            setattr(self, key, value)

    @staticmethod
    def check_arguments(num_heads, qkv_bias=True, qk_norm=None, head_scale=False, inner_norm=None,
                        norm_epsilon=1e-6, norm_groups=32, init_scale=1.0, dropout=0.0,
                        weight_standardization=False):
        """Raises a `ValueError` naming the first bad argument of the constructor."""
        check_positive_int("num_heads", num_heads)
        check_bool("qkv_bias", qkv_bias)
        if qk_norm is not None:
            check_norm("norm", qk_norm)
        if qk_norm in NORM_TYPES and qk_norm not in QK_NORM_TYPES:
            raise ValueError(
                f"qk_norm normalizes each head's query and key of each token on its own, "
                f"which norm={qk_norm!r} does not (its statistics span the "
                f"{'batch, the tokens and the heads' if qk_norm == 'batchnorm' else 'tokens'}). "
                f"QK-norm is offered with {', '.join(map(repr, QK_NORM_TYPES))}; "
                "use one of them or qk_norm=False.")
        check_bool("head_scale", head_scale)
        if inner_norm is not None:
            check_norm("inner_norm", inner_norm)
        check_norm_options(norm_epsilon, norm_groups, prefix="norm_")
        check_positive_float("init_scale", init_scale)
        check_rate("dropout", dropout)
        check_bool("weight_standardization", weight_standardization)

    def _norm(self, norm, name, shape):
        layer = make_norm(norm, epsilon=self.norm_epsilon, groups=self.norm_groups, name=name,
                          dtype=self.dtype_policy)
        layer.build(shape)
        return layer

    def build(self, input_shape):
        width = input_shape[-1]
        if width % self.num_heads:
            raise ValueError(
                f"width={width} is not divisible by num_heads={self.num_heads}. "
                f"Pick num_heads among the divisors of {width}.")
        self.head_dim = width // self.num_heads
        qkv_initializer = FusedKernelInitializer("glorot_uniform", parts=3)
        if self.init_scale != 1.0:  # the value third alone; the biases start at zero
            qkv_initializer = ScaledInitializer(qkv_initializer, [1.0, 1.0, self.init_scale])
        self.qkv = FusedDense(3 * width, use_bias=self.qkv_bias, kernel_initializer=qkv_initializer,
                              name="qkv", dtype=self.dtype_policy,
                              weight_standardization=self.weight_standardization)
        self.qkv.build(input_shape)
        out_initializer = "glorot_uniform"
        if self.init_scale != 1.0:
            out_initializer = ScaledInitializer(out_initializer, self.init_scale)
        self.out = FusedDense(width, kernel_initializer=out_initializer, name="out",
                              dtype=self.dtype_policy,
                              weight_standardization=self.weight_standardization)
        self.out.build(input_shape)
        self.q_norm = self.k_norm = None
        if self.qk_norm is not None:
            head_shape = (None, None, self.num_heads, self.head_dim)
            self.q_norm = self._norm(self.qk_norm, "q_norm", head_shape)
            self.k_norm = self._norm(self.qk_norm, "k_norm", head_shape)
        self.head_gains = None
        if self.head_scale:
            self.head_gains = self.add_weight(name="head_scale", shape=(self.num_heads, 1),
                                              initializer="ones")
        self.inner_norm_layer = None
        if self.inner_norm is not None:
            self.inner_norm_layer = self._norm(self.inner_norm, "inner_norm", input_shape)
        self.dropout_layer = keras.layers.Dropout(self.dropout, dtype=self.dtype_policy)

    def call(self, x, training=None):
        num_tokens, width = x.shape[1], x.shape[2]
        # The scope names the fused projection in a profile, as the `out` layer's call does.
        with keras.name_scope("qkv"):
            if self.qkv.quantization_mode is None:
                q, k, v = qkv_projection(x, self.qkv.forward_kernel, self.qkv.bias, self.num_heads)
            else:  # Keras' quantized Dense computes the projection
                q, k, v = split_heads(self.qkv(x), self.num_heads)
        if self.q_norm is not None:
            q = self.q_norm(q, training=training)
            k = self.k_norm(k, training=training)
        y = attention(q, k, v)
        if self.head_gains is not None:
            y = y * ops.cast(self.head_gains, y.dtype)
        y = ops.reshape(y, (-1, num_tokens, width))
        if self.inner_norm_layer is not None:
            y = self.inner_norm_layer(y, training=training)
        y = self.out(y, training=training)
        # A rate of 0 is the identity: no layer call (Keras' per-call cost is eager on PyTorch).
        return self.dropout_layer(y, training=training) if self.dropout else y

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), **{key: getattr(self, key) for key in self.CONFIG_KEYS}}
