"""Keras' RandAugment, MixUp and CutMix in the `python` input pipeline, their draws keyed
by position and step (`augmentation.seed_states`), so a resumed stream draws the same."""

import functools

import keras
import numpy as np

from keras_vitnorm import backend
from keras_vitnorm.ops import fast_path_enabled
from keras_vitnorm.training.data.augmentation import BATCH_MIXING
from keras_vitnorm.training.data.augmentation import RANDAUGMENT
from keras_vitnorm.training.data.augmentation import batch_mixing
from keras_vitnorm.training.data.augmentation import count_histograms_with_bincount
from keras_vitnorm.training.data.augmentation import randaugment
from keras_vitnorm.training.data.augmentation import seed_states


class PerImageRandAugment:
    """Keras' RandAugment on each image of a batch on its own (Keras' layer draws once
    per batch), its draws keyed by the image's stream position (`seed_states`)."""

    def __init__(self, augmentation, channels, seed, image_size):
        [self.layer] = randaugment(augmentation, channels, seed)
        self.layer.build((None, *image_size, channels))
        if fast_path_enabled("bincount_histogram"):
            count_histograms_with_bincount(getattr(self.layer, "equalization", None))
        self.seed = seed
        self.generator = self.layer.generator
        self._keyed = backend.compiled(self.keyed) or self.keyed

    def __call__(self, images, positions):
        """float32 `images` in [0, 255] augmented, the `i`-th keyed by `positions[i]`;
        compiled under JAX (`backend.compiled`), where eagerly each switch compiles anew."""
        keys = seed_states(self.seed, RANDAUGMENT, positions, self.generator.state.dtype)
        out = np.empty_like(images)
        for i, (image, key) in enumerate(zip(images, keys)):
            out[i] = keras.ops.convert_to_numpy(self._keyed(image, key))
        return out

    def keyed(self, image, key):
        """One image augmented at the generator state `key` (a value: this runs compiled)."""
        with keras.StatelessScope(state_mapping=[(self.generator.state, key)]):
            draws = self.layer.get_random_transformation(image, training=True)
        return self.apply_chosen(image, draws)

    def apply_chosen(self, image, draws):
        """`image` through the operation each slot chose, a switch in place of Keras' `where`
        over all eleven. Each gets a copy: Keras' RandomBrightness adds in place under PyTorch."""
        layer = self.layer
        images = keras.ops.cast(keras.ops.expand_dims(image, 0), layer.compute_dtype)
        branches = [functools.partial(self._operation, name, transform)
                    for name, transform in draws["transforms"].items()]
        for slot in range(layer.num_ops):
            images = keras.ops.switch(draws["layer_idxes"][slot], branches, images)
        return keras.ops.squeeze(images, 0)

    def _operation(self, name, transform, images):
        out = getattr(self.layer, name).transform_images(keras.ops.copy(images), transform,
                                                           training=True)
        return keras.ops.cast(out, images.dtype)


class BatchMixing:
    """MixUp and CutMix as Keras layers on a batch, their draws keyed by the step."""

    def __init__(self, augmentation, seed):
        self.seed = seed
        self.mixup, self.cutmix = batch_mixing(augmentation, seed)

    def __call__(self, images, labels, step):
        """NumPy `images` and `labels` of the batch of `step`, mixed by one of the layers
        (with both, either, with probability 1/2), or as they are."""
        layer = self.mixup or self.cutmix
        if self.mixup and self.cutmix:
            draw = np.random.default_rng([self.seed, 1, step]).random()
            layer = self.mixup if draw < 0.5 else self.cutmix
        if layer is None:
            return images, labels.astype(np.float32)
        dtype = layer.generator.state.dtype
        layer.generator.state.assign(seed_states(self.seed, BATCH_MIXING, [step], dtype)[0])
        out = layer({"images": images, "labels": labels})
        return tuple(keras.ops.convert_to_numpy(out[k]).astype(np.float32)
                     for k in ("images", "labels"))
