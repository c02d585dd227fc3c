"""TensorFlow forms of the ops (imported only under the TensorFlow backend)."""

import tensorflow as tf


def on_cpu():
    return not (tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("TPU"))
