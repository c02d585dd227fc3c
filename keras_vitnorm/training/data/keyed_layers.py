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
    """Keras' RandAugment on each image of a batch on its own, its draws keyed by the
    image's position in the stream.

    Keras' layer, called on a batch, draws one pair of operations and one histogram
    for the whole batch; RandAugment draws per image. The layer's seed generator is set
    to the image's key (`seed_states`), so the output depends on the image and its
    position only, and a resumed stream sees the same. Only the chosen operations run
    (`apply_chosen`), which avoids the brightening Keras' call adds to every image under
    PyTorch (docs/training.md, "The recipe's pieces").
    """

    def __init__(self, augmentation, channels, seed, image_size):
        [self.layer] = randaugment(augmentation, channels, seed)
        self.layer.build((None, *image_size, channels))
        if fast_path_enabled("bincount_histogram"):
            count_histograms_with_bincount(getattr(self.layer, "equalization", None))
        self.seed = seed
        self.generator = self.layer.generator
        self._keyed = None  # `keyed` as `__call__` runs it

    def keys(self, positions):
        """The generator states of the images at stream positions `positions`."""
        return seed_states(self.seed, RANDAUGMENT, positions, self.generator.state.dtype)

    def __call__(self, images, positions):
        """`images` (float32 `(n, height, width, channels)` in [0, 255]) augmented, the
        `i`-th keyed by the stream position `positions[i]`, one image at a time: under
        JAX one compiled program for each image size (`backend.compiled`), since run
        eagerly each image's switch is compiled anew, its draws constants there."""
        if self._keyed is None:
            self._keyed = backend.compiled(self.keyed) or self.keyed
        out = np.empty_like(images)
        for i, (image, key) in enumerate(zip(images, self.keys(positions))):
            out[i] = keras.ops.convert_to_numpy(self._keyed(image, key))
        return out

    def keyed(self, image, key):
        """One image augmented with the generator at `key` (its state is `key` for the
        call, not a variable, so this also runs compiled)."""
        return self.apply_chosen(image, self.draws(image, key))

    def draws(self, image, key):
        """What Keras' layer draws for `image` with its generator at `key`: each slot's
        operation and every operation's parameters (`get_random_transformation`)."""
        with keras.StatelessScope(state_mapping=[(self.generator.state, key)]):
            return self.layer.get_random_transformation(image, training=True)

    def apply_chosen(self, image, draws):
        """`image` through the operation each slot chose, as Keras' layer computes it
        but with a switch in place of its `where` over all eleven operations: only
        the chosen operation's transform runs. Each gets a copy of the image, since Keras'
        RandomBrightness adds to its input in place under PyTorch (Keras' layer, which
        runs every operation, brightens every image there)."""
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
    """MixUp and CutMix as Keras layers on a batch, their draws keyed by the step: with
    both, each batch gets one of them, with probability 1/2 (as timm does)."""

    def __init__(self, augmentation, seed):
        self.seed = seed
        self.mixup, self.cutmix = batch_mixing(augmentation, seed)

    def layer(self, step):
        """The layer that mixes the batch of `step`, or `None`."""
        if self.mixup and self.cutmix:
            return self.mixup if np.random.default_rng([self.seed, 1, step]).random() < 0.5 else (
                self.cutmix)
        return self.mixup or self.cutmix

    def key(self, layer, step):
        """The generator state that `layer` draws the batch of `step` with."""
        dtype = "int32" if layer is None else layer.generator.state.dtype
        return seed_states(self.seed, BATCH_MIXING, [step], dtype)[0]

    def __call__(self, layer, images, labels, step):
        """NumPy `images` and `labels` mixed by `layer` (as they are where `None`)."""
        if layer is None:
            return images, labels.astype(np.float32)
        layer.generator.state.assign(self.key(layer, step))
        out = layer({"images": images, "labels": labels})
        return tuple(keras.ops.convert_to_numpy(out[k]).astype(np.float32)
                     for k in ("images", "labels"))
