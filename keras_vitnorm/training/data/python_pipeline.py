"""The input pipeline without TensorFlow: digits and image folders as `keras.utils.PyDataset`.

`PyDataset` is the loader Keras' `fit` accepts on every backend, so a JAX or PyTorch
user trains on digits or a folder of images without TensorFlow. Its functions are
those of `tf_pipeline` (`eval_batches`, `train_batches`, `errors_named`), and its
batches those `keras_vitnorm.training.data` describes: evaluation batches are the
tf.data pipeline's to float32 rounding (`decoded_images`); training batches are
crops and flips keyed by each example's position (`keyed_crops`), RandAugment on
each image and MixUp or CutMix on the batch keyed by position and step
(`keyed_layers`), so a resumed stream is exact; under JAX one compiled program per
batch (`TrainBatches`). A seed draws other batches here than under tf.data (NumPy's
generators, not TensorFlow's).

The batches are read in the training loop, one process, no worker threads: decoding
is far quicker than a step, and the decoded images are kept in memory while they fit
(docs/performance.md, "Input pipeline").
"""

import contextlib
import math

import keras
import numpy as np

from keras_vitnorm import backend
from keras_vitnorm.ops import fast_path_enabled
from keras_vitnorm.training.data.bilinear_sampling import sample_taps
from keras_vitnorm.training.data.decoded_images import DecodedImages
from keras_vitnorm.training.data.keyed_crops import batch_crop_taps
from keras_vitnorm.training.data.keyed_crops import crop_draws
from keras_vitnorm.training.data.keyed_crops import keyed_crop_and_flip
from keras_vitnorm.training.data.keyed_layers import BatchMixing
from keras_vitnorm.training.data.keyed_layers import PerImageRandAugment
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
    """Nothing to translate: Pillow's errors name their file already
    (`decoded_images.load_image`)."""
    return contextlib.nullcontext()


class EvalBatches(keras.utils.PyDataset):
    """Batched `(images, one-hot labels[, weights])` of a split, in order
    (`data.eval_dataset`). The batches, not the decoded images, are kept in memory when
    the split's decoded images would be (`DecodedImages`), and `keep` is true."""

    def __init__(self, data, split, image_size, channels, batch_size, pad=False, keep=True):
        super().__init__()
        self.read = DecodedImages(data, split, image_size, channels, keep_decoded=False)
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
        self.read = DecodedImages(data, data.train, image_size, channels)
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
