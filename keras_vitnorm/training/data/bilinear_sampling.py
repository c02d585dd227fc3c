"""Bilinear sampling in NumPy as `tf.image.resize` and `tf.image.crop_and_resize` compute
it, for the `python` input pipeline."""

import numpy as np


def resize_bilinear(image, size):
    """`image` `(h, w, c)` resized to `size` as `tf.image.resize(..., "bilinear")` does
    (half-pixel centres, no smoothing when shrinking), in float32."""
    image = np.asarray(image, np.float32)
    height, width = image.shape[:2]
    if (height, width) == tuple(size):
        return image

    def centres(out_size, in_size):
        # Source coordinate of each output pixel centre, clamped to the image.
        x = (np.arange(out_size, dtype=np.float32) + 0.5) * (in_size / out_size) - 0.5
        return np.clip(x, 0.0, in_size - 1)

    return sample_bilinear(image, centres(size[0], height), centres(size[1], width))


def sample_bilinear(image, ys, xs):
    """`image` `(h, w, c)` sampled at the grid `ys x xs` (pixel coordinates) bilinearly;
    points outside the image are 0, as `tf.image.crop_and_resize` gives them."""
    top, bottom, dy, rows_inside = _taps(ys, image.shape[0])
    left, right, dx, columns_inside = _taps(xs, image.shape[1])
    rows = (np.take(image, top, axis=0) * (1 - dy)[:, None, None]
            + np.take(image, bottom, axis=0) * dy[:, None, None])
    out = (np.take(rows, left, axis=1) * (1 - dx)[None, :, None]
           + np.take(rows, right, axis=1) * dx[None, :, None])
    inside = rows_inside[:, None] & columns_inside[None, :]
    return out * inside[..., None]


def _taps(x, size):
    """Each point's two neighbouring indices, the second's weight, and whether it is inside."""
    low = np.floor(x).astype(np.int32)
    weight = (x - low).astype(np.float32)
    inside = (x >= 0) & (x <= size - 1)
    return np.clip(low, 0, size - 1), np.clip(low + 1, 0, size - 1), weight, inside
