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
  exact with them as well. Under JAX a batch's whole augmentation is one compiled
  program on the default device (`TrainBatches`).

One process reads the batches in the training loop (no worker threads): decoding a
batch of CIFAR-sized JPEGs takes milliseconds against a training step of hundreds on
a CPU (`benchmarks/bench_input.py` measures both), and a training split's decoded
images are kept in memory up to 2 GiB (Imagenette's at 224 px take 1.3 GB), which
keeps a GPU fed.
"""

import contextlib
import functools
import math

import keras
import numpy as np

from keras_vitnorm import backend
from keras_vitnorm.ops import fast_path_enabled
from keras_vitnorm.training.data.augmentation import BATCH_MIXING
from keras_vitnorm.training.data.augmentation import batch_mixing
from keras_vitnorm.training.data.augmentation import RANDAUGMENT
from keras_vitnorm.training.data.augmentation import count_histograms_with_bincount
from keras_vitnorm.training.data.augmentation import randaugment
from keras_vitnorm.training.data.augmentation import seed_states
from keras_vitnorm.training.data.image_files import unreadable_file_error
from keras_vitnorm.training.data.model_range import to_model_range

NAME = "python"


def eval_batches(data, split, image_size, channels, batch_size, pad=False, cache=True):
    """`EvalBatches` of a split (`keras_vitnorm.training.data.eval_dataset`)."""
    return EvalBatches(data, split, image_size, channels, batch_size, pad, cache)


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
    return sample_taps(image, sampling_taps(ys, xs, *image.shape[:2]))


def sampling_taps(ys, xs, height, width):
    """What bilinear sampling of a `(height, width)` image at the grid `ys x xs` reads:
    per axis, each point's two neighbouring indices, the second one's weight, and
    whether the point lies inside the image (`sample_taps`)."""

    def taps(x, size):
        low = np.floor(x).astype(np.int32)
        weight = (x - low).astype(np.float32)
        inside = (x >= 0) & (x <= size - 1)
        return np.clip(low, 0, size - 1), np.clip(low + 1, 0, size - 1), weight, inside

    return (*taps(ys, height), *taps(xs, width))


def sample_taps(image, taps, ops=np):
    """`image` `(h, w, c)` sampled bilinearly where `taps` (`sampling_taps`) say, points
    outside it 0; with NumPy, or with `keras.ops` inside a compiled program."""
    top, bottom, dy, rows_inside, left, right, dx, columns_inside = taps
    rows = (ops.take(image, top, axis=0) * (1 - dy)[:, None, None]
            + ops.take(image, bottom, axis=0) * dy[:, None, None])
    out = (ops.take(rows, left, axis=1) * (1 - dx)[None, :, None]
           + ops.take(rows, right, axis=1) * dx[None, :, None])
    inside = rows_inside[:, None] & columns_inside[None, :]
    return out * inside[..., None]


def crop_draws(augmentation, image_size, rng):
    """`(crop, flip)` of one example, drawn from `rng` (seeded by its position).

    The transformations of `keras_vitnorm.training.data.tf_pipeline._keyed_augmentation`:
    `pad` zero-pads by `crop_padding` and takes a random `image_size` window
    (`crop = ("pad", top, left)`, the window's corner in the padded image); `zoom`
    zooms in about the centre by a random factor in `[1 - zoom, 1]` per axis, sampled
    bilinearly at a grid as `tf.image.crop_and_resize` samples (`crop = ("zoom", ys,
    xs)`); otherwise `crop = None`. `flip`: whether the example is mirrored (half of
    them, with `augmentation.flip`).
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
        image = _sample_bilinear(image, *crop[1:])
    return image[:, ::-1] if flip else image


def crop_grid(crop, augmentation, image_size):
    """`(ys, xs)`, the sampling grid of a crop of `crop_draws` in the image's pixel
    coordinates: a pad crop's window is a grid of whole pixels shifted by the padding,
    whose points in the padding lie outside."""
    height, width = image_size
    if crop is None:
        return np.arange(height), np.arange(width)
    if crop[0] == "pad":
        pad = augmentation.crop_padding
        return np.arange(height) + (crop[1] - pad), np.arange(width) + (crop[2] - pad)
    return crop[1:]


def batch_crop_taps(crops, augmentation, image_size):
    """The `sampling_taps` of each crop of `crops`, stacked: each part `(n, size)`.
    `sampling_taps` works elementwise, so the batch's grids go through it at once."""
    grids = [crop_grid(crop, augmentation, image_size) for crop in crops]
    ys = np.stack([grid[0] for grid in grids])
    xs = np.stack([grid[1] for grid in grids])
    return sampling_taps(ys, xs, *image_size)


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
        return self.stored(index).astype(np.float32)

    def stored(self, index):
        """Example `index` as it is kept: uint8 at the model's size where the file was,
        float32 where it was resized."""
        image = self.decoded.get(index)
        if image is None:
            image = self._decode(index)
            if self.keep and self.kept_bytes + image.nbytes <= KEEP_DECODED_BYTES:
                self.decoded[index] = image
                self.kept_bytes += image.nbytes
        return image

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
    the split's decoded images would be (`_Images`), and `keep` is true."""

    def __init__(self, data, split, image_size, channels, batch_size, pad=False, keep=True):
        super().__init__()
        self.read = _Images(data, split, image_size, channels, keep_decoded=False)
        self.num_classes = data.num_classes
        self.size, self.batch_size, self.pad, self.keep = split.size, batch_size, pad, keep
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
        images = to_model_range(np.stack([self.read(i) for i in indices]))
        labels = self.read.one_hot(indices, self.num_classes)
        batch = (images, labels)
        if self.pad:  # whole batches of blanks with weight 0 (data.eval_dataset)
            blanks = self.batch_size - len(indices)
            weights = np.concatenate([np.ones(len(indices)), np.zeros(blanks)]).astype(np.float32)
            batch = tuple(np.concatenate([part, np.zeros((blanks, *part.shape[1:]), part.dtype)])
                          for part in batch) + (weights,)
        if self.keep and self.read.fits:
            self.cache[index] = batch
        return batch


class TrainBatches(keras.utils.PyDataset):
    """Augmented training batches of steps `start_step` up to `end_step`
    (`data.train_stream`).

    Each batch is augmented in three parts: crops and flips, keyed by each example's
    position (`crop_draws`); RandAugment on each image, keyed by its position
    (`PerImageRandAugment`); MixUp or CutMix on the batch, keyed by the step
    (`BatchMixing`); then the model's [-1, 1] range. With NumPy and a layer call per
    image in the plain form; under JAX (the fast path `augmentation_program`) as one
    compiled program on the default device, which takes the kept images as they are
    (uint8 where they were) and the crops' sampling taps drawn here, and gives the
    batch on the device: on a GPU the host only gathers the images.
    """

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
        self.mixing = BatchMixing(augmentation, seed)
        self.compiled = fast_path_enabled("augmentation_program")
        self.programs = {}  # the compiled program for each mixing layer (or None)

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

    def _index(self, position):
        pass_index, offset = divmod(int(position), self.size)
        return self._order(pass_index)[offset]

    def _rng(self, position):
        """The generator that draws the crop and flip of the example at `position`."""
        return np.random.default_rng([self.seed, int(position)])

    def example(self, position):
        """The cropped and flipped image (NumPy) and the example index at `position` in
        the stream."""
        index = self._index(position)
        image = keyed_crop_and_flip(self.read(index), self.augmentation, self.image_size,
                                    self._rng(position))
        return image, index

    def _positions(self, step_index):
        """The step of batch `step_index` and the stream positions of its examples."""
        step = self.start_step + step_index
        return step, np.arange(step * self.batch_size, (step + 1) * self.batch_size)[self.share]

    def __getitem__(self, step_index):
        step, positions = self._positions(step_index)
        layer = self.mixing.layer(step)
        program = self._program(layer)
        if program is None:
            images, indices = zip(*(self.example(p) for p in positions))
            images = np.stack(images).astype(np.float32)
            if self.randaugment is not None:
                images = self.randaugment(images, positions)
            labels = self.read.one_hot(np.array(indices), self.num_classes)
            images, labels = self.mixing(layer, images, labels, step)
            return clipped_to_model_range(images), labels
        return self.augment(step_index, self.program_inputs(step_index))

    @property
    def has_program(self):
        """Whether the batches come from the compiled augmentation program (the fast
        path `augmentation_program`, under JAX)."""
        return self._program(self.mixing.layer(self.start_step)) is not None

    def program_inputs(self, step_index):
        """What the host gives the augmentation program for batch `step_index`: the
        kept images as they are, the crops' stacked sampling taps, the flips, the
        RandAugment keys, the one-hot labels and the mixing key (the host's whole part
        of a batch, which `benchmarks/bench_input.py` times on its own)."""
        step, positions = self._positions(step_index)
        layer = self.mixing.layer(step)
        indices = np.array([self._index(p) for p in positions])
        kept = [self.read.stored(i) for i in indices]
        images = np.stack(kept) if len({k.dtype for k in kept}) == 1 else np.stack(
            [k.astype(np.float32) for k in kept])
        draws = [crop_draws(self.augmentation, self.image_size, self._rng(p)) for p in positions]
        taps = batch_crop_taps([crop for crop, _ in draws], self.augmentation, self.image_size)
        flips = np.array([flip for _, flip in draws])
        keys = (self.randaugment.keys(positions) if self.randaugment is not None
                else np.zeros((len(positions), 2), np.int32))
        mix_key = self.mixing.key(layer, step)
        return images, taps, flips, keys, self.read.one_hot(indices, self.num_classes), mix_key

    def augment(self, step_index, inputs):
        """Batch `step_index` from its `program_inputs` (NumPy, or already on the
        device): the device's whole part of a batch, which `benchmarks/bench_input.py`
        times on its own."""
        return self.program(step_index)(*inputs)

    def program(self, step_index):
        """The compiled program that augments batch `step_index` from its
        `program_inputs` (`jax.jit`'s function: one for each mixing layer), or `None`
        where there is none (`has_program`)."""
        step, _ = self._positions(step_index)
        return self._program(self.mixing.layer(step))

    def _program(self, layer):
        """The compiled augmentation of a batch mixed by `layer` (`None`: no mixing), or
        `None` where there is none (the fast path is off, or not JAX)."""
        if not self.compiled:
            return None
        name = None if layer is None else layer.name
        if name not in self.programs:
            image_values = math.prod(self.image_size) * self.read.channels

            randaugment = self.randaugment

            def augment(images, taps, flips, keys, labels, mix_key):
                def one(image, taps, flip, key):
                    image = sample_taps(keras.ops.cast(image, "float32"), taps, keras.ops)
                    image = keras.ops.where(flip, keras.ops.flip(image, axis=1), image)
                    if randaugment is None:
                        return image
                    return image, randaugment.drawn_arrays(randaugment.draws(image, key))

                images = backend.map_examples(one, images, taps, flips, keys,
                                              chunk=max(1, CHUNK_VALUES // image_values))
                # RandAugment's chosen operations one image at a time: there a switch runs
                # the chosen operation alone; mapped over a chunk it would compute all
                # eleven and select.
                if randaugment is not None:
                    cropped, _ = images  # the draws of one image: the static parts
                    template = randaugment.draws(cropped[0], keys[0])
                    images = backend.map_examples(
                        lambda image, arrays: randaugment.apply_chosen(
                            image, randaugment.with_arrays(template, arrays)),
                        *images)
                images, labels = self.mixing.keyed(layer, images, labels, mix_key)
                return clipped_to_model_range(images), labels

            self.programs[name] = backend.compiled(augment)
        return self.programs[name]


#: Values (pixels x channels) the augmentation program crops, flips and draws
#: RandAugment's parameters for at once (13 images at 224 px, a whole batch at 32 px):
#: the chunk bounds the program's temporary memory.
CHUNK_VALUES = 2**21


def clipped_to_model_range(images):
    """`to_model_range` of augmented images (NumPy, or traced in the program), clipped
    to [-1, 1]: a compiled program may divide by multiplying with the reciprocal, which
    takes 255 to 1.0000001."""
    if isinstance(images, np.ndarray):
        return np.clip(to_model_range(images.astype(np.float32)), -1.0, 1.0)
    return keras.ops.clip(to_model_range(keras.ops.cast(images, "float32")), -1.0, 1.0)


def _python_number(value):
    return isinstance(value, (bool, int, float))


class PerImageRandAugment:
    """Keras' RandAugment on each image of a batch on its own, its draws keyed by the
    image's position in the stream.

    Keras' layer, called on a batch, draws one pair of operations for the whole batch
    and equalizes each channel with the histogram of the whole batch; RandAugment
    draws both per image, and so does tf.data, which calls the layer on each image
    before batching. Here an image's output is the layer's call on that image alone,
    with the layer's seed generator set to the image's key (`seed_states`): it depends
    on the image and its position only, not on the rest of the batch or on what was
    drawn before, so a resumed stream and each process's share see the same. The
    draws are the layer's own (`get_random_transformation`); of its operations only
    those chosen, one per slot, run (`apply_chosen`), each on a copy: the layer's
    output where Keras computes it right (JAX, TensorFlow), without the brightening
    that its call adds to every image under PyTorch. Equalization counts its
    histograms with `bincount` (`bincount_histogram`).
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
        call, not a variable, so this also runs inside a compiled program)."""
        return self.apply_chosen(image, self.draws(image, key))

    def draws(self, image, key):
        """What Keras' layer draws for `image` with its generator at `key`: each slot's
        operation and every operation's parameters (`get_random_transformation`)."""
        with keras.StatelessScope(state_mapping=[(self.generator.state, key)]):
            return self.layer.get_random_transformation(image, training=True)

    @staticmethod
    def drawn_arrays(draws):
        """The arrays of `draws`, in order: what a compiled program can pass from one
        map over images to the next (the rest, the image's sizes, are Python numbers,
        the same for every image)."""
        return [leaf for leaf in keras.tree.flatten(draws) if not _python_number(leaf)]

    @staticmethod
    def with_arrays(template, arrays):
        """`template` (the draws of any image of the batch) with `arrays` in place of
        its arrays."""
        arrays = iter(arrays)
        leaves = [leaf if _python_number(leaf) else next(arrays)
                  for leaf in keras.tree.flatten(template)]
        return keras.tree.pack_sequence_as(template, leaves)

    def apply_chosen(self, image, draws):
        """`image` through the operation each slot chose, as Keras' layer computes it
        but with a switch in place of its `where` over all eleven operations. Where
        the choice is one number (not mapped over a batch), only the chosen
        operation's transform runs; each gets a copy of the image, since Keras'
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

    def keyed(self, layer, images, labels, key):
        """The same inside a compiled program, the generator's state `key` for the call."""
        if layer is None:
            return images, labels
        with keras.StatelessScope(state_mapping=[(layer.generator.state, key)]):
            out = layer({"images": images, "labels": labels})
        return out["images"], out["labels"]
