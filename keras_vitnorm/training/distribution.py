"""Training on several devices: the layouts `TrainConfig.distribute` names.

`"data"` is data-parallel; `"fsdp"` (JAX) also splits every block kernel, the head's
and their AdamW state over the devices (`FSDP_LAYOUT`). How each backend does it is in
`keras_vitnorm.backend`; commands and memory: docs/training.md, "Scaling out".
"""

from keras_vitnorm import backend
from keras_vitnorm.choices import DISTRIBUTIONS
from keras_vitnorm.validation import check_choice

#: Variable path pattern -> sharded axes, for `"fsdp"`. The kernels' first dimension is
#: the width or the MLP size, which the device counts in use divide. The stem, the
#: position embedding, the norms and the biases stay replicated (well under 2% of a
#: ViT-B's parameters).
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
