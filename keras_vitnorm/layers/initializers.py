"""Init-time rescaling of built weights (DeepNorm beta, Sub-LN gamma)."""

from keras import ops


def scale_variable(variable, scale, segments=None):
    """Multiplies a freshly initialized variable by `scale`, in place.

    Used instead of an initializer argument because a fused `qkv` kernel needs only
    its value third scaled. With `segments` (a list of factors), the last axis is
    split into equal parts and part `i` is multiplied by `segments[i]`.
    """
    value = variable.value
    if segments is None:
        variable.assign(value * scale)
        return
    parts = ops.split(value, len(segments), axis=-1)
    variable.assign(ops.concatenate([p * s for p, s in zip(parts, segments)], axis=-1))
