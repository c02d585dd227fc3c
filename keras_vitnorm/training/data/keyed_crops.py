"""The crops and flips of the `python` input pipeline, drawn per example from a
generator seeded by its position in the stream: the transformations of
`keras_vitnorm.training.data.tf_pipeline._keyed_augmentation`, applied with NumPy."""

import numpy as np

from keras_vitnorm.training.data.bilinear_sampling import sample_bilinear


def crop_draws(augmentation, image_size, rng):
    """`(crop, flip)` of one example, drawn from `rng` (seeded by its position).

    The transformations of `tf_pipeline._keyed_augmentation`: `crop` is
    `("pad", top, left)` (the window's corner in the padded image), `("zoom", ys, xs)`
    (the bilinear sampling grid of `tf.image.crop_and_resize`) or `None`; `flip`
    whether the example is mirrored.
    """
    height, width = image_size
    draws, flip_draw = rng.random(2), rng.random()
    flip = bool(augmentation.flip and flip_draw < 0.5)
    if augmentation.crop == "pad":
        pad = augmentation.crop_padding
        top = min(int(draws[0] * (2 * pad + 1)), 2 * pad)
        left = min(int(draws[1] * (2 * pad + 1)), 2 * pad)
        return ("pad", top, left), flip
    if augmentation.crop == "zoom":
        scale = 1.0 - augmentation.zoom + augmentation.zoom * draws
        start, end = 0.5 - scale / 2, 0.5 + scale / 2
        # crop_and_resize's sampling grid: box corners on the first and last pixel centres.
        steps = np.arange(height) / max(height - 1, 1), np.arange(width) / max(width - 1, 1)
        ys = (start[0] + steps[0] * (end[0] - start[0])) * (height - 1)
        xs = (start[1] + steps[1] * (end[1] - start[1])) * (width - 1)
        return ("zoom", ys, xs), flip
    return None, flip


def keyed_crop_and_flip(image, augmentation, image_size, rng):
    """The crop and flip of one example (`crop_draws`), applied with NumPy."""
    crop, flip = crop_draws(augmentation, image_size, rng)
    if crop is not None and crop[0] == "pad":
        image = _window_of_padded(image, augmentation.crop_padding, *crop[1:], *image_size)
    elif crop is not None:
        image = sample_bilinear(image, *crop[1:])
    return image[:, ::-1] if flip else image


def _window_of_padded(image, pad, top, left, height, width):
    """`np.pad(image, pad)[top:top + height, left:left + width]` (zero padding), without
    building the padded image (a copy of every example, the costly part of a batch)."""
    y, x = top - pad, left - pad  # the window's corner in the unpadded image
    rows = slice(max(y, 0), min(y + height, image.shape[0]))
    cols = slice(max(x, 0), min(x + width, image.shape[1]))
    window = np.zeros((height, width, image.shape[-1]), image.dtype)
    window[rows.start - y:rows.stop - y, cols.start - x:cols.stop - x] = image[rows, cols]
    return window
