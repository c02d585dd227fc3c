"""Datasets and their input pipelines, tf.data or without TensorFlow (docs/training.md,
"Datasets"), for `keras-vitnorm train` and `evaluate`."""

import numpy as np

from keras_vitnorm.choices import INPUT_PIPELINES
from keras_vitnorm.training.data import python_pipeline
from keras_vitnorm.training.data import sources
from keras_vitnorm.training.data import tf_pipeline
from keras_vitnorm.training.data.augmentation import Augmentation
from keras_vitnorm.training.data.augmentation import resumes_exactly
from keras_vitnorm.training.data.sources import DATASET_CHOICES
from keras_vitnorm.training.data.sources import IMAGE_EXTENSIONS
from keras_vitnorm.training.data.sources import Dataset
from keras_vitnorm.training.data.sources import Split
from keras_vitnorm.training.data.sources import parse_dataset
from keras_vitnorm.training.data.sources import subset
from keras_vitnorm.validation import check_choice
from keras_vitnorm.validation import check_positive_int

__all__ = [
    "Augmentation", "DATASET_CHOICES", "Dataset", "IMAGE_EXTENSIONS", "Split", "check_pipeline",
    "eval_arrays", "eval_dataset", "load_dataset", "padded_size", "parse_dataset",
    "resumes_exactly", "subset", "train_stream", "unreadable_images_named",
]

_PIPELINES = {module.NAME: module for module in (tf_pipeline, python_pipeline)}


def load_dataset(spec, val_fraction=0.1, data_dir=None, manual_dir=None, train_examples=None,
                 skip_bad_images=False, val_examples=None, pipeline="auto"):
    """Loads the train, validation and test splits of a dataset as a `Dataset`.

    Args:
        spec: `"digits"`, `"tfds:<name>"` or `"folder:<path>"`.
        val_fraction: float in (0, 1), held out for validation where the source has none.
        data_dir, manual_dir: tfds data directory; manually downloaded archives.
        train_examples: int or None. Train on a subset of this many examples:
            class-stratified with seed 0 (tfds: the first ones).
        skip_bad_images: bool. Leave a folder's unreadable files out instead of raising.
        val_examples: int or None. Validate on this many training examples, taken
            apart from the `train_examples` (VTAB-1k's `train800` and `val200`; tfds:
            the next ones), instead of the source's validation split.
        pipeline: `"auto"` (tf.data where TensorFlow is installed, else `"python"`),
            `"tf.data"` or `"python"` (digits and folders).
    """
    if isinstance(val_fraction, bool) or not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}.")
    for name, value in (("train_examples", train_examples), ("val_examples", val_examples)):
        if value is not None:
            check_positive_int(name, value)
    kind, argument = parse_dataset(spec)
    pipeline = _PIPELINES[check_pipeline(pipeline, spec)]
    if pipeline is tf_pipeline:
        tf_pipeline.import_tensorflow()  # says how to install TensorFlow, or to use 'python'
    if kind == "digits":
        data = sources.digits(val_fraction)
    elif kind == "tfds":
        from keras_vitnorm.training.data import tfds_source

        data = tfds_source.classification(argument, val_fraction, data_dir, manual_dir)
    else:
        data = sources.folder(argument, val_fraction, skip_bad_images)
    if val_examples is not None:
        count = data.train.size - val_examples if train_examples is None else train_examples
        if count < 1:
            raise ValueError(
                f"val_examples={val_examples} leaves no training examples of the {data.train.size} "
                f"in {spec} ({data.train.name})."
            )
        pool = sources.train_subset(data.train, count + val_examples, name=spec)
        data.train, data.validation = sources.split_off(pool, val_examples)
    elif train_examples is not None:
        data.train = sources.train_subset(data.train, train_examples, name=spec)
    data.pipeline = pipeline
    return data


def check_pipeline(pipeline, spec):
    """The input pipeline, `"tf.data"` or `"python"`, that `pipeline` names for `spec`;
    a `ValueError` if it is not one of `INPUT_PIPELINES` or cannot read the dataset."""
    check_choice("input_pipeline", pipeline, INPUT_PIPELINES)
    tfds = parse_dataset(spec)[0] == "tfds"
    if pipeline == "auto":
        pipeline = tf_pipeline.NAME if tfds or tf_pipeline.available() else python_pipeline.NAME
    if pipeline == python_pipeline.NAME and tfds:
        raise ValueError(
            f"input_pipeline='python' reads digits and folder datasets; {spec} is read by "
            "tensorflow-datasets through tf.data (input_pipeline='tf.data' or 'auto')."
        )
    return pipeline


def eval_dataset(data, split, image_size, channels, batch_size, pad=False):
    """Batched `(images, one-hot labels)` of a split, in order, no augmentation; with `pad`,
    `(images, labels, weights)`, weight-0 blanks filling the last batch for JAX's processes."""
    return data.pipeline.eval_batches(data, split, image_size, channels, batch_size, pad)


def first_eval_batch(data, split, image_size, channels, count):
    """`(images, one-hot labels)` of the split's first `count` examples as NumPy arrays,
    without the cache (tf.data discards a partly read one with a warning)."""
    batches = data.pipeline.eval_batches(data, split, image_size, channels, count, cache=False)
    images, labels = next(iter(batches))
    return np.asarray(images), np.asarray(labels)


def eval_arrays(data, split, image_size, channels, batch_size=500):
    """`(images, integer labels)` of a split as NumPy arrays, in order (`eval_dataset`)."""
    images, labels = [], []
    for x, y in eval_dataset(data, split, image_size, channels, batch_size):
        images.append(np.asarray(x))
        labels.append(np.argmax(np.asarray(y), axis=-1))
    return np.concatenate(images), np.concatenate(labels)


def padded_size(size, batch_size):
    """`size` rounded up to whole batches of `batch_size` (`eval_dataset(pad=True)`)."""
    return -(-size // batch_size) * batch_size


def train_stream(data, image_size, channels, batch_size, seed, augmentation, start_step=0,
                 end_step=None, shuffle_buffer=50_000, share=(0, 1)):
    """Augmented training batches for steps `start_step` up to `end_step`.

    With `share=(index, count)`, the batches hold this process's `index`-th slice of
    `batch_size // count` examples of each global batch (MixUp and CutMix mix within it).
    Pass `p` is shuffled by a seed of `seed` and `p`, so a resumed run continues with the
    examples it would have seen next (`resumes_exactly`: whether the draws are the same)."""
    end_step = end_step if end_step is not None else start_step + 1_000_000
    return data.pipeline.train_batches(data, image_size, channels, batch_size, seed, augmentation,
                                       start_step, end_step, shuffle_buffer, share)


def unreadable_images_named(data):
    """A context turning a damaged image's decode error into a `ValueError` naming files."""
    return data.pipeline.errors_named(data)
