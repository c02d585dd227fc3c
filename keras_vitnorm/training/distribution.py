"""Training on several devices: the layouts `TrainConfig.distribute` names.

- `"data"`: data-parallel. JAX: `keras.distribution.DataParallel` over all devices;
  TensorFlow: `tf.distribute.MirroredStrategy` over the local GPUs (or the logical
  CPUs when there is no GPU); PyTorch: one process per device, started by `torchrun`,
  each training on its share of every global batch, the gradients averaged over the
  processes each step.
- `"fsdp"` (JAX): fully sharded data parallel. One device mesh axis, `"batch"`,
  carries both the batch and the weights: every kernel of the encoder blocks (and
  the head) is split along its first dimension over the devices, as is its AdamW
  state, and XLA gathers a kernel where a step needs it whole. Built with
  `keras.distribution.ModelParallel` and the `FSDP_LAYOUT` layout map. A device then
  holds 1/n of those weights and their optimizer state (the measured memory per
  device is in docs/training.md).

With `KERAS_DISTRIBUTION_NUM_PROCESSES` > 1 (several hosts, or several processes on
one), JAX's data-parallel layout spans every process's devices after
`keras.distribution.initialize()`, and Keras feeds each process its share of every
batch. With several processes (either backend) the first one writes the run's files;
the others train and read nothing but what it sends them. How each backend does
this is in `keras_vitnorm.backend`.
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
    """Returns `(context manager, number of data-parallel replicas)` for `kind`.

    Args:
        kind: `"data"` or `"fsdp"` (JAX only).
    """
    check_choice("distribute", kind, DISTRIBUTIONS)
    return backend.distribution_scope(kind, FSDP_LAYOUT)
