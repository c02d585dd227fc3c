"""Datasets and their input pipelines for `keras-vitnorm train` and `evaluate`.

Three sources, named by a string:

- `"digits"`: scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes,
  grayscale), upsampled to the model's image size. Needs no download.
- `"tfds:<name>"`: any tensorflow-datasets image-classification dataset
  (`tfds:cifar10`, `tfds:cifar100`, `tfds:imagenette`, `tfds:imagenet2012`, ...).
- `"folder:<path>"`: a user's class-per-folder images (`<path>/<class>/*.jpg`), or a
  folder with `train/` (and optionally `val/` or `validation/`, and `test/`) subfolders
  laid out that way.

Every source gives three splits that never share an example: train, validation (for
model selection and the per-epoch numbers) and test (scored once, at the end). When a
source has no validation or test split, one is carved off the training split with a
fixed seed (0), the same for every run, so runs with different seeds are comparable.

Two input pipelines give the same batches in the same form. tf.data (Keras documents
it as an input pipeline for JAX and PyTorch too) reads every source and is the default
where TensorFlow is installed. Without TensorFlow, digits and folders are read by
`keras_vitnorm.training.python_data`, a `keras.utils.PyDataset` (`pipeline` of
`load_dataset`). Augmentations are Keras core preprocessing layers, except the crops
and flips, which are keyed by each example's position so that a resumed run sees
exactly the augmented batches the uninterrupted run would have
(`_keyed_augmentation`).

Images enter the model as float32 in [-1, 1] (big_vision's `value_range(-1, 1)`).
"""

import contextlib
import dataclasses
import math
import os

import keras
import numpy as np

from keras_vitnorm.choices import INPUT_PIPELINES
from keras_vitnorm.training.image_files import check_image_file
from keras_vitnorm.training.image_files import list_bad_files
from keras_vitnorm.training.image_files import unreadable_file_error
from keras_vitnorm.validation import check_choice

DATASET_CHOICES = ("digits", "tfds:<name>", "folder:<path>")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")
# Fraction held out as the test split when a source has none (folders without test/).
TEST_FRACTION = 0.2


class Split:
    """One split: its `(raw, label)` pairs and its size.

    `raw` is whatever the source stores (a uint8 image, encoded image bytes or a file
    path); `Dataset.decode` turns it into a uint8 `(height, width, channels)` image.
    A tfds split is a tf.data.Dataset (`source`); a digits or folder split holds
    NumPy arrays `arrays = (raws, labels)`, and its `source` is made from them when the
    tf.data pipeline asks for it, so the pipeline without TensorFlow
    (`keras_vitnorm.training.python_data`) never imports TensorFlow.
    """

    def __init__(self, name, source=None, size=None, arrays=None):
        if (source is None) == (arrays is None):
            raise ValueError("A Split has either a tf.data source or arrays.")
        self.name, self._source, self.arrays = name, source, arrays
        self.size = len(arrays[1]) if size is None else size

    @property
    def source(self):
        if self._source is None:
            self._source = _tf().data.Dataset.from_tensor_slices(self.arrays)
        return self._source


@dataclasses.dataclass
class Dataset:
    """The three splits of a dataset and what the model needs to know about it."""

    name: str
    train: Split
    validation: Split
    test: Split
    num_classes: int
    channels: int
    class_names: list
    decode: object
    files: list = None
    skipped: list = None
    pipeline: str = "tf.data"

    def describe(self):
        text = (
            f"{self.name}: {self.num_classes} classes, {self.channels} channel(s); "
            f"train {self.train.size} ({self.train.name}), validation "
            f"{self.validation.size} ({self.validation.name}), test {self.test.size} "
            f"({self.test.name})"
        )
        if self.skipped:
            text += f"; skipped {len(self.skipped)} unreadable image(s): " + list_bad_files(self.skipped)
        return text


@contextlib.contextmanager
def unreadable_images_named(data):
    """Turns TensorFlow's decode error inside the pipeline into an error naming the files.

    The up-front check (`check_image_file`) reads only each file's ends; a file damaged
    in the middle fails when TensorFlow decodes it, with a message that names no file.
    Then every file of a folder dataset is decoded here to find the ones that fail.
    """
    try:
        yield
    except Exception as error:
        if type(error).__name__ != "InvalidArgumentError" or not data.files:
            raise
        tf = _tf()
        bad = []
        for path in data.files:
            try:
                tf.io.decode_image(tf.io.read_file(path), expand_animations=False)
            except Exception as decode_error:  # noqa: BLE001 (TensorFlow's error types vary)
                bad.append((path, f"does not decode ({type(decode_error).__name__})"))
        if not bad:
            raise
        raise unreadable_file_error(bad) from error


def _tf():
    try:
        import tensorflow as tf
    except ImportError:
        raise ImportError(
            "The tf.data input pipeline (tfds datasets, input_pipeline='tf.data') needs "
            "TensorFlow: pip install 'keras-vitnorm[tensorflow]' (or tensorflow). Digits and "
            "folder datasets also train without it (input_pipeline='python')."
        ) from None
    return tf


def parse_dataset(spec):
    """Splits `"tfds:cifar10"` into `("tfds", "cifar10")`; raises on an unknown form."""
    if not isinstance(spec, str):
        raise ValueError(f"dataset must be a string such as 'digits', got {spec!r}.")
    if spec == "digits":
        return "digits", None
    for kind in ("tfds", "folder"):
        if spec.startswith(kind + ":"):
            argument = spec[len(kind) + 1 :]
            if not argument:
                raise ValueError(f"dataset={spec!r} names no {kind} {'dataset' if kind == 'tfds' else 'path'}.")
            return kind, argument
    raise ValueError(
        f"Unknown dataset={spec!r}. Valid forms: {', '.join(DATASET_CHOICES)} "
        "(e.g. 'tfds:cifar10' or 'folder:/data/flowers')."
    )


def load_dataset(spec, val_fraction=0.1, data_dir=None, manual_dir=None, train_examples=None,
                 skip_bad_images=False, val_examples=None, pipeline="auto"):
    """Loads the train, validation and test splits of a dataset.

    Args:
        spec: `"digits"`, `"tfds:<name>"` or `"folder:<path>"`.
        val_fraction: float in (0, 1). Fraction of the training data held out for
            validation when the source has no validation split.
        data_dir: tfds data directory (default: tfds' own, `~/tensorflow_datasets`).
        manual_dir: directory holding manually downloaded archives, for datasets such
            as `imagenet2012` that tfds cannot download itself.
        train_examples: int or None. Train on a subset of this many training
            examples (validation and test are unchanged). For digits and folders the
            subset is stratified by class with seed 0, the same for every run; for
            tfds it is the first `train_examples` of the training split (tfds
            shuffles a dataset's examples when it prepares it).
        skip_bad_images: bool, default `False`. For folders: every file is checked
            first (`check_image_file`); unreadable ones are an error naming them, or,
            with `True`, left out and listed by `Dataset.describe`.
        val_examples: int or None. Validate on this many training examples instead
            of the source's validation split, taken apart from the `train_examples`
            (VTAB-1k's `train800` and `val200`): for tfds the next `val_examples`
            after the first `train_examples`; for digits and folders a
            class-stratified draw of both with seed 0, split stratified.
        pipeline: `"auto"` (default), `"tf.data"` or `"python"`: the input pipeline
            that `train_stream` and `eval_dataset` build. `"python"` is Keras'
            `PyDataset` without TensorFlow (`keras_vitnorm.training.python_data`), for
            digits and folders; `"auto"` is tf.data where TensorFlow is installed and
            `"python"` elsewhere. tfds datasets need tf.data.

    Returns:
        A `Dataset`.
    """
    if isinstance(val_fraction, bool) or not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}.")
    for name, value in (("train_examples", train_examples), ("val_examples", val_examples)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    kind, argument = parse_dataset(spec)
    pipeline = resolve_pipeline(pipeline, spec)
    if kind == "digits":
        data = _digits(val_fraction)
    elif kind == "tfds":
        data = _tfds(argument, val_fraction, data_dir, manual_dir)
    else:
        data = _folder(argument, val_fraction, skip_bad_images)
    if val_examples is not None:
        count = data.train.size - val_examples if train_examples is None else train_examples
        if count < 1:
            raise ValueError(
                f"val_examples={val_examples} leaves no training examples of the {data.train.size} "
                f"in {spec} ({data.train.name})."
            )
        pool = _train_subset(data.train, count + val_examples, stratified=kind != "tfds", name=spec)
        data.train, data.validation = _split_off(pool, val_examples, stratified=kind != "tfds")
    elif train_examples is not None:
        data.train = _train_subset(data.train, train_examples, stratified=kind != "tfds", name=spec)
    data.pipeline = pipeline
    return data


def resolve_pipeline(pipeline, spec):
    """The input pipeline, `"tf.data"` or `"python"`, that `pipeline` names for the
    dataset `spec` (see `load_dataset`); raises if it cannot read it."""
    import importlib.util

    check_choice("input_pipeline", pipeline, INPUT_PIPELINES)
    tfds = parse_dataset(spec)[0] == "tfds"
    if pipeline == "auto":
        pipeline = "tf.data" if tfds or importlib.util.find_spec("tensorflow") else "python"
    if pipeline == "python" and tfds:
        raise ValueError(
            f"input_pipeline='python' reads digits and folder datasets; {spec} is read by "
            "tensorflow-datasets through tf.data (input_pipeline='tf.data' or 'auto')."
        )
    if pipeline == "tf.data":
        _tf()  # says how to install TensorFlow, or to use input_pipeline='python'
    return pipeline


def _split_off(split, count, stratified):
    """`(rest, held_out)` of `split` with `count` examples held out: the last ones
    (tfds order), or a class-stratified draw with seed 0."""
    keep = split.size - count
    if not stratified:
        return (Split(f"first {keep} of {split.name}", split.source.take(keep), keep),
                Split(f"next {count} of {split.name}", split.source.skip(keep).take(count), count))
    raws, labels = split.arrays
    kept, held_out = _stratified_split(labels, count / split.size)
    return (Split(f"{len(kept)} of {split.name}", arrays=(raws[kept], labels[kept])),
            Split(f"{len(held_out)} of {split.name}, held out",
                  arrays=(raws[held_out], labels[held_out])))


def subset(split, count, name):
    """At most `count` examples of `split`: a class-stratified draw with seed 0 where
    the split holds arrays (digits, folders), its first `count` otherwise (tfds); the
    split itself where it has no more. `name` (the dataset) is for error messages."""
    if count >= split.size:
        return split
    return _train_subset(split, count, stratified=split.arrays is not None, name=name)


def _train_subset(split, count, stratified, name):
    """The first `count` examples of `split` (tfds) or a class-stratified subset."""
    if count > split.size:
        raise ValueError(
            f"train_examples={count} is more than the {split.size} training examples of "
            f"{name} ({split.name})."
        )
    description = f"{count} of {split.name}"
    if not stratified:
        return Split(description, split.source.take(count), count)
    raws, labels = split.arrays
    if count < len(labels):
        from sklearn.model_selection import train_test_split

        indices = np.arange(len(labels))
        try:
            kept, _ = train_test_split(indices, train_size=count, stratify=labels, random_state=0)
        except ValueError:  # fewer examples than classes: a plain random subset
            kept, _ = train_test_split(indices, train_size=count, random_state=0)
        kept = np.sort(kept)
        raws, labels = raws[kept], labels[kept]
    return Split(description + ", stratified", arrays=(raws, labels))


def _stratified_split(labels, fraction, seed=0):
    """Indices `(kept, held_out)` with `fraction` of every class held out."""
    from sklearn.model_selection import train_test_split

    indices = np.arange(len(labels))
    try:
        kept, held_out = train_test_split(
            indices, test_size=fraction, stratify=labels, random_state=seed
        )
    except ValueError:  # a class too small to stratify: split without stratification
        kept, held_out = train_test_split(indices, test_size=fraction, random_state=seed)
    return np.sort(kept), np.sort(held_out)


def _digits(val_fraction):
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype("uint8")[..., None]
    labels = digits.target.astype("int64")
    rest, test = _stratified_split(labels, TEST_FRACTION)
    train_pos, val_pos = _stratified_split(labels[rest], val_fraction)
    train, val = rest[train_pos], rest[val_pos]

    def split(name, index):
        return Split(name, arrays=(images[index], labels[index]))

    return Dataset(
        name="digits",
        train=split("train", train),
        validation=split(f"{val_fraction:.0%} of the non-test images", val),
        test=split(f"{TEST_FRACTION:.0%} of all images", test),
        num_classes=10,
        channels=1,
        class_names=[str(i) for i in range(10)],
        decode=lambda raw: raw,
    )


def prepared_tfds_builder(name, features, task, data_dir=None, manual_dir=None):
    """`(builder, split names)` of the tensorflow-datasets dataset `name`, prepared.

    Args:
        name: the dataset's tfds name.
        features: the feature names the task needs, e.g. `("image", "label")`.
        task: what needs them, for the error message (e.g. "classification").
        data_dir, manual_dir: tfds' data and manual-download folders.
    """
    import tensorflow_datasets as tfds

    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception as error:  # tfds raises DatasetNotFoundError with its own list
        raise ValueError(f"Unknown tensorflow-datasets dataset {name!r}: {error}") from None
    have = builder.info.features
    if any(feature not in have for feature in features):
        raise ValueError(
            f"tfds:{name} has features {sorted(have.keys())}: it is not a {task} dataset "
            "(one with " + " and ".join(repr(f) for f in features) + " features)."
        )
    download_config = tfds.download.DownloadConfig(manual_dir=manual_dir) if manual_dir else None
    builder.download_and_prepare(download_config=download_config)
    # Mocked and some prepared builders record no splits: train and test are the common pair.
    return builder, set(builder.info.splits.keys()) or {"train", "test"}


def _tfds(name, val_fraction, data_dir, manual_dir):
    import tensorflow_datasets as tfds

    builder, available = prepared_tfds_builder(name, ("image", "label"), "classification",
                                               data_dir, manual_dir)
    features = builder.info.features
    percent = round(100 * val_fraction)
    if "test" in available:
        test_split = "test"
        if "validation" in available:
            train_split, val_split = "train", "validation"
        else:
            train_split, val_split = f"train[:{100 - percent}%]", f"train[{100 - percent}%:]"
    else:  # e.g. imagenet2012: score on validation, select on a slice of train (minival)
        test_split = "validation"
        train_split, val_split = f"train[:{100 - percent}%]", f"train[{100 - percent}%:]"

    def split(split_name):
        source = builder.as_dataset(
            split=split_name,
            as_supervised=True,
            shuffle_files=False,
            decoders={"image": tfds.decode.SkipDecoding()},
        )
        size = int(source.cardinality())
        if size < 0:
            size = int(source.reduce(0, lambda count, _: count + 1))
        return Split(split_name, source, size)

    channels = features["image"].shape[-1] or 3
    tf = _tf()

    def decode(raw):
        return tf.io.decode_image(raw, channels=channels, expand_animations=False)

    return Dataset(
        name=f"tfds:{name}",
        train=split(train_split),
        validation=split(val_split),
        test=split(test_split),
        num_classes=features["label"].num_classes,
        channels=channels,
        class_names=list(features["label"].names),
        decode=decode,
    )


def _list_images(directory, classes=None):
    """`(paths, labels, classes)` of a class-per-folder tree."""
    # Hidden entries (".ipynb_checkpoints", ".DS_Store", ...) are neither classes nor images.
    found = sorted(
        entry
        for entry in os.listdir(directory)
        if not entry.startswith(".") and os.path.isdir(os.path.join(directory, entry))
    )
    if classes is None:
        classes = found
    else:
        extra = sorted(set(found) - set(classes))
        if extra:
            raise ValueError(
                f"{directory} has class folder(s) {extra} that the training folder lacks; "
                f"training classes: {classes}."
            )
    paths, labels = [], []
    for label, name in enumerate(classes):
        folder = os.path.join(directory, name)
        if not os.path.isdir(folder):
            continue
        for file in sorted(os.listdir(folder)):
            if not file.startswith(".") and file.lower().endswith(IMAGE_EXTENSIONS):
                paths.append(os.path.join(folder, file))
                labels.append(label)
    if not paths:
        raise ValueError(
            f"{directory} holds no images in class subfolders (expected "
            f"{directory}/<class>/<image> with extensions {', '.join(IMAGE_EXTENSIONS)})."
        )
    return np.array(paths), np.array(labels, "int64"), classes


def _check_folder_images(splits, skip_bad_images):
    """`(splits without unreadable files, [(path, why), ...])`; raises unless skipping."""
    bad = []
    for paths, _, _ in splits:
        for file in paths:
            why = check_image_file(file)
            if why:
                bad.append((str(file), why))
    if bad and not skip_bad_images:
        raise unreadable_file_error(bad)
    rejected = {path for path, _ in bad}
    kept = []
    for paths, labels, name in splits:
        keep = np.array([str(p) not in rejected for p in paths], bool)
        kept.append((paths[keep], labels[keep], name))
    return kept, bad


def _channels_of(path):
    """1 for a grayscale image file (with or without alpha), else 3 (read by Pillow)."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            mode = image.mode
    except (OSError, ValueError, SyntaxError) as error:
        raise unreadable_file_error([(str(path), f"does not decode ({error})")]) from None
    return 1 if mode in ("1", "L", "LA", "La", "I", "I;16", "F") else 3


def _folder(path, val_fraction, skip_bad_images=False):
    if not os.path.isdir(path):
        raise ValueError(f"dataset folder {path!r} does not exist or is not a directory.")
    train_root = os.path.join(path, "train")
    if os.path.isdir(train_root):
        paths, labels, classes = _list_images(train_root)
        val_root = next(
            (os.path.join(path, d) for d in ("val", "validation") if os.path.isdir(os.path.join(path, d))),
            None,
        )
        test_root = os.path.join(path, "test")
        if os.path.isdir(test_root):
            test = (*_list_images(test_root, classes)[:2], f"{test_root}")
        else:
            kept, held = _stratified_split(labels, TEST_FRACTION)
            test = (paths[held], labels[held], f"{TEST_FRACTION:.0%} of {train_root}")
            paths, labels = paths[kept], labels[kept]
        if val_root:
            val = (*_list_images(val_root, classes)[:2], val_root)
            train = (paths, labels, train_root)
        else:
            kept, held = _stratified_split(labels, val_fraction)
            val = (paths[held], labels[held], f"{val_fraction:.0%} of {train_root}")
            train = (paths[kept], labels[kept], f"the rest of {train_root}")
    else:
        paths, labels, classes = _list_images(path)
        rest, test_index = _stratified_split(labels, TEST_FRACTION)
        test = (paths[test_index], labels[test_index], f"{TEST_FRACTION:.0%} of {path}")
        kept, held = _stratified_split(labels[rest], val_fraction)
        val = (paths[rest][held], labels[rest][held], f"{val_fraction:.0%} of the rest")
        train = (paths[rest][kept], labels[rest][kept], "the rest")
    if len(classes) < 2:
        raise ValueError(f"dataset folder {path!r} has {len(classes)} class folder(s); need at least 2.")
    (train, val, test), bad = _check_folder_images((train, val, test), skip_bad_images)
    for split_paths, _, name in (train, val, test):
        if not len(split_paths):
            raise ValueError(f"dataset folder {path!r}: the split {name} has no readable images left.")

    channels = _channels_of(train[0][0])

    def split(paths_labels_name):
        split_paths, split_labels, name = paths_labels_name
        return Split(name, arrays=(split_paths, split_labels))

    def decode(raw):
        tf = _tf()
        image = tf.io.decode_image(tf.io.read_file(raw), channels=channels, expand_animations=False)
        image.set_shape([None, None, channels])
        return image

    return Dataset(
        name=f"folder:{path}",
        train=split(train),
        validation=split(val),
        test=split(test),
        num_classes=len(classes),
        channels=channels,
        class_names=list(classes),
        decode=decode,
        files=[str(p) for split_paths, _, _ in (train, val, test) for p in split_paths],
        skipped=bad,
    )


@dataclasses.dataclass
class Augmentation:
    """Training-time augmentation: crops and flips keyed by position, then Keras layers.

    Crops and flips are computed by `_keyed_augmentation` (the same transformations as
    Keras' `RandomCrop`, `RandomZoom` and `RandomFlip`, drawn per example position so a
    resumed run is exact); RandAugment, MixUp and CutMix are Keras core layers.

    Attributes:
        crop: `"none"`, `"pad"` (zero-pad by `crop_padding` pixels, then a random crop
            back to size: the CIFAR recipe) or `"zoom"` (random zoom-in of up to
            `zoom` of each side, approximating Inception-style crops; Keras core has no
            RandomResizedCrop).
        crop_padding: int, pixels for `crop="pad"`.
        zoom: float in [0, 1), the largest zoom-in for `crop="zoom"`.
        flip: bool, random horizontal flips.
        randaugment_ops: int, RandAugment operations per image (0 = off).
        randaugment_factor: float in [0, 1], Keras RandAugment strength.
        mixup: float, MixUp Beta(alpha, alpha) concentration (0 = off).
        cutmix: float, CutMix Beta concentration (0 = off). With both on, each batch
            gets one of them, chosen with probability 1/2 (as timm does).
    """

    crop: str = "none"
    crop_padding: int = 4
    zoom: float = 0.5
    flip: bool = False
    randaugment_ops: int = 0
    randaugment_factor: float = 0.5
    mixup: float = 0.0
    cutmix: float = 0.0


def _to_model_image(image, image_size, channels):
    """uint8 image of any size -> float32 `(h, w, channels)` in [0, 255]."""
    tf = _tf()
    image = tf.convert_to_tensor(image)
    have = image.shape[-1]
    if have == 1 and channels == 3:
        image = tf.image.grayscale_to_rgb(image)
    elif have == 3 and channels == 1:
        image = tf.image.rgb_to_grayscale(image)
    image = tf.image.resize(tf.cast(image, "float32"), image_size, method="bilinear")
    return tf.clip_by_value(image, 0.0, 255.0)


def _to_model_range(image):
    return image / 127.5 - 1.0


def eval_dataset(data, split, image_size, channels, batch_size, pad=False):
    """Batched `(images, one-hot labels)` of a split, in order, no augmentation.

    With `pad`, the split is padded with blank examples to whole batches and each
    batch carries sample weights (1 for the split's examples, 0 for the blanks):
    `(images, labels, weights)`. Every batch is then full, which JAX's processes need
    to split each batch among themselves; the accuracy is the split's own, and a
    loss averaged over the batches is the split's times `padded_size(...) / size`.
    """
    if data.pipeline == "python":
        from keras_vitnorm.training import python_data

        return python_data.EvalBatches(data, split, image_size, channels, batch_size, pad)
    tf = _tf()
    image_size = tuple(image_size)

    def prepare(raw, label):
        image = _to_model_image(data.decode(raw), image_size, channels)
        return _to_model_range(image), tf.one_hot(label, data.num_classes)

    dataset = split.source.map(prepare, num_parallel_calls=tf.data.AUTOTUNE)
    if pad:
        blanks = padded_size(split.size, batch_size) - split.size
        blank = (tf.zeros((*image_size, channels)), tf.zeros((data.num_classes,)))
        dataset = dataset.map(lambda x, y: (x, y, 1.0)).concatenate(
            tf.data.Dataset.from_tensors((*blank, 0.0)).repeat(blanks))
    dataset = dataset.batch(batch_size)
    if split.size * math.prod(image_size) * channels * 4 < 2**30:
        dataset = dataset.cache()
    return dataset.prefetch(tf.data.AUTOTUNE)


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


def train_stream(
    data,
    image_size,
    channels,
    batch_size,
    seed,
    augmentation,
    start_step=0,
    end_step=None,
    shuffle_buffer=50_000,
    share=(0, 1),
):
    """Augmented training batches for steps `start_step` up to `end_step`.

    With `share=(index, count)`, the batches hold only this process's share of each
    global batch of `batch_size`: its `index`-th slice of `batch_size // count`
    examples, augmented as in the whole batch (MixUp and CutMix mix within the share).

    Pass `p` over the training split is shuffled with the seed `seed + p`, so the
    batches are the same sequence whatever step the stream starts from: a resumed run
    continues with the examples it would have seen next instead of replaying the
    interrupted epoch, and skips at most one pass to get there. A pass never repeats an
    example; a batch may span the end of one pass and the start of the next. Crops and
    flips are keyed by the example's position, so the augmented batches are the same too
    (`resumes_exactly` says when that holds for the whole augmentation).
    With `data.pipeline == "python"` the same stream is a `keras.utils.PyDataset`
    (`keras_vitnorm.training.python_data.TrainBatches`), each pass fully shuffled.
    """
    end_step = end_step if end_step is not None else start_step + 1_000_000
    if data.pipeline == "python":
        from keras_vitnorm.training import python_data

        return python_data.TrainBatches(
            data, image_size, channels, batch_size, seed, augmentation, start_step, end_step,
            share, stateful=_stateful_augmentation(augmentation, channels, seed))
    tf = _tf()
    image_size = tuple(image_size)
    size = data.train.size
    first_pass, offset = divmod(start_step * batch_size, size)
    last_pass = (end_step * batch_size - 1) // size
    source = data.train.source
    if size <= 200_000:
        source = source.cache()
    buffer = min(size, shuffle_buffer)
    passes = [
        source.shuffle(buffer, seed=seed + index, reshuffle_each_iteration=False)
        for index in range(first_pass, last_pass + 1)
    ]
    passes[0] = passes[0].skip(offset)
    lengths = [size - offset] + [size] * (len(passes) - 1)
    order = tf.data.Dataset.from_tensor_slices(tf.range(len(passes), dtype="int64"))
    order = order.flat_map(
        lambda index: tf.data.Dataset.from_tensors(index).repeat(tf.gather(tf.constant(lengths, "int64"), index))
    )
    stream = tf.data.Dataset.choose_from_datasets(passes, order, stop_on_empty_dataset=False)
    positions = tf.data.Dataset.range(start_step * batch_size, end_step * batch_size)
    stream = tf.data.Dataset.zip((positions, stream))
    keyed = _keyed_augmentation(augmentation, image_size, channels, seed)
    stateful = _stateful_augmentation(augmentation, channels, seed)

    index, count = share
    local_batch = batch_size // count
    if count > 1:
        stream = stream.filter(lambda position, _: position % batch_size // local_batch == index)

    def prepare(position, example):
        raw, label = example
        image = _to_model_image(data.decode(raw), image_size, channels)
        return keyed(image, position), tf.one_hot(label, data.num_classes)

    def augment(image, label):
        for layer in stateful:
            image = layer(image)
        return image, label

    stream = stream.map(prepare, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    # Keras' RandAugment draws from a stateful seed generator: in a parallel map the
    # order of the draws (so which image gets which operations) would depend on thread
    # timing. Run it in order, so a seed gives the same augmented stream every time.
    if stateful:
        stream = stream.map(augment)
    stream = stream.batch(local_batch, drop_remainder=True)
    random_batches = bool(augmentation.mixup or augmentation.cutmix)
    stream = stream.map(_batch_augmentation(augmentation, seed),
                        num_parallel_calls=None if random_batches else tf.data.AUTOTUNE)
    return stream.prefetch(tf.data.AUTOTUNE)


def resumes_exactly(augmentation):
    """Whether a stream started at any step gives the batches the full run gives there.

    The crops and flips are keyed by each example's position in the stream; RandAugment,
    MixUp and CutMix are Keras layers drawing from a stateful seed generator that
    restarts with the stream, so with them a resumed run sees other (equally
    distributed) draws.
    """
    return not (augmentation.randaugment_ops or augmentation.mixup or augmentation.cutmix)


def _keyed_augmentation(augmentation, image_size, channels, seed):
    """`f(image, position)`: the crop and flip of the example at `position` in the stream.

    Why not Keras' `RandomCrop`, `RandomZoom` and `RandomFlip`: they draw from a
    stateful seed generator that cannot be seeded per call, so a stream restarted at
    step `s` (a resumed run) would give other crops than the uninterrupted run did at
    `s`. Here every random number comes from TensorFlow's stateless ops with the seed
    `(seed, position)`, so an example's augmentation depends only on where it is in the
    stream, and any stream position can be rebuilt exactly. Same transformations as
    the Keras layers: `pad` zero-pads by `crop_padding` then crops a random
    `image_size` window; `zoom` zooms in about the centre by a random factor in
    `[1 - zoom, 1]` per axis (bilinear); `flip` mirrors half of the images.
    """
    tf = _tf()
    height, width = image_size

    def augment(image, position):
        key = tf.stack([tf.constant(seed, "int64"), position])
        crop_key, flip_key = tf.unstack(tf.random.experimental.stateless_split(key, 2))
        if augmentation.crop == "pad":
            pad = augmentation.crop_padding
            image = tf.pad(image, [[pad, pad], [pad, pad], [0, 0]])
            image = tf.image.stateless_random_crop(image, [height, width, channels], crop_key)
        elif augmentation.crop == "zoom":
            scale = tf.random.stateless_uniform([2], crop_key, 1.0 - augmentation.zoom, 1.0)
            box = tf.concat([0.5 - scale / 2, 0.5 + scale / 2], axis=0)[None]
            image = tf.image.crop_and_resize(image[None], box, [0], [height, width])[0]
        if augmentation.flip:
            image = tf.image.stateless_random_flip_left_right(image, flip_key)
        return image

    return augment


def _stateful_augmentation(augmentation, channels, seed):
    """Keras' RandAugment, if asked for (see `resumes_exactly`)."""
    if not augmentation.randaugment_ops:
        return []
    if channels != 3:
        raise ValueError(
            "RandAugment needs RGB images; this dataset/model has "
            f"{channels} channel(s). Set randaugment_ops=0."
        )
    layer = keras.layers.RandAugment(
        value_range=(0, 255),
        num_ops=augmentation.randaugment_ops,
        factor=augmentation.randaugment_factor,
        seed=seed,
    )
    count_histograms_with_bincount(getattr(layer, "equalization", None))
    return [layer]


def count_histograms_with_bincount(equalization):
    """Makes a Keras `Equalization` layer count its histogram with `bincount` whenever it
    computes with TensorFlow (in a tf.data stream); returns whether it could.

    Keras 3.15's `Equalization` chooses how to count its 256-bin histogram by the global
    backend, not by the backend it computes with: under JAX, inside tf.data, it takes
    the JAX code, a Python loop over the 256 bins of every channel, which tf.data builds
    op by op: the stream then takes eight times as long to build and to give its
    first batch, and delivers a quarter of the images per second after it
    (`benchmarks/bench_randaugment.py`;
    docs/performance.md, "RandAugment under JAX"). This replaces the layer's private
    `_custom_histogram_fixed_width` on this one layer, counting as Keras does (each
    value's bin, clipped to the range) with `tf.math.bincount`. Where the layer has no
    such method (another Keras version), it is left as Keras made it: the stream is
    slower under JAX, and the same.
    """
    keras_histogram = getattr(equalization, "_custom_histogram_fixed_width", None)
    if keras_histogram is None:
        return False

    def histogram(values, value_range, nbins):
        if equalization.backend.name != "tensorflow":
            return keras_histogram(values, value_range, nbins)
        tf = _tf()
        low, high = (tf.cast(bound, "float32") for bound in value_range)
        bins = tf.cast((tf.cast(values, "float32") - low) * (nbins - 1) / (high - low), "int32")
        bins = tf.reshape(tf.clip_by_value(bins, 0, nbins - 1), [-1])
        return tf.math.bincount(bins, minlength=nbins, maxlength=nbins, dtype="int32")

    equalization._custom_histogram_fixed_width = histogram
    return True


def _batch_augmentation(augmentation, seed):
    tf = _tf()
    mixup = keras.layers.MixUp(alpha=augmentation.mixup, seed=seed) if augmentation.mixup else None
    cutmix = keras.layers.CutMix(factor=augmentation.cutmix, seed=seed) if augmentation.cutmix else None

    def apply(layer, images, labels):
        out = layer({"images": images, "labels": labels})
        return out["images"], out["labels"]

    def augment(images, labels):
        if mixup and cutmix:
            images, labels = tf.cond(
                tf.random.uniform([]) < 0.5,
                lambda: apply(mixup, images, labels),
                lambda: apply(cutmix, images, labels),
            )
        elif mixup or cutmix:
            images, labels = apply(mixup or cutmix, images, labels)
        return _to_model_range(images), labels

    return augment
