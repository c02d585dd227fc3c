"""Data-parallel training: the distribution scope of each backend."""

import os

import keras


def data_parallel_scope():
    """Returns `(context manager, number of replicas)` for data-parallel training.

    JAX: `keras.distribution.DataParallel` over all local devices (and, when the
    `KERAS_DISTRIBUTION_*` variables describe several processes, over all hosts after
    `keras.distribution.initialize()`). TensorFlow: `tf.distribute.MirroredStrategy`
    over the local GPUs (or the logical CPUs when there is no GPU). PyTorch: not supported, because Keras' `fit`
    has no DistributedDataParallel integration (see docs/training.md).
    """
    backend = keras.backend.backend()
    if backend == "jax":
        if int(os.environ.get("KERAS_DISTRIBUTION_NUM_PROCESSES", "1")) > 1:
            keras.distribution.initialize()
        devices = keras.distribution.list_devices()
        return keras.distribution.DataParallel(devices=devices).scope(), len(devices)
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
