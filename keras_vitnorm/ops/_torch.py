"""PyTorch forms of the ops (imported only under the PyTorch backend)."""

import functools

import keras
import torch


def linear(x, kernel, bias):
    """`x @ kernel + bias` in one call (`addmm`), as `torch.nn.Linear` computes it."""
    return torch.nn.functional.linear(x, kernel.T, bias)


def layer_norm(x, gamma, beta, epsilon, dtype):
    """`ops.layer_norm` with the width a Python int, a constant in a TorchScript trace."""
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
    """Softmax attention by `scaled_dot_product_attention` on the strided views (Keras' form
    first copies q, k and v into contiguous memory unless flash attention fits)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
