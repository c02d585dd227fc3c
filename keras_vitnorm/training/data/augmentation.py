"""Training-time augmentation: what to draw, and whether a resumed run draws the same.

Both input pipelines apply the same `Augmentation`: crops and flips keyed by each
example's position in the stream (each pipeline draws them its own way), then Keras'
RandAugment, MixUp and CutMix layers.
"""

import dataclasses

import keras


@dataclasses.dataclass
class Augmentation:
    """Training-time augmentation: crops and flips keyed by position, then Keras layers.

    Crops and flips are drawn per example position by each pipeline (the same
    transformations as Keras' `RandomCrop`, `RandomZoom` and `RandomFlip`, keyed so that
    a resumed run is exact); RandAugment, MixUp and CutMix are Keras core layers.

    Attributes:
        crop: `"none"`, `"pad"` (zero-pad by `crop_padding` pixels, then a random crop
            back to size: the CIFAR recipe) or `"zoom"` (random zoom-in of up to
            `zoom` of each side, approximating Inception-style crops; Keras core has no
            RandomResizedCrop).
        crop_padding: int, pixels for `crop="pad"`.
        zoom: float in [0, 1), the largest zoom-in for `crop="zoom"`.
        flip: bool, random horizontal flips.
        randaugment_ops: int, RandAugment operations per image (0 = off).
        randaugment_factor: float in [0, 1], Keras RandAugment strength.
        mixup: float, MixUp Beta(alpha, alpha) concentration (0 = off).
        cutmix: float, CutMix Beta concentration (0 = off). With both on, each batch
            gets one of them, chosen with probability 1/2 (as timm does).
    """

    crop: str = "none"
    crop_padding: int = 4
    zoom: float = 0.5
    flip: bool = False
    randaugment_ops: int = 0
    randaugment_factor: float = 0.5
    mixup: float = 0.0
    cutmix: float = 0.0


def resumes_exactly(augmentation):
    """Whether a stream started at any step gives the batches the full run gives there.

    The crops and flips are keyed by each example's position in the stream; RandAugment,
    MixUp and CutMix are Keras layers drawing from a stateful seed generator that
    restarts with the stream, so with them a resumed run sees other (equally
    distributed) draws.
    """
    return not (augmentation.randaugment_ops or augmentation.mixup or augmentation.cutmix)


def randaugment(augmentation, channels, seed):
    """`[Keras' RandAugment]` if asked for, else `[]` (see `resumes_exactly`)."""
    if not augmentation.randaugment_ops:
        return []
    if channels != 3:
        raise ValueError(
            "RandAugment needs RGB images; this dataset/model has "
            f"{channels} channel(s). Set randaugment_ops=0."
        )
    return [keras.layers.RandAugment(
        value_range=(0, 255),
        num_ops=augmentation.randaugment_ops,
        factor=augmentation.randaugment_factor,
        seed=seed,
    )]
