"""Training-time augmentation: what to draw, and whether a resumed run draws the same."""

import dataclasses

import keras
import numpy as np

from keras_vitnorm import backend


@dataclasses.dataclass
class Augmentation:
    """Training-time augmentation (docs/training.md).

    Attributes:
        crop: `"none"`, `"pad"` (zero-pad by `crop_padding` pixels, random crop back)
            or `"zoom"` (random zoom-in up to `zoom` per side).
        flip: bool, random horizontal flips.
        randaugment_ops, randaugment_factor: operations per image (0 = off), strength.
        mixup, cutmix: Beta concentrations (0 = off); with both, each batch gets one.
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
    """Whether a stream started at any step gives the batches the full run gives there:
    under tf.data RandAugment, MixUp and CutMix draw from a stateful generator."""
    return pipeline == "python" or not (
        augmentation.randaugment_ops or augmentation.mixup or augmentation.cutmix)


#: The augmentation layers' dtype, whatever the global policy: Keras' MixUp and CutMix
#: under a mixed policy multiply bfloat16 images by a float32 draw.
AUGMENTATION_DTYPE = "float32"


def batch_mixing(augmentation, seed):
    """`(Keras' MixUp or None, Keras' CutMix or None)` as `augmentation` asks."""
    mixup = (keras.layers.MixUp(alpha=augmentation.mixup, seed=seed, dtype=AUGMENTATION_DTYPE)
             if augmentation.mixup else None)
    cutmix = (keras.layers.CutMix(factor=augmentation.cutmix, seed=seed, dtype=AUGMENTATION_DTYPE)
              if augmentation.cutmix else None)
    return mixup, cutmix


def check_randaugment(randaugment_ops, channels):
    """Raises a `ValueError` where RandAugment is asked for on non-RGB images (Keras' takes RGB)."""
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
    """Makes a Keras `Equalization` layer (or `None`) count its histogram with a `bincount`
    (docs/performance.md, "RandAugment under JAX"); returns whether it could. It counts with
    `counts[name]` (`{backend name: count(bins, nbins)}`) for the backend it computes with,
    with `backend.count_bins` for the global one, else as Keras does."""
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
    """Seed-generator states `[k, index]` for `indices` (stream positions or steps), `k` a
    hash of `(seed, purpose)`: the same draws for an index in any run. Both words stay
    below 2**31, fitting every backend's seed `dtype`."""
    indices = np.asarray(indices, np.int64)
    if indices.size and (indices.min() < 0 or indices.max() >= 2**31):
        raise ValueError(f"Stream positions and steps must lie in [0, 2**31); got {indices.max()}.")
    key = int(np.random.SeedSequence([int(seed) % 2**32, purpose]).generate_state(1)[0]) % 2**31
    return np.stack([np.full(indices.shape, key, np.int64), indices], axis=-1).astype(dtype)
