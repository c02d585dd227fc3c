"""Training on several devices: `"data"` (data-parallel) or `"fsdp"` (JAX: the kernels of
`FSDP_LAYOUT` sharded too), as docs/training.md, "Scaling out", describes.
"""

from keras_vitnorm import backend
from keras_vitnorm.choices import DISTRIBUTIONS
from keras_vitnorm.validation import check_choice

#: Variable path pattern -> sharded axes, for `"fsdp"`: a kernel's first dimension (width
#: or MLP size) divides by the device counts in use.
FSDP_LAYOUT = {
    r"block_\d+/attention/(qkv|out)/kernel": ("batch", None),
    r"block_\d+/mlp/(fc1|fc2)/kernel": ("batch", None),
    r"head/kernel": ("batch", None),
}


def distribution_scope(kind="data"):
    """Returns `(context manager, number of data-parallel replicas)` for `kind`,
    `"data"` or `"fsdp"` (JAX only)."""
    check_choice("distribute", kind, DISTRIBUTIONS)
    return backend.distribution_scope(kind, FSDP_LAYOUT)
