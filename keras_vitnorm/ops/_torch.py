"""PyTorch forms of the ops (imported only under the PyTorch backend)."""

import functools

import keras
import torch


def linear(x, kernel, bias):
    """`x @ kernel + bias` in one call, as `torch.nn.Linear` computes it.

    `keras.ops` has no matmul-plus-bias op, and eager PyTorch runs Keras' separate
    bias add as a second pass over the output; `torch.nn.functional.linear` fuses it
    (`addmm`).
    """
    return torch.nn.functional.linear(x, kernel.T, bias)


def layer_norm(x, gamma, beta, epsilon, dtype):
    """`keras_vitnorm.ops.layer_norm` as Keras' PyTorch backend computes it: `x`, `gamma`
    and `beta` in float32 at least, `torch.nn.functional.layer_norm`, back to `x`'s
    dtype, then to `dtype`. The normalized width is a Python int, so that a TorchScript
    trace (Keras' ONNX export with a dynamic batch) keeps it a constant, as ONNX's
    LayerNormalization needs."""
    x = keras.ops.convert_to_tensor(x)
    compute = torch.promote_types(x.dtype, torch.float32)
    gamma, beta = (None if w is None else keras.ops.convert_to_tensor(w).to(compute)
                   for w in (gamma, beta))
    width = (int(x.shape[-1]),)
    y = torch.nn.functional.layer_norm(x.to(compute), width, gamma, beta, epsilon).to(x.dtype)
    return y if dtype is None else y.to(_torch_dtype(dtype))


@functools.cache
def _torch_dtype(dtype):
    return getattr(torch, keras.backend.standardize_dtype(dtype))


def compiling():
    """Whether `torch.compile` is tracing the code that calls this."""
    return torch.compiler.is_compiling()


def attention(q, k, v):
    """Softmax attention by `torch.nn.functional.scaled_dot_product_attention` on views.

    Keras' PyTorch attention moves the heads axis forward and, unless its
    flash-attention check passes (never on a CPU), copies q, k and v into contiguous
    memory first; PyTorch's function takes the strided views itself and picks its
    kernel itself (cuDNN's attention on an H100, where Keras forces
    FlashAttention-2), as the transformers ViT calls it.

    Args:
        q, k, v: tensors `(batch, tokens, heads, head_dim)`, one dtype.
    """
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
