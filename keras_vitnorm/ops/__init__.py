"""The few tensor operations the layers need beyond `keras.ops`, written in `keras.ops`, each
fast path (`keras_vitnorm.ops.switch`) giving the same values and gradients up to float32
round-off in a faster form (docs/backends.md)."""

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


# Imported now, not at an op's first call: torch.compile cannot trace an import.
_NATIVE = _import_native()


def _native():
    if _NATIVE is None:
        raise ValueError(
            f"keras_vitnorm runs on jax, tensorflow and torch, not {backend_name()!r}.")
    return _NATIVE


def _fast(name, *backends):
    return backend_name() in backends and fast_path_enabled(name)


@functools.cache
def _xla_or_graph_on_cpu():
    """JAX or TensorFlow computing on a CPU (no GPU or TPU in use)."""
    return backend_name() in ("jax", "tensorflow") and _native().on_cpu()


def layer_norm(x, gamma=None, beta=None, epsilon=1e-6, dtype=None):
    """LayerNorm over the last axis: `(x - mean) / sqrt(var + epsilon) * gamma + beta`, cast to
    `dtype` where given; on PyTorch the width is a Python int, for ONNX export (docs/backends.md).
    """
    if epsilon is None:  # as Keras' op takes it
        epsilon = keras.config.epsilon()
    if backend_name() == "torch":
        return _native().layer_norm(x, gamma, beta, epsilon, dtype)
    y = ops.layer_normalization(x, gamma, beta, axis=-1, epsilon=epsilon)
    return y if dtype is None else ops.cast(y, dtype)


def linear(x, kernel, bias=None):
    """`x @ kernel + bias` over the last axis (`kernel`: `(in, out)`); fast path `linear`."""
    x, kernel = ops.convert_to_tensor(x), ops.convert_to_tensor(kernel)
    bias = None if bias is None else ops.convert_to_tensor(bias)
    same_dtype = x.dtype == kernel.dtype and (bias is None or bias.dtype == x.dtype)
    if same_dtype and _fast("linear", "torch"):
        return _native().linear(x, kernel, bias)
    y = ops.matmul(x, kernel)
    return y if bias is None else ops.add(y, bias)


def standardize_kernel(kernel, epsilon=1e-10):
    """Weight standardization: `(w - mean(w)) / sqrt(var(w) + epsilon) / sqrt(fan_in)`.

    Over all axes but the last, in float32. The `1/fan_in` (scaled WS, Brock et al. 2021) keeps
    the output at its input's scale, as no norm follows the layers that feed the residual stream.
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
    """q, k, v `(batch, tokens, heads, head_dim)` from a fused `(width, 3 * width)` kernel, columns
    `[q | k | v]`, each head-major; fast path `split_qkv`."""
    tokens = x.shape[1]
    head_dim = kernel.shape[-1] // (3 * num_heads)
    if _fast("split_qkv", "tensorflow"):
        kernels = ops.split(ops.convert_to_tensor(kernel), 3, axis=1)
        biases = [None] * 3 if bias is None else ops.split(ops.convert_to_tensor(bias), 3)
        return [ops.reshape(linear(x, k, b), (-1, tokens, num_heads, head_dim))
                for k, b in zip(kernels, biases)]
    return split_heads(linear(x, kernel, bias), num_heads)


def split_heads(qkv, num_heads):
    """`(batch, tokens, 3 * width)` to q, k, v `(batch, tokens, heads, head_dim)` by `ops.unstack`:
    on PyTorch its gradient is one stack, not three zero-filled full tensors."""
    tokens, fused = qkv.shape[1], qkv.shape[2]
    qkv = ops.reshape(qkv, (-1, tokens, 3, num_heads, fused // (3 * num_heads)))
    return tuple(ops.unstack(qkv, axis=2))


def attention(q, k, v):
    """Softmax attention over `(batch, tokens, heads, head_dim)` q, k and v.

    `keras.ops.dot_product_attention`, except: float16 on TensorFlow goes heads-first (float32
    logits); fast path `attention`; no flash attention for an odd token count on JAX (cuDNN
    rejects it when differentiated) or under `torch.compile` (Keras' check cannot be traced).
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
    """`softmax(q k^T / sqrt(head_dim)) v` with heads before tokens, same shapes as Keras' op.

    The scale goes on q; float16 or bfloat16 q and k give float32 logits and softmax (a
    float16 logit overflows once q and k reach a few hundred).
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
    """`x`; fast path `residual_fence`: an identity whose gradient XLA cannot fuse across
    blocks, so the backward pass does not grow with depth squared."""
    if _fast("residual_fence", "jax") and _xla_or_graph_on_cpu():
        return _native().residual_fence()(x)
    return x
