"""The images of a split as the `python` input pipeline reads them: decoded by Pillow,
resized as `tf.image.resize` does (Pillow's filter smooths) and kept while they fit."""

import math

import numpy as np

from keras_vitnorm.training.data.bilinear_sampling import resize_bilinear
from keras_vitnorm.training.data.image_files import unreadable_file_error


def load_image(path, channels):
    """The image file at `path` as uint8 `(height, width, channels)` (16-bit: the high
    bytes, as TensorFlow's decoders make it); a `ValueError` naming it if it does not decode."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            if image.mode.startswith("I"):  # 16-bit: Pillow's convert would saturate at 255
                high = np.right_shift(np.clip(np.asarray(image), 0, 65535).astype(np.uint16), 8)
                image = Image.fromarray(high.astype(np.uint8), "L")
            image = image.convert("L" if channels == 1 else "RGB")
            array = np.asarray(image, np.uint8)
    except (OSError, ValueError, SyntaxError) as error:  # Pillow's errors for a damaged file
        raise unreadable_file_error(
            [(str(path), f"does not decode ({type(error).__name__}: {error})")]) from None
    return array.reshape(*array.shape[:2], channels)


#: Decoded training images (and evaluation batches, when they would take less) are kept
#: in memory up to this many bytes.
KEEP_DECODED_BYTES = 2 * 2**30


class DecodedImages:
    """Reads example `i` of a split as a float32 model-size image in [0, 255], keeping
    decoded images up to `KEEP_DECODED_BYTES` (uint8 where already at the model's size)."""

    def __init__(self, data, split, image_size, channels, keep_decoded=True):
        self.raws, self.labels = split.arrays
        self.folder = data.kind == "folder"
        self.image_size, self.channels = tuple(image_size), channels
        self.fits = split.size * math.prod(self.image_size) * channels * 4 < KEEP_DECODED_BYTES
        self.keep, self.decoded, self.kept_bytes = keep_decoded, {}, 0

    def __call__(self, index):
        image = self.decoded.get(index)
        if image is None:
            image = self._decode(index)
            if self.keep and self.kept_bytes + image.nbytes <= KEEP_DECODED_BYTES:
                self.decoded[index] = image
                self.kept_bytes += image.nbytes
        return image.astype(np.float32)

    def _decode(self, index):
        raw = self.raws[index]
        image = load_image(raw, self.channels) if self.folder else np.asarray(raw)
        if image.shape[-1] != self.channels:  # digits (1 channel) for an RGB model
            image = np.repeat(image, self.channels, axis=-1)
        if image.dtype == np.uint8 and image.shape[:2] == self.image_size:
            return image  # the resize would be the identity: kept at a quarter of the size
        return np.clip(resize_bilinear(image, self.image_size), 0.0, 255.0)

    def one_hot(self, indices, num_classes):
        return np.eye(num_classes, dtype=np.float32)[self.labels[indices]]
