"""Datasets and their input pipelines for `keras-vitnorm train` and `evaluate`.

Three sources, named by a string (`sources`): `"digits"` (scikit-learn's 8x8 digits,
no download), `"tfds:<name>"` and `"folder:<path>"` (class-per-folder images). Two
input pipelines give the same batches in the same form: tf.data (`tf_pipeline`) and
Keras' `PyDataset` without TensorFlow (`python_pipeline`; digits and folders);
`load_dataset` chooses one once and the dataset it returns carries it. Images enter
the model as float32 in [-1, 1]. Splits and pipelines: docs/training.md, "Datasets".
"""

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
        val_fraction: float in (0, 1), held out for validation when the source has
            no validation split.
        data_dir, manual_dir: tfds data directory; manually downloaded archives.
        train_examples: int or None. Train on a subset of this many examples:
            class-stratified with seed 0 (tfds: the first ones).
        skip_bad_images: bool. For folders, unreadable files are left out and listed
            instead of being an error naming them.
        val_examples: int or None. Validate on this many training examples, taken
            apart from the `train_examples` (VTAB-1k's `train800` and `val200`; tfds:
            the next ones), instead of the source's validation split.
        pipeline: `"auto"` (tf.data where TensorFlow is installed, else `"python"`),
            `"tf.data"` or `"python"` (digits and folders).
    """
    if isinstance(val_fraction, bool) or not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}.")
    for name, value in (("train_examples", train_examples), ("val_examples", val_examples)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
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
    stratified = kind != "tfds"
    if val_examples is not None:
        count = data.train.size - val_examples if train_examples is None else train_examples
        if count < 1:
            raise ValueError(
                f"val_examples={val_examples} leaves no training examples of the {data.train.size} "
                f"in {spec} ({data.train.name})."
            )
        pool = sources.train_subset(data.train, count + val_examples, stratified, name=spec)
        data.train, data.validation = sources.split_off(pool, val_examples, stratified)
    elif train_examples is not None:
        data.train = sources.train_subset(data.train, train_examples, stratified, name=spec)
    data.pipeline = pipeline
    return data


def check_pipeline(pipeline, spec):
    """The input pipeline, `"tf.data"` or `"python"`, that `pipeline` (one of
    `INPUT_PIPELINES`) names for the dataset `spec` (see `load_dataset`); raises a
    `ValueError` naming the value if it is not one, or cannot read the dataset.
    `TrainConfig.validate` and `load_dataset` check with it; nothing is imported."""
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
    """Batched `(images, one-hot labels)` of a split, in order, no augmentation, from
    the dataset's pipeline.

    With `pad`, the split is padded with blank examples to whole batches (which JAX's
    processes need to split each batch) and batches are `(images, labels, weights)`,
    weight 0 for the blanks: a loss averaged over batches is the split's times
    `padded_size(...) / size`.
    """
    return data.pipeline.eval_batches(data, split, image_size, channels, batch_size, pad)


def first_eval_batch(data, split, image_size, channels, count):
    """`(images, one-hot labels)` of the split's first `count` examples as NumPy arrays:
    the first batch of `eval_dataset`, built without its cache, since a cache read only
    in part is discarded (by tf.data, with a warning)."""
    batches = data.pipeline.eval_batches(data, split, image_size, channels, count, cache=False)
    images, labels = next(iter(batches))
    return np.asarray(images), np.asarray(labels)


def eval_arrays(data, split, image_size, channels, batch_size=500):
    """`(images, labels)` of a split as NumPy arrays, in order: the images of
    `eval_dataset` (float32, in [-1, 1]) and integer labels."""
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
    """Augmented training batches for steps `start_step` up to `end_step`, from the
    dataset's pipeline.

    With `share=(index, count)`, the batches hold only this process's share of each
    global batch of `batch_size`: its `index`-th slice of `batch_size // count`
    examples, augmented as in the whole batch (MixUp and CutMix mix within the share).

    Pass `p` is shuffled by a seed made of `seed` and `p`, so the batches are the same sequence
    whatever step the stream starts from: a resumed run continues with the examples it
    would have seen next (`resumes_exactly` says when the augmentation is the same too).
    A batch may span the end of one pass and the start of the next.
    """
    end_step = end_step if end_step is not None else start_step + 1_000_000
    return data.pipeline.train_batches(data, image_size, channels, batch_size, seed, augmentation,
                                       start_step, end_step, shuffle_buffer, share)


def unreadable_images_named(data):
    """A context in which the pipeline's decode error of a damaged image file becomes
    a `ValueError` naming the files that do not decode."""
    return data.pipeline.errors_named(data)
