"""The input pipeline without TensorFlow: digits and image folders as `keras.utils.PyDataset`.

The functions are those of `tf_pipeline`; evaluation batches equal tf.data's to float32
rounding, and training batches are keyed by position and step, so a resumed stream is
exact, though a seed draws other batches than under tf.data. Read in the training loop,
one process, no worker threads (docs/performance.md, "Input pipeline").
"""

import contextlib
import math

import keras
import numpy as np

from keras_vitnorm.training.data.decoded_images import DecodedImages
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

    Crops and flips (`crop_draws`) and RandAugment (`PerImageRandAugment`) are keyed by
    each example's position, MixUp or CutMix (`BatchMixing`) by the step.
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
        images, indices = zip(*(self.example(p) for p in positions))
        images = np.stack(images).astype(np.float32)
        if self.randaugment is not None:
            images = self.randaugment(images, positions)
        labels = self.read.one_hot(np.array(indices), self.num_classes)
        images, labels = self.mixing(layer, images, labels, step)
        return clipped_to_model_range(images), labels

def clipped_to_model_range(images):
    """`to_model_range` of augmented float32 images, clipped to [-1, 1], the range the
    model takes."""
    return np.clip(to_model_range(images.astype(np.float32)), -1.0, 1.0)
