"""The images of a split as the `python` input pipeline reads them: decoded by Pillow,
resized as TensorFlow resizes, and kept in memory while they fit.

Pillow's bilinear filter smooths when it shrinks and TensorFlow's does not, so the
resize is `tf.image.resize`'s, written out (`bilinear_sampling`): the images are the
tf.data pipeline's to float32 rounding, except where the decoders differ
(docs/training.md, "Datasets").
"""

import math

import numpy as np

from keras_vitnorm.training.data.bilinear_sampling import resize_bilinear
from keras_vitnorm.training.data.image_files import unreadable_file_error


def load_image(path, channels):
    """The image file at `path` as uint8 `(height, width, channels)`, decoded by Pillow;
    a 16-bit image becomes its values' high bytes, as TensorFlow's decoders make it. A
    file Pillow cannot decode is a `ValueError` naming it."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            if image.mode.startswith("I"):  # 16-bit grayscale ("I;16", "I"): its high byte
                # (Pillow's own conversion saturates every value above 255 to white)
                high = np.right_shift(np.clip(np.asarray(image), 0, 65535).astype(np.uint16), 8)
                image = Image.fromarray(high.astype(np.uint8), "L")
            image = image.convert("L" if channels == 1 else "RGB")
            array = np.asarray(image, np.uint8)
    except (OSError, ValueError, SyntaxError) as error:  # Pillow's errors for a damaged file
        raise unreadable_file_error(
            [(str(path), f"does not decode ({type(error).__name__}: {error})")]) from None
    return array.reshape(*array.shape[:2], channels)


#: Decoded training images are kept in memory up to this many bytes (a split's
#: evaluation batches, float32, when they take less): room for Imagenette's training
#: images at 224 px as uint8.
KEEP_DECODED_BYTES = 2 * 2**30


class DecodedImages:
    """Reads example `i` of a split as a float32 model-size image in [0, 255].

    A split's decoded images are kept (as tf.data's `cache()` would) up to
    `KEEP_DECODED_BYTES`, uint8 where the file is at the model's size already; the
    rest are decoded at every read (docs/performance.md, "Input pipeline").
    """

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
