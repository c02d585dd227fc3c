"""The input pipeline without TensorFlow: digits and image folders as `keras.utils.PyDataset`,
with the functions of `tf_pipeline` (docs/training.md, "Datasets")."""

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


def errors_named(data):
    """Nothing to translate: Pillow's errors name their file already (`load_image`)."""
    return contextlib.nullcontext()


class EvalBatches(keras.utils.PyDataset):
    """Batched `(images, one-hot labels[, weights])` of a split (`data.eval_dataset`); with
    `cache`, the batches are kept where the decoded images would fit (`DecodedImages`)."""

    def __init__(self, data, split, image_size, channels, batch_size, pad=False, cache=True):
        super().__init__()
        self.read = DecodedImages(data, split, image_size, channels, keep_decoded=False)
        self.num_classes = data.num_classes
        self.size, self.batch_size, self.pad = split.size, batch_size, pad
        self.cache, self.kept = cache, {}

    def __len__(self):
        return math.ceil(self.size / self.batch_size)

    def __getitem__(self, index):
        if index in self.kept:
            return self.kept[index]
        indices = np.arange(index * self.batch_size, min((index + 1) * self.batch_size, self.size))
        images = to_model_range(np.stack([self.read(i) for i in indices]))
        batch = (images, self.read.one_hot(indices, self.num_classes))
        if self.pad:  # weight-0 blanks fill the last batch
            blanks = self.batch_size - len(indices)
            batch = tuple(np.pad(part, [(0, blanks)] + [(0, 0)] * (part.ndim - 1))
                          for part in (*batch, np.ones(len(indices), np.float32)))
        if self.cache and self.read.fits:
            self.kept[index] = batch
        return batch


eval_batches = EvalBatches


class TrainBatches(keras.utils.PyDataset):
    """Augmented training batches of steps `start_step` up to `end_step` (`data.train_stream`):
    crops, flips and RandAugment keyed by each example's position, MixUp or CutMix by step.
    Each pass is shuffled whole: `shuffle_buffer` is not used."""

    def __init__(self, data, image_size, channels, batch_size, seed, augmentation,
                 start_step, end_step, shuffle_buffer=None, share=(0, 1)):
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

    def __len__(self):
        return self.end_step - self.start_step

    def _order(self, pass_index):
        if pass_index not in self.orders:
            self.orders = {k: v for k, v in self.orders.items() if k >= pass_index - 1}
            rng = np.random.default_rng([self.seed, pass_index])
            self.orders[pass_index] = rng.permutation(self.size)
        return self.orders[pass_index]

    def example(self, position):
        """The cropped and flipped image and the example index at stream `position`."""
        pass_index, offset = divmod(int(position), self.size)
        index = self._order(pass_index)[offset]
        rng = np.random.default_rng([self.seed, int(position)])
        return keyed_crop_and_flip(self.read(index), self.augmentation, self.image_size, rng), index

    def __getitem__(self, step_index):
        step = self.start_step + step_index
        positions = np.arange(step * self.batch_size, (step + 1) * self.batch_size)[self.share]
        images, indices = zip(*(self.example(p) for p in positions))
        images = np.stack(images).astype(np.float32)
        if self.randaugment is not None:
            images = self.randaugment(images, positions)
        labels = self.read.one_hot(np.array(indices), self.num_classes)
        images, labels = self.mixing(images, labels, step)
        return np.clip(to_model_range(images), -1.0, 1.0), labels


train_batches = TrainBatches
