"""The few tensor operations the layers need beyond `keras.ops`, with their fast paths.

Each op here is written in `keras.ops` and reads like its formula. Where a backend
(and device) runs the same computation measurably faster in another form, the op
takes that form from the backend's module (`_jax`, `_tensorflow`, `_torch`, each
imported only under its backend) while the fast path is switched on
(`keras_vitnorm.ops.switch`: `set_fast_paths`, `fast_paths`, the
`KERAS_VITNORM_FAST_PATHS` environment variable). Values and gradients are the same
either way up to float32 round-off (tests/test_ops.py); docs/performance.md gives
each fast path's measured whole-step gain.

The layers call only this module: no layer asks which backend it runs on.
"""

import functools
import importlib
import math

import keras
from keras import ops

from keras_vitnorm.ops.switch import FAST_PATHS
from keras_vitnorm.ops.switch import fast_path_enabled
from keras_vitnorm.ops.switch import fast_paths
from keras_vitnorm.ops.switch import set_fast_paths

__all__ = [
    "FAST_PATHS", "attention", "backend_name", "fast_path_enabled", "fast_paths",
    "heads_first_attention", "layer_norm", "linear", "qkv_projection", "residual_fence",
    "set_fast_paths", "split_heads", "standardize_kernel",
]


def backend_name():
    """The Keras backend this process computes with (`"jax"`, `"tensorflow"`, `"torch"`)."""
    return keras.backend.backend()


def _import_native():
    module = {"jax": "_jax", "tensorflow": "_tensorflow", "torch": "_torch"}.get(backend_name())
    return None if module is None else importlib.import_module(f"keras_vitnorm.ops.{module}")


# Imported with this module, not at an op's first call: torch.compile, tracing an op,
# cannot trace an import (nor see through a cache around one) and would split the
# compiled graph there.
_NATIVE = _import_native()


def _native():
    """This backend's module of fast forms."""
    if _NATIVE is None:
        raise ValueError(f"keras_vitnorm runs on jax, tensorflow and torch, not {backend_name()!r}.")
    return _NATIVE


def _fast(name, *backends):
    return backend_name() in backends and fast_path_enabled(name)


def _xla_or_graph_on_cpu():
    """JAX or TensorFlow computing on a CPU (no GPU or TPU in use)."""
    return backend_name() in ("jax", "tensorflow") and _on_cpu()


@functools.cache
def _on_cpu():
    return _native().on_cpu()


def layer_norm(x, gamma=None, beta=None, epsilon=1e-6, dtype=None):
    """LayerNorm over the last axis: `(x - mean) / sqrt(var + epsilon) * gamma + beta`.

    `keras.ops.layer_normalization(x, gamma, beta, axis=-1, epsilon=epsilon)`: computed
    in float32 at least (`gamma` and `beta` cast to it) and returned in `x`'s dtype,
    then cast to `dtype` where given (as Keras' `LayerNormalization` returns its
    compute dtype).

    On PyTorch it is the same `torch.nn.functional.layer_norm` and casts that Keras'
    PyTorch backend runs, with the normalized width a Python int: Keras' own op reads
    it from a tensor, which a TorchScript trace (Keras' ONNX export with an open batch
    size) cannot keep a constant, as ONNX's LayerNormalization needs
    (tests/test_deploy.py). A fix, not a fast path: always on.
    """
    if epsilon is None:  # as Keras' op takes it
        epsilon = keras.config.epsilon()
    if backend_name() == "torch":
        return _native().layer_norm(x, gamma, beta, epsilon, dtype)
    y = ops.layer_normalization(x, gamma, beta, axis=-1, epsilon=epsilon)
    return y if dtype is None else ops.cast(y, dtype)


def linear(x, kernel, bias=None):
    """`x @ kernel + bias` over the last axis of `x` (`kernel`: `(in, out)`).

    Fast path `linear` (PyTorch): one `torch.nn.functional.linear`, the bias add fused
    into the matmul.
    """
    x, kernel = ops.convert_to_tensor(x), ops.convert_to_tensor(kernel)
    bias = None if bias is None else ops.convert_to_tensor(bias)
    same_dtype = x.dtype == kernel.dtype and (bias is None or bias.dtype == x.dtype)
    if same_dtype and _fast("linear", "torch"):
        return _native().linear(x, kernel, bias)
    y = ops.matmul(x, kernel)
    return y if bias is None else ops.add(y, bias)


def standardize_kernel(kernel, epsilon=1e-10):
    """Weight standardization: each output unit's weights at mean 0 and variance `1/fan_in`.

    A Keras kernel's last axis indexes the output units and the others their inputs
    (`(in, out)` for a dense layer, `(h, w, in, out)` for a convolution). Each output
    unit's weights are standardized over its fan-in, as Qiao et al. (2019) do, then
    divided by `sqrt(fan_in)`:

        w_hat = (w - mean(w)) / sqrt(var(w) + epsilon) / sqrt(fan_in)

    Qiao et al. follow each standardized convolution with a BatchNorm or GroupNorm,
    which takes out any constant scale; in a transformer the dense layers feed the
    residual stream directly, so the unit is kept at LeCun's initial variance
    (as scaled weight standardization does, Brock et al. 2021), and a layer's output
    keeps the scale of its input. Computed in float32; `epsilon` (default `1e-10`,
    big_transfer's) only guards a constant kernel.
    """
    dtype = keras.backend.standardize_dtype(kernel.dtype)
    w = ops.cast(kernel, "float32")
    axes = tuple(range(len(w.shape) - 1))
    fan_in = math.prod(w.shape[:-1])
    mean = ops.mean(w, axis=axes, keepdims=True)
    variance = ops.var(w, axis=axes, keepdims=True)
    standardized = (w - mean) * ops.rsqrt(variance + epsilon) / math.sqrt(fan_in)
    return ops.cast(standardized, dtype)


def qkv_projection(x, kernel, bias, num_heads):
    """q, k and v, each `(batch, tokens, heads, head_dim)`, from a fused projection.

    `kernel` is `(width, 3 * width)` with columns `[q | k | v]`, each head-major;
    `bias` is `(3 * width,)` or `None`. One `linear` whose output is split.

    Fast path `split_qkv` (TensorFlow): three `linear`s on the column thirds of the
    kernel and bias (`ops.split`, whose gradient is one concatenation).
    """
    tokens = x.shape[1]
    head_dim = kernel.shape[-1] // (3 * num_heads)
    if _fast("split_qkv", "tensorflow"):
        kernels = ops.split(ops.convert_to_tensor(kernel), 3, axis=1)
        biases = [None] * 3 if bias is None else ops.split(ops.convert_to_tensor(bias), 3)
        return [ops.reshape(linear(x, k, b), (-1, tokens, num_heads, head_dim))
                for k, b in zip(kernels, biases)]
    return split_heads(linear(x, kernel, bias), num_heads)


def split_heads(qkv, num_heads):
    """`(batch, tokens, 3 * width)` fused projections to q, k, v `(batch, tokens, heads, head_dim)`.

    `ops.unstack`, not three index selections: on PyTorch the gradient of an
    unstack is one stack of the three, where each selection's gradient is a zero
    tensor of the whole projection's size with its third filled in, and the three are
    then summed (a zero fill, a copy and an add over the fused output per block).
    """
    tokens, fused = qkv.shape[1], qkv.shape[2]
    qkv = ops.reshape(qkv, (-1, tokens, 3, num_heads, fused // (3 * num_heads)))
    q, k, v = ops.unstack(qkv, axis=2)
    return q, k, v


def attention(q, k, v):
    """Softmax attention over `(batch, tokens, heads, head_dim)` q, k and v.

    `keras.ops.dot_product_attention(q, k, v)`, except:

    - float16 q and k on TensorFlow, whose attention would compute float16 logits
      that overflow (a BatchNorm model in inference): `heads_first_attention`,
      which sums them in float32. Always, being a fix, not a fast path.
    - Fast path `attention`: `heads_first_attention` on a CPU under JAX and
      TensorFlow; PyTorch's `scaled_dot_product_attention` on strided views
      (no copies of q, k and v, PyTorch's own choice of kernel); JAX on a GPU with
      an odd token count where cuDNN's attention fits: cuDNN's attention on tokens
      padded to a multiple of 8, masked.
    - JAX with an odd token count (197 for a ViT with a class token at 224 pixels),
      otherwise: XLA's attention asked for directly. JAX's cuDNN attention rejects
      that count wherever it is differentiated, and gradients are taken in inference
      mode too (the gradient-norm probes do), so the mode does not tell; Keras would
      try cuDNN's there and fall back to the same XLA attention after logging a
      traceback.
    - PyTorch under `torch.compile`, otherwise: Keras' attention without its check
      whether FlashAttention fits, which builds a PyTorch object that `torch.compile`
      cannot trace (the compiled graph would split there); PyTorch's attention picks
      its kernel itself.
    """
    q, k, v = (ops.convert_to_tensor(t) for t in (q, k, v))
    backend = backend_name()
    if backend == "tensorflow" and keras.backend.standardize_dtype(q.dtype) == "float16":
        return heads_first_attention(q, k, v)
    odd_tokens_on_jax = backend == "jax" and q.shape[1] % 2 == 1
    if fast_path_enabled("attention"):
        if _xla_or_graph_on_cpu():
            return heads_first_attention(q, k, v)
        if backend == "torch" and q.dtype == k.dtype == v.dtype:
            return _native().attention(q, k, v)
        if odd_tokens_on_jax and _native().cudnn_attention_fits(q, k, v):
            return _native().padded_attention(q, k, v)
    flash_attention = None
    if odd_tokens_on_jax or (backend == "torch" and _native().compiling()):
        flash_attention = False
    return ops.dot_product_attention(q, k, v, flash_attention=flash_attention)


def heads_first_attention(q, k, v):
    """`softmax(q k^T / sqrt(head_dim)) v` with heads before tokens.

    q, k and v move to `(batch, heads, tokens, head_dim)`, the scale goes on q (a
    tensor `head_dim / tokens` the size of the logits), and the result moves back.
    The softmax runs in float32 at least, as in Keras and JAX, and float16 or
    bfloat16 q and k give float32 logits: a logit sums `head_dim` products, which
    passes float16's 65504 once q and k reach a few hundred, and which bfloat16's
    8-bit mantissa rounds by up to a few hundredths at logits of order 10. Keras'
    own attention asks for float32 logits too, and PyTorch's and JAX's accumulate
    in float32. Same inputs and output as `keras.ops.dot_product_attention`.
    """
    q, k, v = (ops.transpose(t, (0, 2, 1, 3)) for t in (q, k, v))
    if keras.backend.standardize_dtype(q.dtype) in ("float16", "bfloat16"):
        q, k = ops.cast(q, "float32"), ops.cast(k, "float32")
    q = q * ops.cast(1.0 / math.sqrt(q.shape[-1]), q.dtype)
    logits = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2)))
    softmax_dtype = keras.backend.result_type(logits.dtype, "float32")
    probs = ops.cast(ops.softmax(ops.cast(logits, softmax_dtype), axis=-1), v.dtype)
    return ops.transpose(ops.matmul(probs, v), (0, 2, 1, 3))


def residual_fence(x):
    """`x`, on the residual stream after each sublayer's add.

    Fast path `residual_fence` (JAX on a CPU): an identity whose gradient passes a
    conditional that XLA cannot fuse across, which keeps XLA's CPU compiler from
    fusing (and duplicating) the residual gradient's chain of adds through every
    block, a backward pass that otherwise grows with depth squared.
    """
    if _fast("residual_fence", "jax") and _xla_or_graph_on_cpu():
        return _native().residual_fence()(x)
    return x
