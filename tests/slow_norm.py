"""A LayerNorm that takes 20 ms a call, registered as `"slow_layernorm"`: a run of it
is still training when a test stops it part-way, however fast the host (tests/test_ray.py
names this file in `KERAS_VITNORM_NORM_MODULES`)."""

import time

import keras

from keras_vitnorm.layers import register_norm


@register_norm("slow_layernorm")
class SlowLayerNorm(keras.layers.LayerNormalization):
    def call(self, x):
        time.sleep(0.02)
        return super().call(x)
