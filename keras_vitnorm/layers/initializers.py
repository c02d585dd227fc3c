"""Initialization helpers: fused kernels initialized part by part, and initial-weight gains."""

import keras
from keras import ops

from keras_vitnorm.validation import check_positive_int


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class FusedKernelInitializer(keras.initializers.Initializer):
    """Initializes a kernel of `parts` equal column blocks, each as its own kernel.

    big_vision draws q, k and v as three `(width, width)` Xavier-uniform kernels; one draw on
    the fused `(width, 3 * width)` shape would start them `1/sqrt(2)` smaller.

    Args:
        initializer: default `"glorot_uniform"`. One block's initializer; with an integer
            seed, block `i` uses `seed + i`.
        parts: int, default `3`. Number of equal column blocks.

    Example:
    >>> kernel = FusedKernelInitializer("glorot_uniform", parts=3)((64, 192))
    """

    def __init__(self, initializer="glorot_uniform", parts=3):
        self.parts = check_positive_int("parts", parts)
        self.initializer = keras.initializers.get(initializer)

    def __call__(self, shape, dtype=None):
        *leading, columns = shape
        if columns % self.parts:
            raise ValueError(
                f"A kernel of shape {tuple(shape)} cannot be split into {self.parts} "
                f"equal column blocks: {columns} is not divisible by {self.parts}.")
        block_shape = (*leading, columns // self.parts)
        blocks = [self._block_initializer(i)(block_shape, dtype=dtype) for i in range(self.parts)]
        return ops.concatenate(blocks, axis=-1)

    def _block_initializer(self, index):
        # A fresh copy per block (a seeded initializer draws the same values at every
        # call), through its own config: `keras.initializers.serialize` imports TensorFlow.
        config = self.initializer.get_config()
        seed = config.get("seed")
        if isinstance(seed, int):
            config["seed"] = seed + index
        return type(self.initializer).from_config(config)

    def get_config(self):
        return {"initializer": keras.initializers.serialize(self.initializer), "parts": self.parts}


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class ScaledInitializer(keras.initializers.Initializer):
    """The values of `initializer` times a constant: DeepNorm's beta, Sub-LN's gamma.

    As part of the initializer it touches only freshly drawn weights, not loaded ones.

    Args:
        initializer: str, dict or `keras.initializers.Initializer`.
        scale: float, or one float per equal block of the last axis (`[1.0, 1.0, beta]`
            scales a fused qkv kernel's value third alone).

    Example:
    >>> kernel = ScaledInitializer("glorot_uniform", 0.5)((64, 64))
    """

    def __init__(self, initializer, scale):
        scales = scale if isinstance(scale, (list, tuple)) else [scale]
        if not scales or any(isinstance(s, bool) or not isinstance(s, (int, float))
                             for s in scales):
            raise ValueError(
                f"scale must be a number or a non-empty list of numbers, got {scale!r}.")
        self.initializer = keras.initializers.get(initializer)
        self.scale = [float(s) for s in scale] if isinstance(scale, (list, tuple)) else float(scale)

    def __call__(self, shape, dtype=None):
        values = self.initializer(shape, dtype=dtype)
        if not isinstance(self.scale, list):
            return values * self.scale
        if shape[-1] % len(self.scale):
            raise ValueError(
                f"A weight of shape {tuple(shape)} cannot be split into {len(self.scale)} "
                f"equal blocks for scale={self.scale}: {shape[-1]} is not divisible by "
                f"{len(self.scale)}.")
        blocks = ops.split(values, len(self.scale), axis=-1)
        return ops.concatenate([b * s for b, s in zip(blocks, self.scale)], axis=-1)

    def get_config(self):
        return {"initializer": keras.initializers.serialize(self.initializer), "scale": self.scale}
