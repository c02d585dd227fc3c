"""JAX forms of the ops (imported only under the JAX backend)."""

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import linear_call


def on_cpu():
    return jax.default_backend() == "cpu"


def cudnn_attention_fits(q, k, v):
    """Whether JAX's cuDNN attention takes q, k and v once their tokens are padded."""
    if (jax.default_backend() != "gpu" or not q.dtype == k.dtype == v.dtype
            or str(q.dtype) not in ("bfloat16", "float16")):
        return False
    capability = getattr(jax.devices()[0], "compute_capability", None)
    try:
        major, minor = (int(part) for part in str(capability).split(".")[:2])
    except ValueError:  # not a CUDA device (no "major.minor" capability)
        return False
    head_dim, max_head_dim = q.shape[-1], 256 if major >= 9 else 128
    return (major, minor) >= (8, 0) and head_dim % 8 == 0 and head_dim <= max_head_dim


def padded_attention(q, k, v, implementation="cudnn", multiple=8):
    """Softmax attention on `(batch, tokens, heads, head_dim)` padded to a multiple of `multiple`.

    cuDNN rejects an odd token count when differentiated; the padding is masked by sequence
    lengths and dropped. If JAX still rejects the inputs, XLA's attention runs unpadded.
    """
    tokens = q.shape[1]
    pad = -tokens % multiple
    padded = [jnp.pad(t, ((0, 0), (0, pad), (0, 0), (0, 0))) for t in (q, k, v)]
    lengths = jnp.full((q.shape[0],), tokens, jnp.int32)
    try:
        out = jax.nn.dot_product_attention(
            *padded, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
            implementation=implementation)
    except NotImplementedError:
        return jax.nn.dot_product_attention(q, k, v, implementation="xla")
    return out[:, :tokens]


@functools.cache
def residual_fence():
    """The identity, whose reverse-mode gradient passes a `lax.cond` that XLA cannot fold.

    XLA's CPU compiler fuses the residual gradient's chain of adds into each consumer; the
    conditional ends that at each block (`optimization_barrier` does not survive to fusion).
    It sits only in the transpose, so the forward keeps nothing.
    """

    def identity(_, tangent):
        return tangent

    def transpose(_, cotangent):
        keep = jnp.isfinite(cotangent.reshape(-1)[0])
        return jax.lax.cond(keep, lambda g: g, lambda g: g * 1, cotangent)

    @jax.custom_jvp
    def fence(x):
        return x

    @fence.defjvp
    def fence_jvp(primals, tangents):
        (x,), (tangent,) = primals, tangents
        return x, linear_call(identity, transpose, (), tangent)

    return fence
