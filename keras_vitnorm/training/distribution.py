"""Training on several devices: the distribution scope of each backend and layout.

- `"data"`: data-parallel. JAX: `keras.distribution.DataParallel` over all devices;
  TensorFlow: `tf.distribute.MirroredStrategy` over the local GPUs (or the logical
  CPUs when there is no GPU).
- `"fsdp"` (JAX): fully sharded data parallel. One device mesh axis, `"batch"`,
  carries both the batch and the weights: every kernel of the encoder blocks (and
  the head) is split along its first dimension over the devices, as is its AdamW
  state, and XLA gathers a kernel where a step needs it whole. Built with
  `keras.distribution.ModelParallel` and the `FSDP_LAYOUT` layout map. A device then
  holds 1/n of those weights and their optimizer state (the measured memory per
  device is in docs/training.md).

With `KERAS_DISTRIBUTION_NUM_PROCESSES` > 1 (several hosts, or several processes on
one), JAX's layouts span every process's devices after
`keras.distribution.initialize()`.
"""

import os

import keras

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
    backend = keras.backend.backend()
    if backend == "jax":
        if int(os.environ.get("KERAS_DISTRIBUTION_NUM_PROCESSES", "1")) > 1:
            keras.distribution.initialize()
        devices = keras.distribution.list_devices()
        if kind == "data":
            return keras.distribution.DataParallel(devices=devices).scope(), len(devices)
        mesh = keras.distribution.DeviceMesh((len(devices),), ["batch"], devices)
        layout_map = keras.distribution.LayoutMap(mesh)
        for pattern, axes in FSDP_LAYOUT.items():
            layout_map[pattern] = axes
        fsdp = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
        return fsdp.scope(), len(devices)
    if kind == "fsdp":
        raise ValueError(
            f"distribute='fsdp' is available on the JAX backend only (keras.distribution."
            f"ModelParallel); the {backend!r} backend trains with distribute='data'."
        )
    if backend == "tensorflow":
        import tensorflow as tf

        # All GPUs, else every logical CPU (one unless the process split the CPU).
        devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
        strategy = tf.distribute.MirroredStrategy(devices=[d.name for d in devices])
        return strategy.scope(), strategy.num_replicas_in_sync
    raise ValueError(
        f"distribute=True is not available on the {backend!r} backend: Keras' model.fit "
        "has no DistributedDataParallel support. Use KERAS_BACKEND=jax "
        "(keras.distribution.DataParallel) or tensorflow (tf.distribute.MirroredStrategy); "
        "docs/training.md explains the options."
    )
