"""Training on several devices: the layouts `TrainConfig.distribute` names.

`"data"` is data-parallel; `"fsdp"` (JAX) also shards the kernels of `FSDP_LAYOUT` and
their AdamW state. Backends: `keras_vitnorm.backend`; docs/training.md, "Scaling out".
"""

from keras_vitnorm import backend
from keras_vitnorm.choices import DISTRIBUTIONS
from keras_vitnorm.validation import check_choice

#: Variable path pattern -> sharded axes, for `"fsdp"`: a kernel's first dimension (width
#: or MLP size) divides by the device counts in use. The rest (under 2% of a ViT-B's
#: parameters) stays replicated.
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
