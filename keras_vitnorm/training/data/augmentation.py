"""Training-time augmentation: what to draw, and whether a resumed run draws the same.

Both input pipelines apply the same `Augmentation`: crops and flips keyed by each
example's position in the stream (each pipeline draws them its own way), then Keras'
RandAugment (on each image), MixUp and CutMix layers (on the batch).
"""

import dataclasses

import keras
import numpy as np

from keras_vitnorm import backend


@dataclasses.dataclass
class Augmentation:
    """Training-time augmentation (docs/training.md).

    Attributes:
        crop: `"none"`, `"pad"` (zero-pad by `crop_padding` pixels, random crop back)
            or `"zoom"` (random zoom-in up to `zoom` per side, an approximation of
            Inception-style crops).
        flip: bool, random horizontal flips.
        randaugment_ops, randaugment_factor: operations per image (0 = off), strength.
        mixup, cutmix: Beta concentrations (0 = off); with both, each batch gets one,
            chosen with probability 1/2 (as timm does).
    """

    crop: str = "none"
    crop_padding: int = 4
    zoom: float = 0.5
    flip: bool = False
    randaugment_ops: int = 0
    randaugment_factor: float = 0.5
    mixup: float = 0.0
    cutmix: float = 0.0


def resumes_exactly(augmentation, pipeline):
    """Whether a stream started at any step gives the batches the full run gives there.

    Crops and flips are keyed by position in both pipelines, RandAugment, MixUp and
    CutMix only in the `python` one (`seed_states`); under tf.data they draw from a
    stateful generator, so a resumed run sees other (equally distributed) draws.
    """
    return pipeline == "python" or not (
        augmentation.randaugment_ops or augmentation.mixup or augmentation.cutmix)


#: The dtype of the augmentation layers, whatever the global policy: images are
#: augmented in [0, 255] before the model casts them, and Keras' MixUp and CutMix under
#: a mixed policy multiply the policy's bfloat16 images by a float32 draw.
AUGMENTATION_DTYPE = "float32"


def batch_mixing(augmentation, seed):
    """`(Keras' MixUp or None, Keras' CutMix or None)` as `augmentation` asks."""
    mixup = (keras.layers.MixUp(alpha=augmentation.mixup, seed=seed, dtype=AUGMENTATION_DTYPE)
             if augmentation.mixup else None)
    cutmix = (keras.layers.CutMix(factor=augmentation.cutmix, seed=seed, dtype=AUGMENTATION_DTYPE)
              if augmentation.cutmix else None)
    return mixup, cutmix


def check_randaugment(randaugment_ops, channels):
    """Raises a `ValueError` where RandAugment is asked for (`randaugment_ops`) on
    images of `channels` other than 3: Keras' RandAugment takes RGB images only."""
    if randaugment_ops and channels != 3:
        raise ValueError(
            f"RandAugment needs RGB images; this dataset/model has {channels} channel(s), "
            f"and randaugment_ops={randaugment_ops} asks for it. Set randaugment_ops=0 "
            "(--randaugment-ops 0).")


def randaugment(augmentation, channels, seed):
    """`[Keras' RandAugment]` if asked for, else `[]` (see `resumes_exactly`)."""
    if not augmentation.randaugment_ops:
        return []
    check_randaugment(augmentation.randaugment_ops, channels)
    return [keras.layers.RandAugment(
        value_range=(0, 255), num_ops=augmentation.randaugment_ops,
        factor=augmentation.randaugment_factor, seed=seed, dtype=AUGMENTATION_DTYPE)]


def count_histograms_with_bincount(equalization, counts=None):
    """Makes a Keras `Equalization` layer (or `None`) count its histogram with a
    `bincount`; returns whether it could.

    Under JAX, Keras 3.15's `Equalization` counts its 256-bin histogram with a Python
    loop over the bins, chosen by the global backend, not the one it computes with:
    far slower inside tf.data or per image (docs/performance.md, "RandAugment under
    JAX"). The layer's private `_custom_histogram_fixed_width` then counts with
    `counts[name]` (`{backend name: count(bins, nbins)}`, e.g. TensorFlow's for a layer
    that tf.data runs) for the backend `name` it computes with, or with
    `keras_vitnorm.backend.count_bins` for the global one, else as Keras does.
    """
    keras_histogram = getattr(equalization, "_custom_histogram_fixed_width", None)
    if keras_histogram is None:
        return False
    counts = {backend.name(): backend.count_bins, **(counts or {})}

    def histogram(values, value_range, nbins):
        ops = equalization.backend
        count = counts.get(ops.name)
        if count is None:
            return keras_histogram(values, value_range, nbins)
        low, high = (float(bound) for bound in value_range)
        bins = ops.cast((ops.cast(values, "float32") - low) * (nbins - 1) / (high - low), "int32")
        return count(ops.numpy.reshape(ops.numpy.clip(bins, 0, nbins - 1), [-1]), nbins)

    equalization._custom_histogram_fixed_width = histogram
    return True


#: What a keyed draw is for (`seed_states`): each purpose draws from its own keys.
RANDAUGMENT, BATCH_MIXING = 0, 1


def seed_states(seed, purpose, indices, dtype):
    """Seed-generator states `[k, index]` for each of `indices` (stream positions or
    steps), with `k` a hash of `(seed, purpose)`: a Keras layer whose generator state
    is set to an index's row before it draws makes the same draws for that index in
    any run, whatever was drawn before (a resumed stream, another process's share).

    Both words stay below 2**31, so the states fit every backend's seed `dtype`.
    """
    indices = np.asarray(indices, np.int64)
    if indices.size and (indices.min() < 0 or indices.max() >= 2**31):
        raise ValueError(f"Stream positions and steps must lie in [0, 2**31); got {indices.max()}.")
    key = int(np.random.SeedSequence([int(seed) % 2**32, purpose]).generate_state(1)[0]) % 2**31
    return np.stack([np.full(indices.shape, key, np.int64), indices], axis=-1).astype(dtype)
