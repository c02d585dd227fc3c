"""The input pipeline without TensorFlow: digits and image folders as `keras.utils.PyDataset`.

`keras.utils.PyDataset` is the loader Keras' `fit` accepts on every backend, so a JAX
or PyTorch user trains on the bundled digits or on a folder of images without
installing TensorFlow. Its functions are those of
`keras_vitnorm.training.data.tf_pipeline` (`eval_batches`, `train_batches`,
`errors_named`), and it gives the batches `keras_vitnorm.training.data` describes:

- Images are decoded with Pillow (the folder's files) and resized with the
  half-pixel bilinear interpolation of `tf.image.resize` (written out in NumPy below,
  because Pillow's bilinear filter smooths when it shrinks and TensorFlow's does not),
  so an evaluation batch is the tf.data pipeline's, to float32 rounding (within one
  grey level where a colour file is read as grayscale: TensorFlow's decoders and
  Pillow weight the channels differently; within 4 levels for a JPEG, which
  TensorFlow decodes with the fast inverse DCT and Pillow with libjpeg's accurate one).
- Each pass over the training split is a permutation drawn with the seed
  `(seed, pass)`; crops and flips are drawn with the seed `(seed, position in the
  stream)`. A stream started at any step is the uninterrupted stream from that step,
  so a resumed run is exact, as with tf.data. (The draws are NumPy's, not
  TensorFlow's: a seed gives other batches here than under tf.data.)
- RandAugment, MixUp and CutMix are the same Keras layers as under tf.data, computed
  with the backend's ops. RandAugment is applied to each image on its own, as tf.data
  applies it before batching (`PerImageRandAugment`); MixUp and CutMix to the batch.
  Their draws are keyed too, by the image's position and by the step
  (`keras_vitnorm.training.data.augmentation.seed_states`), so a resumed stream is
  exact with them as well.

One process reads the batches in the training loop (no worker threads): decoding a
batch of CIFAR-sized JPEGs takes milliseconds against a training step of hundreds on
a CPU (`benchmarks/bench_input.py` measures both), and a training split's decoded
images are kept in memory up to 2 GiB (Imagenette's at 224 px take 1.3 GB), which
keeps a GPU fed.
"""

import contextlib
import math

import keras
import numpy as np

from keras_vitnorm import backend
from keras_vitnorm.ops import fast_path_enabled
from keras_vitnorm.training.data.augmentation import BATCH_MIXING
from keras_vitnorm.training.data.augmentation import RANDAUGMENT
from keras_vitnorm.training.data.augmentation import count_histograms_with_bincount
from keras_vitnorm.training.data.augmentation import randaugment
from keras_vitnorm.training.data.augmentation import seed_states
from keras_vitnorm.training.data.image_files import unreadable_file_error

NAME = "python"


def eval_batches(data, split, image_size, channels, batch_size, pad=False):
    """`EvalBatches` of a split (`keras_vitnorm.training.data.eval_dataset`)."""
    return EvalBatches(data, split, image_size, channels, batch_size, pad)


def train_batches(data, image_size, channels, batch_size, seed, augmentation, start_step, end_step,
                  shuffle_buffer, share):
    """`TrainBatches` of the training split (`keras_vitnorm.training.data.train_stream`);
    each pass is shuffled whole, so `shuffle_buffer` does not apply."""
    return TrainBatches(data, image_size, channels, batch_size, seed, augmentation, start_step,
                        end_step, share)


def errors_named(data):
    """Nothing to translate: Pillow's errors name their file already (`load_image`)."""
    return contextlib.nullcontext()


def load_image(path, channels):
    """The image file at `path` as uint8 `(height, width, channels)`, decoded by Pillow.

    A 16-bit image becomes its values' high bytes, as TensorFlow's decoders make it.

    Raises:
        ValueError: naming the file, if Pillow cannot decode it.
    """
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

    return _sample_bilinear(image, centres(size[0], height), centres(size[1], width))


def _sample_bilinear(image, ys, xs):
    """`image` sampled at the grid `ys x xs` (pixel coordinates) bilinearly; points
    outside the image are 0, as `tf.image.crop_and_resize` gives them."""
    height, width = image.shape[:2]

    def taps(x, size):
        low = np.floor(x).astype(np.int64)
        weight = (x - low).astype(np.float32)
        return np.clip(low, 0, size - 1), np.clip(low + 1, 0, size - 1), weight

    top, bottom, dy = taps(ys, height)
    left, right, dx = taps(xs, width)
    rows = image[top] * (1 - dy)[:, None, None] + image[bottom] * dy[:, None, None]
    out = rows[:, left] * (1 - dx)[None, :, None] + rows[:, right] * dx[None, :, None]
    inside = ((ys >= 0) & (ys <= height - 1))[:, None] & ((xs >= 0) & (xs <= width - 1))[None, :]
    return out * inside[..., None]


def keyed_crop_and_flip(image, augmentation, image_size, rng):
    """The crop and flip of one example, drawn from `rng` (seeded by its position).

    The transformations of `keras_vitnorm.training.data.tf_pipeline._keyed_augmentation`:
    `pad` zero-pads by `crop_padding` and takes a random `image_size` window; `zoom` zooms in about the
    centre by a random factor in `[1 - zoom, 1]` per axis (bilinear, as
    `tf.image.crop_and_resize` samples); `flip` mirrors half of the images.
    """
    height, width = image_size
    crop_draws, flip_draw = rng.random(2), rng.random()
    if augmentation.crop == "pad":
        pad = augmentation.crop_padding
        top = min(int(crop_draws[0] * (2 * pad + 1)), 2 * pad)
        left = min(int(crop_draws[1] * (2 * pad + 1)), 2 * pad)
        image = _window_of_padded(image, pad, top, left, height, width)
    elif augmentation.crop == "zoom":
        scale = 1.0 - augmentation.zoom + augmentation.zoom * crop_draws
        start, end = 0.5 - scale / 2, 0.5 + scale / 2
        # crop_and_resize's sampling grid: box corners on the first and last pixel centres.
        steps = np.arange(height) / max(height - 1, 1), np.arange(width) / max(width - 1, 1)
        ys = (start[0] + steps[0] * (end[0] - start[0])) * (height - 1)
        xs = (start[1] + steps[1] * (end[1] - start[1])) * (width - 1)
        image = _sample_bilinear(image, ys, xs)
    if augmentation.flip and flip_draw < 0.5:
        image = image[:, ::-1]
    return image


def _window_of_padded(image, pad, top, left, height, width):
    """`np.pad(image, pad)[top:top + height, left:left + width]` (zero padding), without
    building the padded image: `np.pad` took half the time of a batch of kept images."""
    y, x = top - pad, left - pad  # the window's corner in the unpadded image
    rows = slice(max(y, 0), min(y + height, image.shape[0]))
    cols = slice(max(x, 0), min(x + width, image.shape[1]))
    window = np.zeros((height, width, image.shape[-1]), image.dtype)
    window[rows.start - y:rows.stop - y, cols.start - x:cols.stop - x] = image[rows, cols]
    return window


#: Decoded training images are kept in memory up to this many bytes (a split's
#: evaluation batches, float32, when they take less): Imagenette's 8,522 training
#: images at 224 px take 1.3 GB as uint8.
KEEP_DECODED_BYTES = 2 * 2**30


class _Images:
    """Reads example `i` of a split as a float32 model-size image in [0, 255].

    A split's decoded images are kept (as tf.data's `cache()` would) while they take
    at most `KEEP_DECODED_BYTES`: as the decoder's uint8 where the file is at the
    model's size already, as the resized float32 image otherwise; the images past the
    bound are decoded at every read. CIFAR-10 batches come 8 times faster from the kept
    images than from the files (docs/performance.md, "Input pipeline"), and a training
    split is read once per pass.
    """

    def __init__(self, data, split, image_size, channels, keep_decoded=True):
        self.raws, self.labels = split.arrays
        self.folder = data.kind == "folder"
        self.image_size = tuple(image_size)
        self.channels = channels
        self.fits = split.size * math.prod(self.image_size) * channels * 4 < KEEP_DECODED_BYTES
        self.keep = keep_decoded
        self.decoded = {}
        self.kept_bytes = 0

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


class EvalBatches(keras.utils.PyDataset):
    """Batched `(images, one-hot labels[, weights])` of a split, in order
    (`data.eval_dataset`). The batches, not the decoded images, are kept in memory when
    the split's decoded images would be (`_Images`)."""

    def __init__(self, data, split, image_size, channels, batch_size, pad=False):
        super().__init__()
        self.read = _Images(data, split, image_size, channels, keep_decoded=False)
        self.num_classes = data.num_classes
        self.size, self.batch_size, self.pad = split.size, batch_size, pad
        self.cache = {}

    @property
    def num_batches(self):
        return math.ceil(self.size / self.batch_size)

    def __len__(self):
        return self.num_batches

    def __getitem__(self, index):
        if index in self.cache:
            return self.cache[index]
        indices = np.arange(index * self.batch_size, min((index + 1) * self.batch_size, self.size))
        images = np.stack([self.read(i) for i in indices]) / np.float32(127.5) - 1.0
        labels = self.read.one_hot(indices, self.num_classes)
        batch = (images.astype(np.float32), labels)
        if self.pad:  # whole batches of blanks with weight 0 (data.eval_dataset)
            blanks = self.batch_size - len(indices)
            weights = np.concatenate([np.ones(len(indices)), np.zeros(blanks)]).astype(np.float32)
            batch = tuple(np.concatenate([part, np.zeros((blanks, *part.shape[1:]), part.dtype)])
                          for part in batch) + (weights,)
        if self.read.fits:
            self.cache[index] = batch
        return batch


class TrainBatches(keras.utils.PyDataset):
    """Augmented training batches of steps `start_step` up to `end_step`
    (`data.train_stream`)."""

    def __init__(self, data, image_size, channels, batch_size, seed, augmentation,
                 start_step, end_step, share=(0, 1)):
        super().__init__()
        self.read = _Images(data, data.train, image_size, channels)
        self.num_classes = data.num_classes
        self.size = data.train.size
        self.image_size = tuple(image_size)
        self.batch_size, self.seed, self.augmentation = batch_size, seed, augmentation
        self.start_step, self.end_step = start_step, end_step
        index, count = share
        local = batch_size // count
        self.share = slice(index * local, (index + 1) * local)
        self.orders = {}
        self.randaugment = (PerImageRandAugment(augmentation, channels, seed, self.image_size)
                            if augmentation.randaugment_ops else None)
        self.batch_augment = _batch_augmentation(augmentation, seed)

    @property
    def num_batches(self):
        return self.end_step - self.start_step

    def __len__(self):
        return self.num_batches

    def _order(self, pass_index):
        if pass_index not in self.orders:
            self.orders = {k: v for k, v in self.orders.items() if k >= pass_index - 1}
            rng = np.random.default_rng([self.seed, pass_index])
            self.orders[pass_index] = rng.permutation(self.size)
        return self.orders[pass_index]

    def example(self, position):
        """The augmented image and the example index at `position` in the stream."""
        pass_index, offset = divmod(int(position), self.size)
        index = self._order(pass_index)[offset]
        rng = np.random.default_rng([self.seed, int(position)])
        image = keyed_crop_and_flip(self.read(index), self.augmentation, self.image_size, rng)
        return image, index

    def __getitem__(self, step_index):
        step = self.start_step + step_index
        positions = np.arange(step * self.batch_size, (step + 1) * self.batch_size)[self.share]
        images, indices = zip(*(self.example(p) for p in positions))
        images = np.stack(images).astype(np.float32)
        if self.randaugment is not None:
            images = self.randaugment(images, positions)
        return self.batch_augment(images, self.read.one_hot(np.array(indices), self.num_classes),
                                  step)


class PerImageRandAugment:
    """Keras' RandAugment on each image of a batch on its own, its draws keyed by the
    image's position in the stream.

    Keras' layer, called on a batch, draws one pair of operations for the whole batch
    and equalizes each channel with the histogram of the whole batch; RandAugment
    draws both per image, and so does tf.data, which calls the layer on each image
    before batching. Here an image's output is the layer's call on that image alone,
    with the layer's seed generator set to the image's key (`seed_states`): it depends
    on the image and its position only, not on the rest of the batch or on what was
    drawn before, so a resumed stream and each process's share see the same.

    Under JAX the calls are one compiled program over the batch
    (`keras_vitnorm.backend.per_example`, the fast path `per_image_program`; on a GPU
    it runs there); otherwise, and with the fast path off, a call per image.
    Equalization counts its histograms with `bincount` (`bincount_histogram`).
    """

    def __init__(self, augmentation, channels, seed, image_size):
        [self.layer] = randaugment(augmentation, channels, seed)
        self.layer.build((None, *image_size, channels))
        if fast_path_enabled("bincount_histogram"):
            count_histograms_with_bincount(getattr(self.layer, "equalization", None))
        self.seed = seed
        self.generator = self.layer.generator
        self.program = (backend.per_example(self.layer, self.generator)
                        if fast_path_enabled("per_image_program") else None)

    def __call__(self, images, positions):
        """`images` (float32 `(n, height, width, channels)` in [0, 255]) augmented, the
        `i`-th keyed by the stream position `positions[i]`."""
        keys = seed_states(self.seed, RANDAUGMENT, positions, self.generator.state.dtype)
        if self.program is not None:
            return keras.ops.convert_to_numpy(self.program(images, keys)).astype(np.float32)
        out = np.empty_like(images)
        for i, (image, key) in enumerate(zip(images, keys)):
            self.generator.state.assign(key)
            out[i] = keras.ops.convert_to_numpy(self.layer(image, training=True))
        return out


def _batch_augmentation(augmentation, seed):
    """MixUp and CutMix as Keras layers on a batch, their draws keyed by the step, then
    the model's [-1, 1] range."""
    mixup = keras.layers.MixUp(alpha=augmentation.mixup, seed=seed) if augmentation.mixup else None
    cutmix = (keras.layers.CutMix(factor=augmentation.cutmix, seed=seed) if augmentation.cutmix
              else None)

    def augment(images, labels, step):
        layer = mixup or cutmix
        if mixup and cutmix:  # one of them per batch, with probability 1/2 (as timm does)
            layer = mixup if np.random.default_rng([seed, 1, step]).random() < 0.5 else cutmix
        if layer is not None:
            state = layer.generator.state
            state.assign(seed_states(seed, BATCH_MIXING, [step], state.dtype)[0])
            out = layer({"images": images, "labels": labels})
            images, labels = (keras.ops.convert_to_numpy(out[k]) for k in ("images", "labels"))
        return (images / np.float32(127.5) - 1.0).astype(np.float32), labels.astype(np.float32)

    return augment
