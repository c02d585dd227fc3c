"""Multi-head self-attention with the normalization hooks of QK-norm, NormFormer and Sub-LN."""

import math

import keras
from keras import ops

from keras_vitnorm.backend_ops import jax_cudnn_attention_fits
from keras_vitnorm.backend_ops import jax_or_tensorflow_on_cpu
from keras_vitnorm.backend_ops import jax_padded_attention
from keras_vitnorm.backend_ops import linear
from keras_vitnorm.backend_ops import torch_attention
from keras_vitnorm.layers._calls import call_sublayer
from keras_vitnorm.layers._validation import check_bool
from keras_vitnorm.layers._validation import check_choice
from keras_vitnorm.layers._validation import check_positive_float
from keras_vitnorm.layers._validation import check_positive_int
from keras_vitnorm.layers._validation import check_rate
from keras_vitnorm.layers.dense import FusedDense
from keras_vitnorm.layers.initializers import FusedKernelInitializer
from keras_vitnorm.layers.initializers import scale_variable
from keras_vitnorm.layers.normalization import NORM_TYPES
from keras_vitnorm.layers.normalization import make_norm

#: Norm types offered for QK-norm: each normalizes one head's query or key vector
#: of one token on its own. BatchNorm (statistics over batch and tokens, shared by
#: the heads) and GroupNorm (over tokens and channel groups) would not.
QK_NORM_TYPES = ("layernorm", "rmsnorm", "dyt", "identity")


def check_qk_norm(norm):
    """Raises a `ValueError` unless `norm` can normalize q and k per head and token."""
    check_choice("norm", norm, NORM_TYPES)
    if norm not in QK_NORM_TYPES:
        raise ValueError(
            f"qk_norm normalizes each head's query and key of each token on its own, "
            f"which norm={norm!r} does not (its statistics span "
            f"{'the batch, the tokens and the heads' if norm == 'batchnorm' else 'the tokens'}). "
            f"QK-norm is offered with {', '.join(map(repr, QK_NORM_TYPES))}; "
            "use one of them or qk_norm=False."
        )
    return norm


def _odd_tokens_in_training(q, training):
    """Whether JAX's cuDNN attention would reject q's token count: training with an odd count."""
    return bool(training) and q.shape[1] % 2 == 1


def _tensorflow_float16(q):
    """Whether Keras' TensorFlow attention would take float16 logits (which overflow)."""
    return keras.backend.backend() == "tensorflow" and keras.backend.standardize_dtype(q.dtype) == "float16"


def keras_attention(q, k, v, training=None):
    """`keras.ops.dot_product_attention(q, k, v)`, asking for XLA's attention where JAX rejects cuDNN's.

    On a GPU under JAX, Keras picks cuDNN flash attention from a check that
    passes, but JAX's own check at training time rejects an odd token count
    (197 for a ViT with a class token: "Unsupported sequence length Q 197, KV
    197", jax 0.11). Keras then logs that error with a full traceback at every
    trace and falls back to XLA's attention. There this asks for XLA's attention
    directly (`flash_attention=False`): the same computation, no traceback in
    the log. Everywhere else Keras chooses (`flash_attention=None`).
    """
    jax_rejects_cudnn = keras.backend.backend() == "jax" and _odd_tokens_in_training(q, training)
    flash_attention = False if jax_rejects_cudnn else None
    return ops.dot_product_attention(q, k, v, flash_attention=flash_attention)


def attend(q, k, v, training=None):
    """Softmax attention over `(batch, tokens, heads, head_dim)` q, k and v.

    The same computation in the form measured fastest on each backend
    (`benchmarks/bench_ab.py --changes attend` for S/16 steps at batch 16 on a
    CPU, an A/B of B/16 training steps on an H100; docs/performance.md):

    - JAX and TensorFlow on a CPU (no GPU or TPU), `heads_first_attention`:
      training steps 6 to 7% faster on both, JAX inference 8 to 12%; also
      TensorFlow with float16 inputs on any device, whose own attention
      computes float16 logits that overflow;
    - PyTorch, `backend_ops.torch_attention`, without Keras' copies of q, k and
      v and with PyTorch's own choice of kernel: on the CPU training 5% faster
      and inference 4%; on an H100 training steps 6 to 7% shorter (two A/B
      runs), inference steps 1.00 and 0.80 of Keras' form's time;
    - JAX on a GPU, training with an odd token count where cuDNN's attention
      fits (`backend_ops.jax_cudnn_attention_fits`),
      `backend_ops.jax_padded_attention`: cuDNN's attention on tokens padded to
      a multiple of 8, where Keras would run XLA's: training steps 23 to 24%
      shorter on an H100 (B/16, bfloat16);
    - elsewhere, `keras_attention` (`keras.ops.dot_product_attention`).
    """
    if jax_or_tensorflow_on_cpu() or _tensorflow_float16(q):
        return heads_first_attention(q, k, v)
    if keras.backend.backend() == "torch" and q.dtype == k.dtype == v.dtype:
        return torch_attention(q, k, v)
    if _odd_tokens_in_training(q, training) and jax_cudnn_attention_fits(q, k, v):
        return jax_padded_attention(q, k, v)
    return keras_attention(q, k, v, training)


def heads_first_attention(q, k, v):
    """`keras.ops.dot_product_attention(q, k, v)` written out with heads before tokens.

    Why it exists: Keras' attention on JAX (`jax.nn.dot_product_attention`) and on
    TensorFlow contracts q and k in their `(batch, tokens, heads, head_dim)`
    layout and scales the `tokens x tokens` logits. Here q, k and v move to
    `(batch, heads, tokens, head_dim)` first, the scale goes on q (a tensor
    `head_dim / tokens` the size of the logits), and the result moves back.
    On a CPU, JAX (XLA) and TensorFlow (its graph kernels, which Keras uses
    there instead of XLA) run this form faster (see `attend`). The softmax runs in
    float32 at least, as in Keras and JAX. Same inputs and output as
    `keras.ops.dot_product_attention` (tested, values and gradients).

    With float16 q and k the logits are computed in float32: a logit is a sum
    of `head_dim` products and passes float16's 65504 once q and k reach a few
    hundred (a BatchNorm model in inference, whose moving statistics do not
    bound each token), which made the softmax NaN. PyTorch's attention and
    JAX's accumulate these logits in float32 too.
    """
    q, k, v = (ops.transpose(t, (0, 2, 1, 3)) for t in (q, k, v))
    if keras.backend.standardize_dtype(q.dtype) == "float16":
        q, k = ops.cast(q, "float32"), ops.cast(k, "float32")
    q = q * ops.cast(1.0 / math.sqrt(q.shape[-1]), q.dtype)
    logits = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2)))
    softmax_dtype = keras.backend.result_type(logits.dtype, "float32")
    probs = ops.cast(ops.softmax(ops.cast(logits, softmax_dtype), axis=-1), v.dtype)
    return ops.transpose(ops.matmul(probs, v), (0, 2, 1, 3))


# Backends on which q, k and v come from three matmuls on column slices of the fused
# qkv kernel instead of one matmul whose output is sliced (see `_query_key_value`).
_SPLIT_QKV_BACKENDS = ("tensorflow",)


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class MultiHeadSelfAttention(keras.layers.Layer):
    """Multi-head self-attention over `(batch, tokens, width)` inputs.

    One fused `qkv` projection (kernel `(width, 3 * width)`, columns ordered
    `[q | k | v]`, each head-major like timm), attention through `attend`
    (the fastest measured form of `keras.ops.dot_product_attention` on each
    backend and device), then the `out` projection.

    Initialization follows big_vision: the query, key and value kernels are
    each Xavier-uniform on their own `(width, width)` shape (limit
    `sqrt(6 / (2 * width))`, `FusedKernelInitializer`), the out kernel
    Xavier-uniform on `(width, width)`, biases zero.

    Args:
        num_heads: int. `width` must be divisible by it.
        qkv_bias: bool, default `True`.
        qk_norm: str or None, default `None`. A norm type of `QK_NORM_TYPES`
            applied to each head's q and k of each token over the head
            dimension (weights shared by all heads), before the
            `1/sqrt(head_dim)` scaling (ViT-22B).
        head_scale: bool, default `False`. NormFormer per-head learnable gains
            (init 1), applied to each head's output before the out projection
            (the paper's form, not fairseq's post-projection one).
        inner_norm: str or None, default `None`. A `norm` type applied to the
            concatenated heads before the out projection (Sub-LN / Magneto).
        norm_epsilon: float, default `1e-6`, for `qk_norm` and `inner_norm`.
        norm_groups: int, default `32`, for `groupnorm`.
        init_scale: float, default `1.0`. Multiplies the initial value and out
            projection weights (DeepNorm beta, Sub-LN gamma).
        dropout: float, default `0.0`. Dropout after the out projection.
        **kwargs: base layer keyword arguments.

    Example:
    >>> attention = MultiHeadSelfAttention(num_heads=4)
    >>> y = attention(keras.random.normal((2, 17, 32)))

    Reference:
    - [Vaswani et al., 2017](https://arxiv.org/abs/1706.03762)
    - [Shleifer et al., NormFormer, 2021](https://arxiv.org/abs/2110.09456)
    - [Wang et al., Foundation Transformers (Sub-LN), 2022](https://arxiv.org/abs/2210.06423)
    """

    def __init__(
        self,
        num_heads,
        qkv_bias=True,
        qk_norm=None,
        head_scale=False,
        inner_norm=None,
        norm_epsilon=1e-6,
        norm_groups=32,
        init_scale=1.0,
        dropout=0.0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_positive_int("num_heads", num_heads)
        check_bool("qkv_bias", qkv_bias)
        if qk_norm is not None:
            check_qk_norm(qk_norm)
        check_bool("head_scale", head_scale)
        if inner_norm is not None:
            check_choice("inner_norm", inner_norm, NORM_TYPES)
        check_positive_float("norm_epsilon", norm_epsilon)
        check_positive_int("norm_groups", norm_groups)
        check_positive_float("init_scale", init_scale)
        check_rate("dropout", dropout)
        self.num_heads = num_heads
        self.qkv_bias = qkv_bias
        self.qk_norm = qk_norm
        self.head_scale = head_scale
        self.inner_norm = inner_norm
        self.norm_epsilon = norm_epsilon
        self.norm_groups = norm_groups
        self.init_scale = init_scale
        self.dropout = dropout

    def _norm(self, norm, name):
        return make_norm(
            norm,
            epsilon=self.norm_epsilon,
            groups=self.norm_groups,
            name=name,
            dtype=self.dtype_policy,
        )

    def build(self, input_shape):
        width = input_shape[-1]
        if width % self.num_heads:
            raise ValueError(
                f"width={width} is not divisible by num_heads={self.num_heads}. "
                f"Pick num_heads among the divisors of {width}."
            )
        self.head_dim = width // self.num_heads
        self.qkv = FusedDense(
            3 * width,
            use_bias=self.qkv_bias,
            kernel_initializer=FusedKernelInitializer("glorot_uniform", parts=3),
            name="qkv",
            dtype=self.dtype_policy,
        )
        self.qkv.build(input_shape)
        self.out = FusedDense(
            width, kernel_initializer="glorot_uniform", name="out", dtype=self.dtype_policy
        )
        self.out.build(input_shape)
        if self.init_scale != 1.0:
            # Only the value third of the fused qkv kernel (and bias) is scaled.
            segments = [1.0, 1.0, self.init_scale]
            scale_variable(self.qkv.kernel, self.init_scale, segments=segments)
            if self.qkv_bias:
                scale_variable(self.qkv.bias, self.init_scale, segments=segments)
            scale_variable(self.out.kernel, self.init_scale)
            scale_variable(self.out.bias, self.init_scale)
        self.q_norm = self.k_norm = None
        if self.qk_norm is not None:
            head_shape = (None, None, self.num_heads, self.head_dim)
            self.q_norm = self._norm(self.qk_norm, "q_norm")
            self.k_norm = self._norm(self.qk_norm, "k_norm")
            self.q_norm.build(head_shape)
            self.k_norm.build(head_shape)
        self.head_gains = None
        if self.head_scale:
            self.head_gains = self.add_weight(
                name="head_scale", shape=(self.num_heads, 1), initializer="ones"
            )
        self.inner_norm_layer = None
        if self.inner_norm is not None:
            self.inner_norm_layer = self._norm(self.inner_norm, "inner_norm")
            self.inner_norm_layer.build(input_shape)
        self.dropout_layer = keras.layers.Dropout(self.dropout, dtype=self.dtype_policy)

    def call(self, x, training=None):
        num_tokens, width = x.shape[1], x.shape[2]
        q, k, v = self._query_key_value(x, training)
        if self.q_norm is not None:
            q = call_sublayer(self, self.q_norm, q, training=training)
            k = call_sublayer(self, self.k_norm, k, training=training)
        y = attend(q, k, v, training=training)
        if self.head_gains is not None:
            y = y * ops.cast(self.head_gains, y.dtype)
        y = ops.reshape(y, (-1, num_tokens, width))
        if self.inner_norm_layer is not None:
            y = call_sublayer(self, self.inner_norm_layer, y, training=training)
        y = call_sublayer(self, self.out, y, training=training)
        # A rate of 0 is the identity: skip the layer call (Keras' per-call cost).
        return call_sublayer(self, self.dropout_layer, y, training=training) if self.dropout_layer.rate else y

    def _query_key_value(self, x, training=None):
        """q, k and v, each `(batch, tokens, heads, head_dim)`, from the fused `qkv` weights.

        One matmul whose output is sliced, except on the backends in
        `_SPLIT_QKV_BACKENDS` (TensorFlow), where q, k and v come from three
        matmuls on the column thirds of the same kernel and bias (`ops.split`,
        whose gradient is one concatenation). The weights and the
        result are the same (tested). Timed alternately on S/16 CPU training steps
        (`benchmarks/bench_ab.py --changes split_qkv`), the split form was 2 to 9%
        faster on TensorFlow, 1% on JAX and 13% slower on PyTorch
        (docs/performance.md). A quantized `qkv` always takes the fused path,
        through Keras' quantized `Dense`.
        """
        num_tokens = x.shape[1]
        if keras.backend.backend() in _SPLIT_QKV_BACKENDS and self.qkv.quantization_mode is None:
            # `ops.split`, not three slices: its gradient is one concatenation,
            # where slices' gradients are three zero-padded copies and a sum.
            kernels = ops.split(ops.convert_to_tensor(self.qkv.kernel), 3, axis=1)
            biases = [None] * 3
            if self.qkv.bias is not None:
                biases = ops.split(ops.convert_to_tensor(self.qkv.bias), 3)
            return [
                ops.reshape(linear(x, kernel, bias), (-1, num_tokens, self.num_heads, self.head_dim))
                for kernel, bias in zip(kernels, biases)
            ]
        qkv = call_sublayer(self, self.qkv, x, training=training)
        qkv = ops.reshape(qkv, (-1, num_tokens, 3, self.num_heads, self.head_dim))
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "qkv_bias": self.qkv_bias,
                "qk_norm": self.qk_norm,
                "head_scale": self.head_scale,
                "inner_norm": self.inner_norm,
                "norm_epsilon": self.norm_epsilon,
                "norm_groups": self.norm_groups,
                "init_scale": self.init_scale,
                "dropout": self.dropout,
            }
        )
        return config
