"""The crops and flips of the `python` input pipeline, with NumPy: those of
`tf_pipeline._keyed_augmentation`, drawn from a generator seeded by stream position."""

import numpy as np

from keras_vitnorm.training.data.bilinear_sampling import sample_bilinear


def keyed_crop_and_flip(image, augmentation, image_size, rng):
    """The crop and flip of one example, drawn from `rng` (seeded by its position)."""
    height, width = image_size
    draws, flip_draw = rng.random(2), rng.random()
    if augmentation.crop == "pad":
        pad = augmentation.crop_padding
        top, left = (min(int(draw * (2 * pad + 1)), 2 * pad) for draw in draws)
        image = _window_of_padded(image, pad, top, left, height, width)
    elif augmentation.crop == "zoom":
        scale = 1.0 - augmentation.zoom + augmentation.zoom * draws
        start, end = 0.5 - scale / 2, 0.5 + scale / 2
        # crop_and_resize's sampling grid: box corners on the first and last pixel centres.
        ys, xs = ((start[axis] + np.arange(size) / max(size - 1, 1) * (end[axis] - start[axis]))
                  * (size - 1) for axis, size in enumerate(image_size))
        image = sample_bilinear(image, ys, xs)
    return image[:, ::-1] if augmentation.flip and flip_draw < 0.5 else image


def _window_of_padded(image, pad, top, left, height, width):
    """`np.pad(image, pad)[top:top + height, left:left + width]` without building the
    padded image (a copy of every example, the costly part of a batch)."""
    y, x = top - pad, left - pad  # the window's corner in the unpadded image
    rows = slice(max(y, 0), min(y + height, image.shape[0]))
    cols = slice(max(x, 0), min(x + width, image.shape[1]))
    window = np.zeros((height, width, image.shape[-1]), image.dtype)
    window[rows.start - y:rows.stop - y, cols.start - x:cols.stop - x] = image[rows, cols]
    return window
